"""The TCP server acknowledges only what it has stored (issue 12, item 7), tried against a database locked by
another process: a real second SQLite connection, in a process of its own, holding an EXCLUSIVE lock.

Before the fix, writes ran on the event loop, so the whole server stalled while SQLite waited for the lock;
the join was applied in memory before its write failed, the client got a dropped connection and no reply,
and memory was ahead of disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.base import BackendError
from client.backends.tcp import TcpBackend
from coordinator_program.spec import rules
from coordinator_program.spec.state import Phase, Role, encode_state
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore, stored_run
from tests.adversarial.test_server_limits import SPEC

BUSY_TIMEOUT = 1.0
LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
db.rollback()
"""


class Clock:
    """The server's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def locked(db: Path) -> Iterator[None]:
    """Another process holds an exclusive lock on ``db`` until the block ends."""
    locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        yield
    finally:
        locker.communicate("release\n", timeout=10)


def on_disk(db: Path) -> bytes:
    """The account the database holds, read by a connection of its own (readers pass a writer's lock)."""
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as reader:
        stored = stored_run(reader)
    assert stored is not None
    return stored.account


def test_a_locked_database_gets_an_error_reply_stalls_no_one_and_changes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "run.sqlite"

    async def main() -> None:
        clock = Clock()
        server = CoordinatorServer(SPEC, RunStore(db, busy_timeout=BUSY_TIMEOUT), Keypair(), clock,
                                   join_authority=rules.NO_AUTHORITY)
        port = await server.start(port=0)
        address = f"127.0.0.1:{port}"
        clients = [TcpBackend(address, Keypair()) for _ in range(4)]
        for i, client in enumerate(clients):
            await client.connect()
            await client.join(Role.Trainer if i == 0 else Role.Worker)
        await clients[0].wait_for(lambda s: s.phase == Phase.Warmup, 5)
        joiner = TcpBackend(address, Keypair())
        await joiner.connect()
        try:
            with locked(db):
                clock.now += SPEC.config.warmup_time  # RoundTrain is due, and cannot be stored
                join = asyncio.create_task(joiner.join(Role.Trainer))
                await asyncio.sleep(0.2)
                started = time.monotonic()  # the join waits for the lock: everyone else is still served
                watcher = TcpBackend(address, Keypair())
                await asyncio.wait_for(watcher.connect(), 0.5)
                assert time.monotonic() - started < 0.5
                with pytest.raises(BackendError, match="database is locked"):
                    await asyncio.wait_for(join, 4 * BUSY_TIMEOUT)
                assert joiner.connected, "an error reply, not a dropped connection"
                await asyncio.sleep(2 * BUSY_TIMEOUT)  # ticks keep failing
                assert server.state.phase == Phase.Warmup, "a tick that was not stored moved the run on"
                assert server.state.pending_index(joiner.identity) is None
                assert encode_state(server.state) == server.account == on_disk(db)
                assert watcher.state.nonce == server.state.nonce
            await joiner.join(Role.Trainer)  # the same join, once the lock is gone
            await clients[0].wait_for(lambda s: s.phase == Phase.RoundTrain, 5)
            assert server.state.pending_index(joiner.identity) is not None
            assert encode_state(server.state) == on_disk(db)
            for client in (*clients, joiner, watcher):
                await client.close()
        finally:
            await server.stop()

    asyncio.run(main())
