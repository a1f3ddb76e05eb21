"""Durable storage of a served run in SQLite: the current state, and every operation that changed it.

Each change is one SQLite transaction holding both the operation and the state it produced, synced to disk
before ``save`` returns, so after a crash (even ``kill -9``, even a power cut) the server restarts from the
last state it acknowledged with nothing half-applied, and the log says how the run got there. A write that
fails (the database locked by another process past ``busy_timeout``, a full disk) raises ``StoreError`` and
leaves the database as it was.

A change usually touches a few hundred of the account's 120 KB, so the state is stored as a snapshot (the ``run``
row) and the byte ranges each change since then wrote (``patches``, in the wire protocol's ``StatePatch`` format):
a commit syncs a page or two rather than thirty, and the write-ahead log's checkpoints copy as little. Once the
patches add up to ``SNAPSHOT_AFTER`` bytes, a change writes a fresh snapshot instead and drops them, in the same
transaction, so a restart replays at most that many bytes.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from pathlib import Path

from local_backend import protocol as p

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
CREATE TABLE IF NOT EXISTS patches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    patch BLOB NOT NULL
);
"""

SNAPSHOT_AFTER = 256 << 10
"""Bytes of patches after which a change stores the whole account again: about two accounts' worth, so a restart
replays little and a snapshot is written once in a thousand joins."""


BUSY_TIMEOUT = 5.0
"""Seconds a write waits for another process's lock on the database before it fails."""


class StoreError(RuntimeError):
    """The database holds a different run, cannot be opened, or cannot take a write: the run store's, or the auth
    service's slot store (``local_backend.auth.slots``)."""


@dataclasses.dataclass(frozen=True)
class Stored:
    """What a database holds: its run, and the last committed account and its nonce (the snapshot with every patch
    since applied), and how many bytes of patches that took."""

    run_id: str
    nonce: int
    account: bytes
    patched: int


def stored_run(db: sqlite3.Connection) -> Stored | None:
    """The run ``db`` holds, read in one transaction (None for a new database); ``StoreError`` when its patches do not
    follow one another from the snapshot, which only a database written by something else than ``RunStore`` holds."""
    db.execute("BEGIN")
    try:
        row = db.execute("SELECT run_id, nonce, account FROM run WHERE id = 1").fetchone()
        if row is None:
            return None
        run_id, nonce, account = row
        patched = 0
        for seq, blob in db.execute("SELECT seq, patch FROM patches ORDER BY seq"):
            try:
                patch = p.decode(blob)
                if not isinstance(patch, p.StatePatch) or patch.base != nonce:
                    raise p.ProtocolError(f"it does not follow nonce {nonce}")
                account, nonce = patch.apply(account), patch.nonce
            except p.ProtocolError as exc:
                raise StoreError(f"the database's patch {seq} is corrupt ({exc}): restore the database from a "
                                 "backup") from None
            patched += len(blob)
        return Stored(run_id, nonce, account, patched)
    finally:
        db.execute("COMMIT")


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
        self._held: Stored | None = None  # what the database holds, once read or written: patches are made from it

    def load(self, run_id: str) -> bytes | None:
        """The last committed account of ``run_id``, or None for a new database."""
        try:
            stored = stored_run(self.db)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read {self.path}: {exc}") from None
        if stored is None:
            return None
        if stored.run_id != run_id:
            raise StoreError(f"{self.path} holds run {stored.run_id!r}, not {run_id!r}: use another --db")
        self._held = stored
        return stored.account

    def save(self, run_id: str, nonce: int, account: bytes, signer: bytes, instruction: bytes,
             patch_from: tuple[bytes, bytes] | None = None) -> None:
        """Record one accepted operation and the state it produced, atomically and durably; ``StoreError``
        (nothing written) when the database cannot take it.

        ``patch_from`` is (an account, the encoded ``StatePatch`` from it to ``account``), as the server already
        made it for its followers: taken when that account is the very bytes object this store last wrote or read,
        so the 120 KB account is diffed once per change, not twice."""
        held = self._held
        patch = b""
        if patch_from is not None and held is not None and patch_from[0] is held.account and held.run_id == run_id:
            patch = patch_from[1]
        elif held is not None and held.run_id == run_id and len(held.account) == len(account):
            patch = p.StatePatch(held.nonce, nonce, p.diff(held.account, account)).encode()
        patched = held.patched + len(patch) if patch and held is not None else 0
        snapshot = not patch or patched > SNAPSHOT_AFTER
        try:
            with self.db:
                self.db.execute("BEGIN IMMEDIATE")
                if snapshot:
                    self.db.execute(
                        "INSERT INTO run (id, run_id, nonce, account) VALUES (1, ?, ?, ?) "
                        "ON CONFLICT(id) DO UPDATE SET run_id = excluded.run_id, nonce = excluded.nonce, "
                        "account = excluded.account", (run_id, nonce, account))
                    self.db.execute("DELETE FROM patches")
                else:
                    self.db.execute("INSERT INTO patches (patch) VALUES (?)", (patch,))
                self.db.execute("INSERT INTO operations (at, signer, instruction, nonce_after) VALUES (?, ?, ?, ?)",
                                (time.time(), signer, instruction, nonce))
        except sqlite3.Error as exc:
            if self.db.in_transaction:  # a failed COMMIT leaves the transaction open
                self.db.rollback()
            raise StoreError(f"cannot write to {self.path}: {exc}") from None
        self._held = Stored(run_id, nonce, account, 0 if snapshot else patched)

    def operations(self) -> list[tuple[int, bytes, bytes, int]]:
        """The log, oldest first: (seq, signer, instruction bytes, nonce after)."""
        return list(self.db.execute("SELECT seq, signer, instruction, nonce_after FROM operations ORDER BY seq"))

    def close(self) -> None:
        self.db.close()
