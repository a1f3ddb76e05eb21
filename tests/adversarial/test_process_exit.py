"""A contributor's process ends cleanly: SIGTERM stops it within seconds whatever it is doing, and a join that
cannot succeed ends it at once with one line on stderr saying what is wrong and what to do, never a traceback.

Real ``join-run`` processes against a real coordinator (the TCP server, or ``psyswarm localnet`` for the case only
a chain has: an identity with no SOL) and a real DHT; the other clients a run needs before it starts are joined
straight through the coordinator's protocol, so that the run moves to the phase under test with one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from solders.keypair import Keypair
from typer.testing import CliRunner

from client.backends.tcp import TcpBackend
from client.cli import app
from client.commands.run import STOP_GRACE
from client.identity import save_keypair
from client.swarm.launcher import Swarm
from coordinator_program.spec import limits
from coordinator_program.spec.state import CoordinatorState, Phase, Role
from tests.integration.test_swarm import tiny, watch
from tests.solana.conftest import Localnet, localnet, new_run_id  # noqa: F401 - the fixture, for the no-SOL case

pytestmark = pytest.mark.slow  # each test starts a whole client process: CI runs them with the swarms

STOP_BOUND = STOP_GRACE + 4.0
"""Seconds from SIGTERM to the process's end that a test allows: the command's own bound, plus the teardown of a
Python process that loaded torch and hivemind on a loaded machine."""


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    """A TCP coordinator and a DHT bootstrap; the test writes the run's config first (``swarm.config``)."""
    started = Swarm(tmp_path, tiny())
    yield started
    started.stop()


def start(swarm: Swarm, toml: str) -> Swarm:
    swarm.config.write_text(toml)
    swarm.start_server()
    swarm.start_dht()
    return swarm


class Members:
    """Clients with no process behind them, joined straight through the coordinator's protocol: they complete the
    run's membership and never do anything else. They stay connected (the server withdraws a queued client whose
    connection closes) until ``close``."""

    def __init__(self, swarm: Swarm, *roles: tuple[Role, int]) -> None:
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        joined = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._hold(swarm, roles, joined),),
                                       daemon=True)
        self.thread.start()
        assert joined.wait(30), "the members could not join"

    async def _hold(self, swarm: Swarm, roles: tuple[tuple[Role, int], ...], joined: threading.Event) -> None:
        backends = [TcpBackend(swarm.address, Keypair()) for _ in roles]
        try:
            for backend, (role, stage) in zip(backends, roles, strict=True):
                await backend.connect()
                await backend.join(role, stage)
            joined.set()
            await self.stop.wait()
        finally:
            for backend in backends:
                await backend.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


@pytest.fixture
def members(swarm: Swarm) -> Iterator[Callable[..., None]]:
    """``members(*roles)``: join process-less clients to the swarm's run for the test's duration."""
    joined: list[Members] = []

    def join(*roles: tuple[Role, int]) -> None:
        joined.append(Members(swarm, *roles))

    yield join
    for group in joined:
        group.close()


def observe(swarm: Swarm, until, timeout: float = 120.0) -> CoordinatorState:
    return asyncio.run(watch(swarm, until, timeout))[-1]


def wait_for(swarm: Swarm, name: str, pattern: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, swarm.log_text(name)):
        assert swarm.procs[name].poll() is None, f"{name} exited early:\n{swarm.log_text(name)[-3000:]}"
        assert time.monotonic() < deadline, f"{name} never logged {pattern!r}:\n{swarm.log_text(name)[-3000:]}"
        time.sleep(0.2)


def stop_within_bound(swarm: Swarm, name: str) -> float:
    """SIGTERM the client's process group (as Ctrl+C or a service manager does); seconds until it exited."""
    proc = swarm.procs[name]
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_BOUND + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still runs {STOP_BOUND + 30:.0f} s after SIGTERM:\n{swarm.log_text(name)[-3000:]}")
    took = time.monotonic() - sent
    assert took <= STOP_BOUND, f"{name} took {took:.1f} s to stop:\n{swarm.log_text(name)[-3000:]}"
    assert proc.returncode == 0 and "stopped" in swarm.log_text(name), swarm.log_text(name)[-3000:]
    return took


class SilentHub:
    """A Hugging Face endpoint that accepts connections and never answers: a download from it blocks."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.connections.append(self.server.accept()[0])

    def close(self) -> None:
        self.server.close()
        for connection in self.connections:
            connection.close()


# ----- SIGTERM ------------------------------------------------------------------------------------------------


def test_sigterm_while_waiting_to_join(swarm: Swarm) -> None:
    start(swarm, tiny())
    swarm.start_client("worker", "worker", "head")
    wait_for(swarm, "worker", "waiting to be admitted")
    stop_within_bound(swarm, "worker")


def test_sigterm_while_downloading_the_stage_at_warmup(swarm: Swarm, members, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run starts from a Hub checkpoint on an endpoint that never answers: the worker's state download blocks
    (in a thread nothing can interrupt) for as long as its timeout, here far beyond the bound."""
    hub = SilentHub()
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "300")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "300")
    try:
        start(swarm, tiny() + '[checkpoint]\nkind = "hub"\nrepo = "org/run"\nrevision = "main"\n')
        members((Role.Worker, 1), (Role.Worker, 2), (Role.Trainer, limits.NO_STAGE))
        swarm.start_client("worker", "worker", "head", extra=("--hf-endpoint", hub.url))
        observe(swarm, lambda s: s.phase == Phase.Warmup)
        deadline = time.monotonic() + 60
        while not hub.connections:
            assert time.monotonic() < deadline, swarm.log_text("worker")[-3000:]
            time.sleep(0.2)
        stop_within_bound(swarm, "worker")
    finally:
        hub.close()


def test_sigterm_while_training_stalls_on_a_stage_without_worker(swarm: Swarm, members) -> None:
    """Its workers never serve: the trainer's round stalls, waiting for one (for up to max_round_train_time)."""
    start(swarm, tiny(train_time=300).replace("warmup_time = 20", "warmup_time = 2"))
    members((Role.Worker, 0), (Role.Worker, 1), (Role.Worker, 2))
    swarm.start_client("trainer", "trainer")
    wait_for(swarm, "trainer", "STALLED: stage head has no reachable worker")
    stop_within_bound(swarm, "trainer")


# ----- joins that cannot succeed --------------------------------------------------------------------------------


def ends_with_one_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    """The process failed, and said why in exactly one line of stderr, with no traceback anywhere."""
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0, f"exit code 0\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert len(lines) == 1, f"stderr is not one line:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(text in lines[0] for text in expected), lines[0]
    return lines[0]


def join_run(swarm: Swarm, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """One ``join-run`` to its end, with a fresh identity unless the test gives one."""
    if "--keypair" not in args:
        args = (*args, "--keypair", str(save_keypair(Keypair(), swarm.workdir / "keys" / f"{os.urandom(4).hex()}")))
    return subprocess.run([sys.executable, "-m", "client.cli", "join-run", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=swarm.workdir)


def test_a_join_without_sol_to_pay_its_fee(localnet: Localnet, swarm: Swarm) -> None:  # noqa: F811
    run_id = new_run_id()
    creator = localnet.funded_keypairs(1)[0]
    config = swarm.workdir / "chain.toml"
    config.write_text(tiny().replace('run_id = "it"', f'run_id = "{run_id}"'))
    created = CliRunner().invoke(app, ["create-run", "--url", localnet.url, "--config", str(config), "--keypair",
                                       str(save_keypair(creator, swarm.workdir / "creator.json")), "--permissionless"])
    assert created.exit_code == 0, created.output
    swarm.start_dht()
    unfunded = Keypair()
    proc = join_run(swarm, "--url", localnet.url, "--run-id", run_id, "--role", "trainer", "--initial-peer",
                    swarm.peer, "--keypair", str(save_keypair(unfunded, swarm.workdir / "unfunded.json")))
    ends_with_one_line(proc, str(unfunded.pubkey()), "no SOL",
                       f"fund it first: `psyswarm airdrop -u {localnet.url} -k {swarm.workdir / 'unfunded.json'}`")


@pytest.mark.parametrize("peer, problem", [
    ("/ip4/127.0.0.1/tcp/1", "invalid p2p multiaddr"),
    ("/ip4/127.0.0.1/tcp/1/p2p/QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z", "failed to connect to bootstrap"),
])
def test_an_initial_peer_that_is_wrong_or_down(swarm: Swarm, peer: str, problem: str) -> None:
    start(swarm, tiny())
    proc = join_run(swarm, *swarm.target, "--run-id", "it", "--role", "trainer", "--initial-peer", peer)
    ends_with_one_line(proc, peer, problem, "psyswarm dht")


def test_a_dataset_this_machine_does_not_have(swarm: Swarm, members) -> None:
    """The trainer is admitted, then finds the run's data missing at warmup."""
    start(swarm, tiny().replace("[model]", '[model]\ndataset = "/no/such/corpus"'))
    members((Role.Worker, 0), (Role.Worker, 1), (Role.Worker, 2))
    proc = join_run(swarm, *swarm.target, "--run-id", "it", "--role", "trainer", "--initial-peer", swarm.peer)
    ends_with_one_line(proc, "/no/such/corpus", "does not exist", "join as a worker")


def test_a_run_the_coordinator_does_not_serve(swarm: Swarm) -> None:
    start(swarm, tiny())
    proc = join_run(swarm, *swarm.target, "--run-id", "another", "--role", "trainer", "--initial-peer", swarm.peer)
    ends_with_one_line(proc, "serves run 'it', not 'another'", "check --run-id")


def test_a_stage_the_run_does_not_have(swarm: Swarm) -> None:
    start(swarm, tiny())
    proc = join_run(swarm, *swarm.target, "--run-id", "it", "--role", "worker", "--stage", "body5",
                    "--initial-peer", swarm.peer)
    ends_with_one_line(proc, "3 stages", "--stage body5", "head, body1, tail")


def test_a_run_with_no_free_slot(swarm: Swarm, members) -> None:
    """The coordinator refuses the join itself (RunFull); asking again every few seconds would never end."""
    start(swarm, tiny().replace("max_clients = 16", "max_clients = 4"))
    members((Role.Worker, 0), (Role.Worker, 1), (Role.Worker, 2), (Role.Trainer, limits.NO_STAGE))
    proc = join_run(swarm, *swarm.target, "--run-id", "it", "--role", "trainer", "--initial-peer", swarm.peer)
    ends_with_one_line(proc, "refuses this client's join", "full", "try again")
