"""What the Solana backend decides without a chain: URLs, the program id, and instructions built by anchorpy."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from solders.compute_budget import set_compute_unit_limit
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from client.backends.base import BackendError
from client.backends.solana import SolanaBackend, resolve_url, websocket_url
from coordinator_program.onchain.budget import TICK_UNITS
from coordinator_program.onchain.program_id import PROGRAM_ID, PROGRAM_KEYPAIR_PATH
from coordinator_program.spec.config import Checkpoint, CheckpointKind, Config, Model
from coordinator_program.spec.instructions import (
    INSTRUCTIONS,
    CheckpointReport,
    CommitSeed,
    HealthCheck,
    InitCoordinator,
    Instruction,
    JoinRun,
    ReleaseSlot,
    RevealSeed,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Witness,
)
from coordinator_program.spec.state import Role


@pytest.mark.parametrize("given, url", [
    ("localhost", "http://127.0.0.1:8899"), ("l", "http://127.0.0.1:8899"),
    ("devnet", "https://api.devnet.solana.com"), ("t", "https://api.testnet.solana.com"),
    ("mainnet-beta", "https://api.mainnet-beta.solana.com"), ("http://10.0.0.5:9000", "http://10.0.0.5:9000"),
])
def test_url_monikers(given: str, url: str) -> None:
    assert resolve_url(given) == url


@pytest.mark.parametrize("bad", ["", "localnet", "ftp://x", "http://", "127.0.0.1:8899"])
def test_bad_urls_are_refused(bad: str) -> None:
    with pytest.raises(BackendError, match="--url must be"):
        resolve_url(bad)


@pytest.mark.parametrize("rpc, ws", [
    ("http://127.0.0.1:8899", "ws://127.0.0.1:8900"),
    ("https://api.devnet.solana.com", "wss://api.devnet.solana.com"),
    ("https://rpc.example.org:8443/key?x=1", "wss://rpc.example.org:8444/key?x=1"),
    ("http://[::1]:8899", "ws://[::1]:8900"),
])
def test_websocket_url_follows_the_solana_cli(rpc: str, ws: str) -> None:
    assert websocket_url(rpc) == ws


def test_the_default_program_id_is_the_committed_keypairs() -> None:
    secret = bytes(json.loads(PROGRAM_KEYPAIR_PATH.read_text()))
    assert Keypair.from_bytes(secret).pubkey() == PROGRAM_ID


WITH_ARGUMENTS: list[Instruction] = [
    InitCoordinator("run-1", bytes(range(32)), bytes(32)),
    Update(Config(), Model(), Checkpoint(CheckpointKind.Hub, "org/model", "main")),
    SetPaused(True), JoinRun("run-1", Role.Trainer), JoinRun("run-1", Role.Worker, 2),
    Witness(7, b"\x01" * 11, b"\x02" * 3), WarmupWitness(b"", b"\x03"), HealthCheck(bytes(range(1, 33))),
    CheckpointReport(CheckpointKind.Local, "/ckpt/run-1", "epoch-3"), ReleaseSlot(bytes(range(2, 34))),
    CommitSeed(5, bytes(range(3, 35))), RevealSeed(5, bytes(range(4, 36))),
]
EVERY_INSTRUCTION = WITH_ARGUMENTS + [cls() for cls in INSTRUCTIONS if not dataclasses.fields(cls)]


def test_every_instruction_is_covered() -> None:
    assert {type(ix) for ix in EVERY_INSTRUCTION} == set(INSTRUCTIONS)


@pytest.mark.parametrize("ix", EVERY_INSTRUCTION, ids=lambda ix: ix.NAME)
def test_anchorpy_builds_the_specifications_bytes(ix: Instruction) -> None:
    joiner, authority = Keypair(), Keypair()
    backend = SolanaBackend("http://127.0.0.1:1", joiner, "run-1", authorizer=authority)
    backend.coordinator_address = Pubkey.new_unique()
    built = backend.instruction(ix)
    assert bytes(built.data) == ix.encode()
    assert built.program_id == PROGRAM_ID
    expected = {"signer": joiner.pubkey(), "payer": joiner.pubkey(), "authorizer": authority.pubkey(),
                "coordinatorInstance": backend.instance_address, "coordinatorAccount": backend.coordinator_address}
    assert [(m.pubkey, m.is_signer, m.is_writable) for m in built.accounts] == [
        (expected.get(a.name, Pubkey.default()), a.signer, a.mut) for a in ix.ACCOUNTS]


@pytest.mark.parametrize("ix", EVERY_INSTRUCTION, ids=lambda ix: ix.NAME)
def test_a_tick_alone_asks_for_more_compute_units(ix: Instruction, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tick that elects a round's witnesses costs about 360,000 units at 1,024 clients, above the default
    200,000: its transaction carries ComputeBudget's request (``onchain.budget``), and no other does."""
    backend = SolanaBackend("http://127.0.0.1:1", Keypair(), "run-1", authorizer=Keypair())
    backend.coordinator_address = Pubkey.new_unique()
    sent: list[list[object]] = []

    async def send(instructions: list[object], what: str, cosigner: object = None) -> None:
        sent.append(instructions)

    async def refresh() -> None:
        return None

    monkeypatch.setattr(backend, "_send", send)
    monkeypatch.setattr(backend, "refresh", refresh)
    asyncio.run(backend.submit(ix))
    expected = [set_compute_unit_limit(TICK_UNITS)] if isinstance(ix, Tick) else []
    assert sent == [[*expected, backend.instruction(ix)]]
