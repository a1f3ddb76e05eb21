"""One ``psyswarm localnet`` in its own process for the session, reached over real HTTP and websocket.

Tests share the chain and isolate themselves by run id and by fresh identities, funded through the
``requestAirdrop`` RPC method as a developer would fund them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from solana.rpc.async_api import AsyncClient
from solders.keypair import Keypair

from client.identity import save_keypair
from coordinator_program.spec.config import RunSpec, parse_run_spec

START_TIMEOUT = 30.0
FUNDS = 10 * 10**9


def run_spec(run_id: str, warmup_time: int = 60) -> RunSpec:
    """Three stages, admitted at four clients (a worker per stage and a trainer)."""
    return parse_run_spec({
        "run_id": run_id,
        "config": {"min_clients": 4, "max_clients": 8, "num_stages": 3, "witness_nodes": 2, "witness_quorum": 2,
                   "warmup_time": warmup_time, "max_round_train_time": 30, "round_witness_time": 1,
                   "cooldown_time": 1, "rounds_per_epoch": 3},
        "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
    })


def new_run_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _port_pair() -> int:
    """A port P such that P and P + 1 are free: localnet serves JSON-RPC on P and websockets on P + 1."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


@dataclasses.dataclass
class Localnet:
    url: str
    ws_url: str
    port: int
    funded: Keypair
    """A key the chain funded at start through ``--fund``."""

    def rpc(self, method: str, params: list[Any] | None = None) -> dict[str, Any]:
        """One raw JSON-RPC call; the whole reply object, error or result."""
        body = {"jsonrpc": "2.0", "id": 1, "method": method, **({"params": params} if params is not None else {})}
        return httpx.post(self.url, json=body, timeout=10).json()

    async def fund(self, *keypairs: Keypair) -> None:
        async with AsyncClient(self.url) as client:
            for keypair in keypairs:
                await client.request_airdrop(keypair.pubkey(), FUNDS)

    def funded_keypairs(self, count: int) -> list[Keypair]:
        keypairs = [Keypair() for _ in range(count)]
        asyncio.run(self.fund(*keypairs))
        return keypairs


@pytest.fixture(scope="session")
def localnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Localnet]:
    """The chain's output goes to a file (a pipe nobody reads could fill and stall it); it is ready when it
    prints its banner, which it does once both ports listen."""
    port, funded = _port_pair(), Keypair()
    directory = Path(tmp_path_factory.mktemp("localnet"))
    key_file = save_keypair(funded, directory / "funded.json")
    output = directory / "localnet.log"
    with output.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "client.cli", "localnet", "--port", str(port), "--fund", str(key_file)],
            stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while "psyswarm localnet:" not in output.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"localnet did not start (exit code {process.poll()}):\n{output.read_text()}")
            time.sleep(0.05)
        yield Localnet(f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port + 1}", port, funded)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
