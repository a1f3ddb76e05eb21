"""One identity, one process: a second ``join-run`` with a keypair another live process on the machine is using
exits at once with one line saying so and what to do, instead of queueing for ever behind itself; a process of that
identity restarted after a crash claims it again and rejoins. Real ``join-run`` processes, the real TCP server and a
real DHT."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from client.commands.claim import IdentityInUse, claim_identity
from client.identity import save_keypair
from client.swarm.launcher import Swarm
from coordinator_program.spec.state import Role
from tests.adversarial.test_process_exit import ends_with_one_line, wait_for
from tests.integration.test_swarm import tiny


@pytest.fixture
def swarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Swarm]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the claims of this test's processes only
    started = Swarm(tmp_path, tiny())
    started.start_server()
    started.start_dht()
    yield started
    started.stop()


def joined(swarm: Swarm) -> Path:
    """A trainer process that has joined the run (queued, as the run needs four clients); its keypair."""
    key = swarm.start_client("first", "trainer")
    wait_for(swarm, "first", "waiting to be admitted")
    return key


@pytest.mark.slow
def test_a_second_process_with_a_joined_identity_exits_at_once(swarm: Swarm) -> None:
    key = joined(swarm)
    began = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "client.cli", "join-run", *swarm.target, "--run-id", "it",
                             "--role", "trainer", "--initial-peer", swarm.peer, "--keypair", str(key)],
                            capture_output=True, text=True, timeout=120, cwd=swarm.workdir)
    line = ends_with_one_line(second, "is already in run 'it'", "another process uses this keypair",
                              "psyswarm keygen -o worker2.json, then --keypair worker2.json")
    assert f"pid {swarm.procs['first'].pid}" in line, line
    assert time.monotonic() - began < 30  # at once: before any DHT, model or join
    assert swarm.procs["first"].poll() is None  # the first process goes on


class Queued:
    """A client of ``keypair`` joined through the coordinator's protocol and kept connected (the server withdraws a
    queued client whose connection closes): another machine's process, which no lock here can see."""

    def __init__(self, swarm: Swarm, keypair: Keypair) -> None:
        self.loop, self.stop, joined = asyncio.new_event_loop(), asyncio.Event(), threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._hold(swarm, keypair, joined),),
                                       daemon=True)
        self.thread.start()
        assert joined.wait(30), "the client could not join"

    async def _hold(self, swarm: Swarm, keypair: Keypair, joined: threading.Event) -> None:
        backend = TcpBackend(swarm.address, keypair)
        await backend.connect()
        try:
            await backend.join(Role.Trainer)
            joined.set()
            await self.stop.wait()
        finally:
            await backend.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


@pytest.mark.slow
def test_an_identity_the_coordinator_already_holds_is_told_so(swarm: Swarm) -> None:
    keypair = Keypair()
    save_keypair(keypair, swarm.workdir / "keys" / "shared.json")  # what start_client("shared") passes as --keypair
    other = Queued(swarm, keypair)
    try:
        swarm.start_client("shared", "trainer")
        wait_for(swarm, "shared", f"{keypair.pubkey()} is already in run it: taking its place again .* one keypair "
                                  "per process")
    finally:
        other.close()


@pytest.mark.slow
def test_a_process_restarted_after_a_crash_rejoins(swarm: Swarm) -> None:
    joined(swarm)
    swarm.kill("first")  # a crash: SIGKILL, no clean leave
    swarm.start_client("first", "trainer")  # the same command with the same keypair
    deadline = time.monotonic() + 120
    while swarm.log_text("first").count("waiting to be admitted") < 2 and "queued: position" not in \
            swarm.log_text("first"):
        assert swarm.procs["first"].poll() is None, swarm.log_text("first")[-3000:]
        assert time.monotonic() < deadline, swarm.log_text("first")[-3000:]
        time.sleep(0.2)


def test_the_claim_dies_with_its_process_however_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from client.commands.claim import claim_identity\n"
        "claim = claim_identity('PUBKEY', 'run-a', Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"),
        str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(IdentityInUse, match=f"PUBKEY is already in run 'run-a' .*pid {holder.pid}"):
            claim_identity("PUBKEY", "run-b", tmp_path)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
    claim = claim_identity("PUBKEY", "run-b", tmp_path)  # the kernel released it with the process
    assert claim is not None
    claim.close()
