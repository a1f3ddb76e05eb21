"""The auth service's SQLite store: its slots, the nonces it has seen spent, and whose keys it granted.

Each request is one transaction (``SlotStore.transaction``), answered only after it commits, so a restart
forgets no contributor and re-opens no replay. A database that cannot be opened, holds another run or cannot
take a write raises the same ``StoreError`` as the TCP server's run store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from local_backend.store import StoreError

log = logging.getLogger("psyswarm.auth")

NONCES_PER_TOKEN = 1024  # spent nonces one token's requests may hold in the skew window (its slots poll ~2/s)
NONCES_PER_ADDRESS = 4096  # those of one address's requests for a new slot (many tokens behind one NAT)


@dataclass
class Slot:
    peer: str  # hex ed25519 public key of the process holding the slot
    token_sha256: str  # the token the slot is held under (its hash; the token itself is never kept)
    contributor: str  # the Hub user the token belongs to
    role: str
    stage: int  # -1 for a trainer
    index: int
    expires: float
    queued_at: float
    integrating_since: float | None = None
    synced: bool = False
    countersigned_until: float = 0.0  # the latest deadline of a join countersigned for this slot
    ended: float | None = None  # when the slot ended (left, lapsed); it is freed once the coordinator confirms
    since: float = 0.0  # the signed time of the join that granted it: no request signed before acts on it


_SCHEMA = """
CREATE TABLE IF NOT EXISTS service (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    run_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS slots (
    peer TEXT PRIMARY KEY,
    token_sha256 TEXT NOT NULL,
    contributor TEXT NOT NULL,
    role TEXT NOT NULL,
    stage INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    expires REAL NOT NULL,
    queued_at REAL NOT NULL,
    integrating_since REAL,
    synced INTEGER NOT NULL,
    countersigned_until REAL NOT NULL DEFAULT 0,
    ended REAL,
    since REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS nonces (
    peer TEXT NOT NULL,
    nonce TEXT NOT NULL,
    time REAL NOT NULL,
    token_sha256 TEXT NOT NULL,
    address TEXT NOT NULL,
    PRIMARY KEY (peer, nonce)
);
CREATE INDEX IF NOT EXISTS nonces_by_time ON nonces (time);
CREATE INDEX IF NOT EXISTS nonces_by_token ON nonces (token_sha256);
CREATE INDEX IF NOT EXISTS nonces_by_address ON nonces (address);
CREATE TABLE IF NOT EXISTS grants (
    peer TEXT PRIMARY KEY,
    contributor TEXT NOT NULL,
    seen REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS grants_by_seen ON grants (seen);
"""


def admitted(slot: Slot, max_integrating: int) -> bool:
    """Past the join queue: integrating, synced, or in a run with no queue."""
    return max_integrating == 0 or slot.synced or slot.integrating_since is not None


def waiting(slots: Iterable[Slot], max_integrating: int) -> list[Slot]:
    """The join queue, in join order."""
    return sorted((s for s in slots if s.ended is None and not admitted(s, max_integrating)),
                  key=lambda s: (s.queued_at, s.index))


def integrating(slots: Iterable[Slot]) -> int:
    return sum(s.integrating_since is not None for s in slots)


def held_by(slots: Iterable[Slot], contributor: str) -> int:
    """The slots a contributor holds, ended ones included: their keys may still be in the run."""
    return sum(s.contributor == contributor for s in slots)


def least_occupied_stage(slots: Iterable[Slot], num_stages: int) -> int:
    """The stage the fewest live worker slots hold (the lowest on ties)."""
    counts = [0] * num_stages
    for slot in slots:
        if slot.stage >= 0 and slot.ended is None:
            counts[slot.stage] += 1
    return counts.index(min(counts))


def free_index(slots: Iterable[Slot], capacity: int) -> int:
    """The lowest slot index no slot holds, ended ones included (their keys may still be in the run)."""
    taken = {s.index for s in slots}
    return next(i for i in range(capacity) if i not in taken)


def drop_misfits(store: SlotStore, slots: dict[str, Slot], num_stages: int, capacity: int) -> None:
    """Slots kept from a run served with more stages or slots than now no longer exist."""
    misfits = [s for s in slots.values() if s.stage >= num_stages or s.index >= capacity]
    if not misfits:
        return
    with store.transaction():
        for slot in misfits:
            store.drop(slot.peer)
            del slots[slot.peer]
    log.warning("dropped %d kept slot(s) beyond %d stages or %d slots", len(misfits), num_stages, capacity)


_SLOT_FIELDS = len(dataclasses.fields(Slot))
_SLOT_COLUMNS = ", ".join("idx" if f.name == "index" else f.name for f in dataclasses.fields(Slot))


class SlotStore:
    """The auth service's database, one run per file: its slots and the nonces it has seen spent.

    A nonce is kept until its request's time is past the skew window (then the time alone refuses a replay), so
    no floor ever stands in for forgotten nonces, and none can be moved past real time. What bounds the table is
    the service's quotas per token and per address (``nonces_of``), checked before a nonce is spent.
    """

    def __init__(self, path: str | Path, run_id: str) -> None:
        self.path = path
        try:
            # Requests run on worker threads, one at a time under the service's lock.
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives process crashes
            self._upgrade()
            self.db.executescript(_SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO service (id, run_id) VALUES (1, ?)", (run_id,))
            (held,) = self.db.execute("SELECT run_id FROM service WHERE id = 1").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {path}: {exc}") from None
        if held != run_id:
            raise StoreError(f"{path} holds the auth service of run {held!r}, not {run_id!r}: use another --db")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic change; nothing of it is kept unless it commits. The database failing within it (locked
        past its timeout, a full disk, a file turned read-only) raises ``StoreError``."""
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path} cannot take a write: {exc}") from exc
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException as exc:
            try:
                if self.db.in_transaction:  # some failures roll back by themselves
                    self.db.execute("ROLLBACK")
            except sqlite3.Error as failed:
                raise StoreError(f"{self.path} cannot roll back: {failed}") from exc
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"{self.path} cannot take a write: {exc}") from exc
            raise

    def slots(self) -> dict[str, Slot]:
        rows = self.db.execute(f"SELECT {_SLOT_COLUMNS} FROM slots").fetchall()
        slots = (Slot(*row) for row in rows)
        return {slot.peer: dataclasses.replace(slot, synced=bool(slot.synced)) for slot in slots}

    def put(self, slot: Slot) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO slots ({_SLOT_COLUMNS}) VALUES ({', '.join('?' * _SLOT_FIELDS)})",
                        dataclasses.astuple(slot))

    def remember_grant(self, peer: str, contributor: str, seen: float, kept: int) -> None:
        """Note whose key ``peer`` is, for the contributor map; only the ``kept`` keys granted last are kept."""
        self.db.execute("INSERT OR REPLACE INTO grants VALUES (?, ?, ?)", (peer, contributor, seen))
        self.db.execute("DELETE FROM grants WHERE peer NOT IN (SELECT peer FROM grants ORDER BY seen DESC LIMIT ?)",
                        (kept,))

    def grants(self) -> list[tuple[str, str]]:
        return self.db.execute("SELECT peer, contributor FROM grants ORDER BY seen DESC").fetchall()

    def drop(self, peer: str) -> None:
        self.db.execute("DELETE FROM slots WHERE peer = ?", (peer,))

    def nonce_spent(self, peer: str, nonce: str) -> bool:
        found = self.db.execute("SELECT 1 FROM nonces WHERE peer = ? AND nonce = ?", (peer, nonce)).fetchone()
        return found is not None

    def spend_nonce(self, peer: str, nonce: str, stamp: float, token: str, address: str,
                    forget_before: float) -> None:
        """Remember a nonce, charged to ``token`` and ``address`` (empty: to no address); forget those whose time
        is before ``forget_before`` (their requests are refused as stale anyway)."""
        self.db.execute("DELETE FROM nonces WHERE time < ?", (forget_before,))
        self.db.execute("INSERT INTO nonces VALUES (?, ?, ?, ?, ?)", (peer, nonce, stamp, token, address))

    def nonces_of(self, token: str, address: str, since: float) -> tuple[int, int]:
        """The nonces charged to ``token`` and to ``address`` whose time is at or after ``since``."""
        (by_token,) = self.db.execute("SELECT COUNT(*) FROM nonces WHERE token_sha256 = ? AND time >= ?",
                                      (token, since)).fetchone()
        (by_address,) = self.db.execute("SELECT COUNT(*) FROM nonces WHERE address = ? AND time >= ?",
                                        (address, since)).fetchone()
        return by_token, by_address

    def close(self) -> None:
        self.db.close()

    def _upgrade(self) -> None:
        """A store written before issue 21 gains the slots' new columns, and its nonces table the token and address
        they are charged to (its nonces are dropped: they are at most two minutes from being refused as stale)."""
        tables = {row[0] for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "slots" in tables:
            columns = {row[1] for row in self.db.execute("PRAGMA table_info(slots)")}
            for column, kind in (("countersigned_until", "REAL NOT NULL DEFAULT 0"), ("ended", "REAL"),
                                 ("since", "REAL NOT NULL DEFAULT 0")):
                if column not in columns:
                    self.db.execute(f"ALTER TABLE slots ADD COLUMN {column} {kind}")
        if "nonces" in tables and "address" not in {row[1] for row in self.db.execute("PRAGMA table_info(nonces)")}:
            self.db.execute("DROP TABLE nonces")
