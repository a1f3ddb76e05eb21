"""``join-run``'s live line on a terminal: phase, round, membership, stage, sync phase, batches this round and points,
kept current below the log; none when stdout is not a terminal. A real contributor following the real TCP server."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import pty
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from client.commands.live import ConsoleHandler, live_line, live_text, points_text
from client.contributor.context import RunnerOptions
from client.contributor.runner import Contributor
from coordinator_program.spec.state import LedgerEntry, Role
from tests.local_backend.test_server import run_with_server


def test_the_line_follows_this_client_from_not_joined_to_queued(tmp_path: Path) -> None:
    lines: list[str] = []

    async def body(server, address: str) -> None:
        keypair = Keypair()
        backend = TcpBackend(address, keypair)
        await backend.connect()
        contributor = Contributor(backend, keypair, RunnerOptions(role=Role.Worker, initial_peers=[], stage=2))
        try:
            lines.append(live_text(contributor.status()))
            await backend.join(Role.Worker, 2)
            await backend.wait_for(lambda state: state.pending_index(bytes(keypair.pubkey())) is not None, 5)
            lines.append(live_text(contributor.status()))
        finally:
            await backend.close()

    run_with_server(tmp_path, body)
    assert lines[0] == "WaitingForMembers | epoch 0 | joining | tail | idle | 0 batches | 0 points"
    assert lines[1] == "WaitingForMembers | epoch 0 | queued 1/1 | tail | idle | 0 batches | 0 points"
    assert all(len(line) <= 80 for line in lines)


def test_points_come_from_the_coordinator_ledger() -> None:
    from tests.swarm.test_status_text import demo_state

    state = demo_state()
    me = bytes([7] * 32)
    assert points_text(state, me) == "0 points"
    state.ledger = [LedgerEntry(bytes([1] * 32), 9, 90), LedgerEntry(me, 3, 48)]
    assert points_text(state, me) == "51 points (3+48)"


def test_a_long_line_drops_its_least_needed_details_to_fit_the_terminal() -> None:
    """A worker deep in a long run, queued, with many points: 80 columns keep the phase, round, queue place, stage,
    sync phase and points' total, dropping the points' split and the batches; a wide terminal shows everything."""
    from client.contributor.status import ContributorStatus
    from client.join.sync import SyncPhase
    from coordinator_program.spec.state import Phase
    from tests.swarm.test_status_text import demo_state

    state = demo_state()
    me = bytes([7] * 32)
    state.phase, state.epoch = Phase.RoundWitness, 12
    state.ledger = [LedgerEntry(me, 123_456, 7_654_321)]
    status = ContributorStatus(state, me, Role.Worker, 1, SyncPhase(2), 1234)
    wide = live_text(status, 200)
    assert "1234 batches" in wide and "(123456+7654321)" in wide and len(wide) > 80
    narrow = live_text(status, 80)
    assert len(narrow) <= 80 and "batches" not in narrow and "(123456" not in narrow
    assert narrow.startswith("RoundWitness | epoch 12 round") and narrow.endswith("7777777 points")
    assert live_text(status) == wide  # no width: no terminal to fit


def test_on_a_terminal_the_log_scrolls_above_the_live_line(tmp_path: Path) -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200)
    log = logging.getLogger("psyswarm.test-live")
    handler = ConsoleHandler(console)
    log.addHandler(handler)
    seen: list[str] = []

    async def body(server, address: str) -> None:
        keypair = Keypair()
        backend = TcpBackend(address, keypair)
        await backend.connect()
        contributor = Contributor(backend, keypair, RunnerOptions(role=Role.Trainer, initial_peers=[]))
        try:
            with live_line(contributor.status, console):
                log.warning("a log line")
                await asyncio.sleep(1.2)  # the line refreshes twice a second
                seen.append(live_text(contributor.status()))
        finally:
            await backend.close()

    try:
        run_with_server(tmp_path, body)
    finally:
        log.removeHandler(handler)
    text = screen.getvalue()
    assert "a log line" in text and "WaitingForMembers | epoch 0" in text and "| trainer |" in text, text
    assert seen[0] in text


def test_a_live_line_only_when_stdout_is_a_terminal() -> None:
    code = "from client.commands.live import terminal_console; print(type(terminal_console()).__name__)"
    piped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert piped.stdout.strip() == "NoneType", piped.stderr  # a pipe, a log file, a service manager: plain lines
    leader, follower = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", code], stdout=follower, timeout=60, check=True)
        assert os.read(leader, 1024).decode().strip() == "Console"
    finally:
        os.close(leader)
        os.close(follower)
