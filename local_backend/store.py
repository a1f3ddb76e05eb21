"""Durable storage of a served run in SQLite: the current state, and every operation that changed it.

Each change is one SQLite transaction holding both the operation and the state it produced, synced to disk
before ``save`` returns, so after a crash (even ``kill -9``, even a power cut) the server restarts from the
last state it acknowledged with nothing half-applied, and the log says how the run got there. A write that
fails (the database locked by another process past ``busy_timeout``, a full disk) raises ``StoreError`` and
leaves the database as it was.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    run_id TEXT NOT NULL,
    nonce INTEGER NOT NULL,
    account BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS operations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    signer BLOB NOT NULL,
    instruction BLOB NOT NULL,
    nonce_after INTEGER NOT NULL
);
"""


BUSY_TIMEOUT = 5.0
"""Seconds a write waits for another process's lock on the database before it fails."""


class StoreError(RuntimeError):
    """The database holds a different run, cannot be opened, or cannot take a write: the run store's, or the auth
    service's slot store (``local_backend.auth.slots``)."""


class RunStore:
    """The server's database: one run per file.

    The server writes from a worker thread, one write at a time, so the connection is not tied to the
    thread that opened it.
    """

    def __init__(self, path: str | Path, *, busy_timeout: float = BUSY_TIMEOUT) -> None:
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=busy_timeout,
                                      check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # WAL + FULL: a commit survives a power cut too
            self.db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from None

    def load(self, run_id: str) -> bytes | None:
        """The last committed account of ``run_id``, or None for a new database."""
        row = self.db.execute("SELECT run_id, account FROM run WHERE id = 1").fetchone()
        if row is None:
            return None
        if row[0] != run_id:
            raise StoreError(f"{self.path} holds run {row[0]!r}, not {run_id!r}: use another --db")
        return row[1]

    def save(self, run_id: str, nonce: int, account: bytes, signer: bytes, instruction: bytes) -> None:
        """Record one accepted operation and the state it produced, atomically and durably; ``StoreError``
        (nothing written) when the database cannot take it."""
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                self.db.execute(
                    "INSERT INTO run (id, run_id, nonce, account) VALUES (1, ?, ?, ?) "
                    "ON CONFLICT(id) DO UPDATE SET nonce = excluded.nonce, account = excluded.account",
                    (run_id, nonce, account))
                self.db.execute("INSERT INTO operations (at, signer, instruction, nonce_after) VALUES (?, ?, ?, ?)",
                                (time.time(), signer, instruction, nonce))
        except sqlite3.Error as exc:
            if self.db.in_transaction:  # a failed COMMIT leaves the transaction open
                self.db.rollback()
            raise StoreError(f"cannot write to {self.path}: {exc}") from None

    def operations(self) -> list[tuple[int, bytes, bytes, int]]:
        """The log, oldest first: (seq, signer, instruction bytes, nonce after)."""
        return list(self.db.execute("SELECT seq, signer, instruction, nonce_after FROM operations ORDER BY seq"))

    def close(self) -> None:
        self.db.close()
