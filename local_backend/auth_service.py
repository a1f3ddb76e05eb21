"""The run's auth service: a Hugging Face token in, a contributor slot and a stage out.

The token is used for identity only: the service asks the Hugging Face Hub who owns it (``whoami``, through
``huggingface_hub`` against a configurable endpoint) and never stores it (only its sha256). Every process
started with the same token is the same contributor: each process (each ed25519 peer key) holds its own slot,
all of them count toward one identity, and one identity holds at most ``max_slots_per_token`` slots (counted
per Hub user, so a second token of the same user buys no more), so no contributor can fill the swarm. A join
needs a free slot — a full swarm rejects it outright, there is no waiting list — and gets the least occupied
stage. Slots are leases: a client renews its slot by joining again, and a slot not renewed within
``lease_seconds`` frees itself.

Pacing (the join queue): at most ``max_integrating`` admitted peers integrate (download state, sync) at once;
the others wait in join order, keeping their slots. Only the service moves the queue: it admits the peer at
the head when it asks and there is room, and a peer may report itself synced only once admitted (a waiting
peer that reports is refused, so none can skip the queue), or stops integrating after ``integration_seconds``
so a joiner that crashed does not hold the queue. Each request is signed by the key whose place it is, so no
one moves another's place.

Requests are JSON over HTTP, each signed by the peer's ed25519 key over its canonical JSON: the run id, the
action, the sha256 of the token its slot is held under, the time and a fresh random nonce. So a captured
request cannot be replayed (its nonce is spent), nor sent under another token (its hash is signed), nor for
another run or action; a time that is not finite or is over ``MAX_CLOCK_SKEW`` off the service's clock is
refused. Nonces are remembered while their time could still pass, at most ``nonce_capacity`` of them: past
that the oldest are forgotten and no request as old as them is accepted any more. Grants are signed by the
service's key.

Slots and spent nonces live in SQLite (``SlotStore``): each request is one transaction, answered only after
it commits, so a restart forgets no contributor and re-opens no replay.

The service's key is the run's join authority: the coordinator (``psyswarm serve`` or ``create-run``
``--join-authority``) admits a join only with its countersignature, so admission holds even against a client
that never asks the service. ``countersign`` signs the join of a slot's holder, for its run, role and stage
and for its key only: on the TCP backend the ``join_authorization`` the server verifies (which names the
joiner's key), on Solana the join_run transaction message itself (see ``solana_join``).

HTTP: h11 (already a dependency) parses HTTP/1.1 under asyncio, which holds an idle connection without a
thread; uvicorn would add a dependency and still has no deadline for a half-sent request, the defence needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import re
import socket
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import h11
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey

from client.identity import verify
from coordinator_program.onchain.instance import instance_address
from coordinator_program.onchain.program_id import PROGRAM_ID
from coordinator_program.spec import limits
from coordinator_program.spec.errors import MalformedInstruction
from coordinator_program.spec.instructions import JoinRun, decode_instruction
from local_backend import protocol

log = logging.getLogger("psyswarm.auth")

MAX_REQUEST_BYTES = 16 * 1024
MAX_HEADER_BYTES = 16 * 1024
MAX_CLOCK_SKEW = 120.0  # seconds a signed request's timestamp may differ from the service's clock
NONCE_BYTES = 16
NONCE_CAPACITY = 65_536  # spent nonces remembered at most; at 270 requests/s all of the skew window
GRANTS_KEPT = 1024  # keys the contributor map remembers (the newest granted); a ledger holds 256
REQUEST_TIMEOUT = 10.0  # seconds a client has to send its whole request
MAX_CONNECTIONS = 1024  # open connections at once; more are answered 503 at once
WORKERS = 8  # threads running requests (they may wait on the Hub or on SQLite)
LISTEN_BACKLOG = 1024
LINGER_SECONDS = 1.0  # after answering, how long the rest of a client's input is read and discarded
ROLES = ("worker", "trainer")
MAX_COUNTERSIGNED_BYTES = 1232  # a Solana transaction's limit; a TCP join authorization is far smaller


class AuthFailure(Exception):
    """A refused request: an HTTP status, a stable error code clients switch on, and a message for people."""

    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def answer(self) -> dict[str, str]:
        return {"error": self.code, "message": self.message}


def bad_request(message: str) -> AuthFailure:
    return AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", message)


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes a request or grant signature covers."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def token_sha256(token: str) -> str:
    """What requests are signed over in place of the token: it binds them to the token without revealing it."""
    return hashlib.sha256(token.encode()).hexdigest()


# ----- identity ----------------------------------------------------------------------------------------


class HubIdentity:
    """Who owns a Hugging Face token, asked of the Hub's ``/api/whoami-v2`` through huggingface_hub.

    Answers are cached per token hash for ``ttl`` seconds: the Hub rate-limits whoami, and slot renewals
    would otherwise call it every few minutes per peer.
    """

    def __init__(self, endpoint: str | None = None, *, ttl: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from huggingface_hub import HfApi

        self.api = HfApi(endpoint=endpoint)
        self.endpoint = self.api.endpoint
        self.ttl = ttl
        self.clock = clock
        self._cache: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def __call__(self, token: str) -> str:
        """The token owner's Hub user name; ``AuthFailure`` for a bad token or an unreachable Hub."""
        from huggingface_hub.errors import HfHubHTTPError

        key = token_sha256(token)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and self.clock() - cached[0] < self.ttl:
                return cached[1]
        try:
            answer = self.api.whoami(token=token)
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status in (401, 403):
                raise AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                                  f"the Hugging Face Hub at {self.endpoint} does not recognise this token") from None
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"the Hugging Face Hub at {self.endpoint} answered {status}; try again later") from None
        except Exception as exc:  # transport errors differ across huggingface_hub versions (requests, httpx)
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"cannot reach the Hugging Face Hub at {self.endpoint}: {exc}") from None
        name = answer.get("name") if isinstance(answer, dict) else None
        if not isinstance(name, str) or not name:
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"the Hugging Face Hub at {self.endpoint} returned no user name for the token")
        with self._lock:
            now = self.clock()
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.ttl}
            self._cache[key] = (now, name)
        return name


# ----- signed requests ----------------------------------------------------------------------------------

_SIGNED_FIELDS = ("run_id", "action", "peer", "time", "nonce", "token_sha256", "signature")
_ACTION_FIELDS: dict[str, tuple[str, ...]] = {"join": ("role",), "queue": (), "synced": (), "leave": (),
                                               "countersign": ("message",)}
_HEX_DIGITS = {"peer": 64, "nonce": 2 * NONCE_BYTES, "token_sha256": 64, "signature": 128}


@dataclass(frozen=True)
class SignedRequest:
    """A request whose shape, run, action, time and signature checked out (its nonce is not yet spent)."""

    peer: str  # hex ed25519 public key
    time: float
    nonce: str
    token_sha256: str
    fields: dict[str, str]  # the action's own fields (a join's role)


def check_signed(request: Any, action: str, run_id: str, now: float) -> SignedRequest:
    """Check a request's fields and types, its run and action, that its time is fresh, and its signature."""
    if not isinstance(request, dict):
        raise bad_request("the request body must be a JSON object")
    expected = {*_SIGNED_FIELDS, *_ACTION_FIELDS[action]}
    if missing := sorted(expected - request.keys()):
        raise bad_request(f"the request lacks {', '.join(missing)}")
    if unexpected := sorted(request.keys() - expected):
        raise bad_request(f"the request has unexpected field(s) {', '.join(unexpected)}")
    for name in sorted(expected - {"time"}):
        if not isinstance(request[name], str):
            raise bad_request(f"{name} must be a string, not {type(request[name]).__name__}")
    for name, digits in _HEX_DIGITS.items():
        if not re.fullmatch(f"[0-9a-f]{{{digits}}}", request[name]):
            raise bad_request(f"{name} must be {digits} lowercase hex digits")
    stamp = _finite_time(request["time"])
    if request["run_id"] != run_id:
        raise AuthFailure(HTTPStatus.BAD_REQUEST, "wrong_run",
                          f"this auth service serves run {run_id!r}, not {request['run_id']!r}")
    if request["action"] != action:
        raise bad_request(f"the request is signed for {request['action']!r}, not {action!r}")
    if abs(now - stamp) > MAX_CLOCK_SKEW:
        raise AuthFailure(HTTPStatus.BAD_REQUEST, "stale_request",
                          f"the request's time is over {MAX_CLOCK_SKEW:.0f} s off the service's clock; "
                          "check this machine's clock")
    unsigned = {k: v for k, v in request.items() if k != "signature"}
    if not verify(bytes.fromhex(request["peer"]), canonical(unsigned), bytes.fromhex(request["signature"])):
        raise AuthFailure(HTTPStatus.UNAUTHORIZED, "bad_signature", "the request's signature does not verify")
    return SignedRequest(request["peer"], stamp, request["nonce"], request["token_sha256"],
                         {name: request[name] for name in _ACTION_FIELDS[action]})


def _finite_time(value: Any) -> float:
    """A request's time as seconds since the epoch; NaN, infinities and non-numbers would never go stale."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            stamp = float(value)
        except OverflowError:  # an integer beyond any float
            stamp = math.inf
        if math.isfinite(stamp):
            return stamp
    raise bad_request("time must be a finite number of seconds since the epoch")


def _token_mismatch() -> AuthFailure:
    return AuthFailure(HTTPStatus.UNAUTHORIZED, "token_mismatch",
                       "the request is signed for another Hugging Face token than the one its slot is held under")


# ----- joins to countersign -----------------------------------------------------------------------------


def refused_join(message: str) -> AuthFailure:
    return AuthFailure(HTTPStatus.FORBIDDEN, "not_countersigned", message)


def message_bytes(text: str) -> bytes:
    """A countersign request's message: 1..``MAX_COUNTERSIGNED_BYTES`` bytes as lowercase hex."""
    if not re.fullmatch(f"(?:[0-9a-f]{{2}}){{1,{MAX_COUNTERSIGNED_BYTES}}}", text):
        raise bad_request(f"message must be 1..{MAX_COUNTERSIGNED_BYTES} bytes as lowercase hex")
    return bytes.fromhex(text)


def join_to_countersign(message: bytes, authority: Pubkey, program_id: Pubkey, run_id: str) -> tuple[bytes, JoinRun]:
    """The joiner's key and the join a message to countersign carries: a TCP ``join_authorization``, or a Solana
    join_run transaction message (``solana_join``); ``AuthFailure`` for anything else."""
    carried = protocol.split_join_authorization(message)
    joiner, instruction = carried if carried is not None else solana_join(message, authority, program_id, run_id)
    try:
        join = decode_instruction(instruction)
    except MalformedInstruction as exc:
        raise refused_join(f"the message carries no well-formed instruction: {exc.detail}") from None
    if not isinstance(join, JoinRun):
        raise refused_join(f"the join authority countersigns join_run only, not {join.NAME}")
    return joiner, join


def solana_join(message: bytes, authority: Pubkey, program_id: Pubkey, run_id: str) -> tuple[bytes, bytes]:
    """The joiner and the instruction data of a Solana join_run transaction message, checked to be nothing else.

    On Solana the authority co-signs the transaction: the client sends the message it will submit, and adds the
    returned signature with a ``Presigner``. The program already requires the authorizer to sign join_run, so it
    needs no change; the other way, an ed25519-program instruction checked through the instructions sysvar,
    would add a message format, a sysvar parser and compute units to the program for the same guarantee.
    Signing a whole transaction is what needs care: it must hold this one join_run instruction of the coordinator
    program and nothing else (no transfer from, or other use of, the authority's key), the joiner must be its
    fee payer and its only other signer, the authority read-only, and the instance the run's own PDA (the program
    checks the run id against it, and the coordinator account against the instance).
    """
    try:
        parsed = Message.from_bytes(message)
    except ValueError:
        parsed = None
    if parsed is None or bytes(parsed) != message:
        raise refused_join("the message is neither a TCP join authorization nor a Solana transaction message")
    keys, header = parsed.account_keys, parsed.header
    if len(parsed.instructions) != 1:
        raise refused_join("a countersigned transaction holds the join_run instruction and nothing else")
    (compiled,) = parsed.instructions
    indexes = [compiled.program_id_index, *compiled.accounts]
    if max(indexes) >= len(keys) or parsed.has_duplicates():
        raise refused_join("the transaction message is malformed")
    if keys[compiled.program_id_index] != program_id:
        raise refused_join(f"the instruction is not for the coordinator program {program_id}")
    accounts = [keys[i] for i in compiled.accounts]
    instance, _ = instance_address(program_id, run_id)
    if len(accounts) != 4 or accounts[1:3] != [authority, instance]:
        raise refused_join(f"join_run takes [joiner, authorizer, instance, coordinator], the authorizer being this "
                           f"join authority {authority} and the instance run {run_id}'s, {instance}")
    joiner = accounts[0]
    if keys[:header.num_required_signatures] != [joiner, authority]:
        raise refused_join("the joiner must pay for its join and be its only signer besides the join authority")
    if header.num_readonly_signed_accounts < 1:
        raise refused_join("the join authority must be a read-only account of the transaction")
    return bytes(joiner), bytes(compiled.data)


# ----- slots and their storage --------------------------------------------------------------------------


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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS service (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    run_id TEXT NOT NULL,
    nonce_floor REAL NOT NULL
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
    synced INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS nonces (
    peer TEXT NOT NULL,
    nonce TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (peer, nonce)
);
CREATE INDEX IF NOT EXISTS nonces_by_time ON nonces (time);
CREATE TABLE IF NOT EXISTS grants (
    peer TEXT PRIMARY KEY,
    contributor TEXT NOT NULL,
    seen REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS grants_by_seen ON grants (seen);
"""


class StoreError(RuntimeError):
    """The database holds a different run, or cannot be opened."""


class SlotStore:
    """The auth service's database, one run per file: its slots and the nonces it has seen spent.

    The nonce floor is the newest time among forgotten nonces: a request at or below it may be one whose
    nonce was forgotten, so it is refused. The count and the floor are cached, and re-read after a rollback.
    """

    def __init__(self, path: str | Path, run_id: str, nonce_capacity: int = NONCE_CAPACITY) -> None:
        self.path = path
        self.nonce_capacity = nonce_capacity
        try:
            # Requests run on worker threads, one at a time under the service's lock.
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives process crashes
            self.db.executescript(_SCHEMA)
            self.db.execute("INSERT OR IGNORE INTO service (id, run_id, nonce_floor) VALUES (1, ?, ?)",
                            (run_id, -math.inf))
            (held,) = self.db.execute("SELECT run_id FROM service WHERE id = 1").fetchone()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {path}: {exc}") from None
        if held != run_id:
            raise StoreError(f"{path} holds the auth service of run {held!r}, not {run_id!r}: use another --db")
        self._read_nonce_bookkeeping()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic change; nothing of it is kept unless it commits."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # some failures roll back by themselves
                self.db.execute("ROLLBACK")
            self._read_nonce_bookkeeping()
            raise

    def slots(self) -> dict[str, Slot]:
        rows = self.db.execute("SELECT * FROM slots").fetchall()
        return {row[0]: Slot(*row[:-1], synced=bool(row[-1])) for row in rows}

    def put(self, slot: Slot) -> None:
        self.db.execute("INSERT OR REPLACE INTO slots VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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

    def spend_nonce(self, peer: str, nonce: str, stamp: float, forget_before: float) -> None:
        """Remember a nonce; forget those older than ``forget_before`` (their time no longer passes), and the
        oldest beyond ``nonce_capacity``, raising the floor to the newest forgotten."""
        self.db.execute("INSERT INTO nonces (peer, nonce, time) VALUES (?, ?, ?)", (peer, nonce, stamp))
        self.nonce_count += 1
        self._forget_nonces(forget_before)
        excess = self.nonce_count - self.nonce_capacity
        if excess > 0:
            (newest,) = self.db.execute("SELECT MAX(time) FROM (SELECT time FROM nonces ORDER BY time LIMIT ?)",
                                        (excess,)).fetchone()
            self._forget_nonces(math.nextafter(newest, math.inf))

    def close(self) -> None:
        self.db.close()

    def _forget_nonces(self, before: float) -> None:
        if before <= self.nonce_floor:
            return
        self.nonce_count -= self.db.execute("DELETE FROM nonces WHERE time < ?", (before,)).rowcount
        self.nonce_floor = math.nextafter(before, -math.inf)
        self.db.execute("UPDATE service SET nonce_floor = ? WHERE id = 1", (self.nonce_floor,))

    def _read_nonce_bookkeeping(self) -> None:
        (self.nonce_count,) = self.db.execute("SELECT COUNT(*) FROM nonces").fetchone()
        (self.nonce_floor,) = self.db.execute("SELECT nonce_floor FROM service WHERE id = 1").fetchone()


# ----- the service --------------------------------------------------------------------------------------


@dataclass
class AuthService:
    """Slot, stage and queue bookkeeping for one run; thread-safe. ``identify`` maps a token to a user name;
    ``db`` is the SQLite file that keeps the slots (``":memory:"`` keeps nothing across restarts)."""

    run_id: str
    num_stages: int
    capacity: int
    identify: Callable[[str], str]
    max_slots_per_token: int
    db: str | Path
    keypair: Keypair = field(default_factory=Keypair)
    lease_seconds: float = 600.0
    max_integrating: int = 1
    integration_seconds: float = 900.0
    checkpoint: dict[str, str] | None = None
    clock: Callable[[], float] = time.time
    nonce_capacity: int = NONCE_CAPACITY
    grants_kept: int = GRANTS_KEPT  # never fewer than ``capacity``: every live slot stays mapped
    program_id: Pubkey = PROGRAM_ID  # the coordinator program whose joins it countersigns on Solana

    def __post_init__(self) -> None:
        if (self.num_stages < 2 or self.capacity < 1 or self.lease_seconds <= 0 or self.max_integrating < 0
                or self.max_slots_per_token < 1 or self.nonce_capacity < 1):
            raise ValueError("need num_stages >= 2, capacity >= 1, max_slots_per_token >= 1, lease_seconds > 0, "
                             "max_integrating >= 0, nonce_capacity >= 1")
        self._store = SlotStore(self.db, self.run_id, self.nonce_capacity)
        self._lock = threading.Lock()
        self._slots = self._store.slots()
        self._drop_misfits()

    # --- requests ---

    def join(self, token: str, request: Any) -> dict[str, Any]:
        """Grant (or renew) the requesting peer's slot; the signed grant is the answer."""
        signed = check_signed(request, "join", self.run_id, self.clock())
        role = signed.fields["role"]
        if role not in ROLES:
            raise bad_request(f"role must be one of {ROLES}, not {role!r}")
        if signed.token_sha256 != token_sha256(token):
            raise AuthFailure(HTTPStatus.UNAUTHORIZED, "token_mismatch",
                              "the request is signed for another Hugging Face token than the one it was sent with")
        contributor = self.identify(token)  # outside the lock: it may call the Hub
        grant = self._apply(signed, lambda now: self._grant(signed, contributor, now))
        signature = bytes(self.keypair.sign_message(canonical(grant))).hex()
        return {"grant": grant, "signature": signature, "service": bytes(self.keypair.pubkey()).hex()}

    def queue(self, request: Any) -> dict[str, Any]:
        """The peer's place in the join queue: 0 and ``admitted`` means go and sync now, 1 is next in line."""
        signed = check_signed(request, "queue", self.run_id, self.clock())
        return self._apply(signed, lambda now: self._place(self._renew(self._own(signed), now), now))

    def synced(self, request: Any) -> dict[str, Any]:
        """The peer finished its sync phases: the next queued joiner may integrate. Only an admitted peer may
        say so: from a waiting one it would be a way past the queue."""
        signed = check_signed(request, "synced", self.run_id, self.clock())
        return self._apply(signed, lambda now: self._mark_synced(self._own(signed), now))

    def leave(self, request: Any) -> dict[str, Any]:
        signed = check_signed(request, "leave", self.run_id, self.clock())
        return self._apply(signed, lambda now: self._release(signed))

    def countersign(self, request: Any) -> dict[str, str]:
        """The join authority's signature over ``message``, a join of the requesting peer's own key into this
        run, in the role (and, for a worker, the stage) its slot was granted; the slot must be live."""
        signed = check_signed(request, "countersign", self.run_id, self.clock())
        message = message_bytes(signed.fields["message"])
        joiner, join = join_to_countersign(message, self.keypair.pubkey(), self.program_id, self.run_id)
        self._apply(signed, lambda now: self._check_join(self._own(signed), joiner, join))
        return {"signature": bytes(self.keypair.sign_message(message)).hex()}

    def occupancy(self) -> dict[str, Any]:
        """Live slots per stage and contributors (the dashboard's view); needs no authentication."""
        with self._lock:
            now = self.clock()
            slots = [s for s in self._slots.values() if s.expires > now]
        return {
            "run_id": self.run_id, "capacity": self.capacity, "slots": len(slots),
            "contributors": len({s.contributor for s in slots}),
            "stages": [sum(s.stage == i for s in slots) for i in range(self.num_stages)],
            "trainers": sum(s.role == "trainer" for s in slots),
        }

    def contributors(self, run_id: str) -> dict[str, str]:
        """Which contributor each key granted a slot belongs to, by base58 public key: what lets a leaderboard sum
        one contributor's processes into one score. A key that left stays mapped (its points outlive its slot),
        for the ``grants_kept`` keys granted or renewed last. Only keys and Hub user names leave, never a token or
        its hash. Another run's id gets an empty map (this service knows one run)."""
        if run_id != self.run_id:
            return {}
        with self._lock:
            return {str(Pubkey.from_bytes(bytes.fromhex(peer))): name for peer, name in self._store.grants()}

    def close(self) -> None:
        with self._lock:
            self._store.close()

    # --- one request, one transaction ---

    def _apply(self, signed: SignedRequest, change: Callable[[float], dict[str, Any]]) -> dict[str, Any]:
        """Spend the request's nonce, expire old slots and apply ``change``, all in one transaction; answer
        only once it commits. A refused request still spends its nonce, so it cannot be replayed later, when
        the refusal may no longer hold."""
        refusal: AuthFailure | None = None
        with self._lock:
            try:
                with self._store.transaction():
                    now = self.clock()
                    self._spend_nonce(signed, now)
                    self._expire(now)
                    try:
                        answer = change(now)
                    except AuthFailure as failure:
                        refusal = failure
            except AuthFailure:
                raise  # a replay: nothing was changed
            except Exception as exc:
                self._slots = self._store.slots()  # back to what was committed
                if isinstance(exc, sqlite3.Error):
                    log.error("the auth service's database failed: %s", exc)
                    raise AuthFailure(HTTPStatus.SERVICE_UNAVAILABLE, "storage_unavailable",
                                      "the auth service could not save the request; try again") from None
                raise
        if refusal is not None:
            raise refusal
        return answer

    def _spend_nonce(self, signed: SignedRequest, now: float) -> None:
        if signed.time <= self._store.nonce_floor:
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "stale_request",
                              "the request is older than the nonces the service still remembers; send a fresh one")
        if self._store.nonce_spent(signed.peer, signed.nonce):
            raise AuthFailure(HTTPStatus.CONFLICT, "replayed_request",
                              "this request's nonce was already used: a request is accepted once")
        self._store.spend_nonce(signed.peer, signed.nonce, signed.time, forget_before=now - MAX_CLOCK_SKEW)

    # --- the changes (under the lock, inside the transaction; each checks before it changes anything) ---

    def _grant(self, signed: SignedRequest, contributor: str, now: float) -> dict[str, Any]:
        role = signed.fields["role"]
        slot = self._slots.get(signed.peer)
        if slot is not None and (slot.contributor, slot.role, slot.token_sha256) != (
                contributor, role, signed.token_sha256):
            raise AuthFailure(HTTPStatus.CONFLICT, "peer_taken",
                              f"this peer key already holds a {slot.role} slot under another token, identity or "
                              "role; use a separate keypair per process")
        if slot is None:
            slot = self._new_slot(signed, contributor, role, now)
        slot.expires = now + self.lease_seconds
        self._store.put(slot)
        self._store.remember_grant(slot.peer, contributor, now, max(self.grants_kept, self.capacity))
        return {
            "run_id": self.run_id, "contributor": contributor, "peer": slot.peer, "role": role,
            "slot": slot.index, "capacity": self.capacity, "stage": slot.stage,
            "num_stages": self.num_stages, "expires": slot.expires,
            "peers_of_contributor": self._slots_of(contributor), "checkpoint": self.checkpoint,
        }

    def _new_slot(self, signed: SignedRequest, contributor: str, role: str, now: float) -> Slot:
        held = self._slots_of(contributor)
        if held >= self.max_slots_per_token:
            raise AuthFailure(HTTPStatus.FORBIDDEN, "contributor_full",
                              f"{contributor} already holds {held} slots in run {self.run_id}, the most one "
                              f"contributor may hold (max {self.max_slots_per_token} per token); every process "
                              "under a token counts toward it: stop one or wait for its lease to end")
        if len(self._slots) >= self.capacity:
            raise AuthFailure(HTTPStatus.SERVICE_UNAVAILABLE, "swarm_full",
                              f"the swarm of run {self.run_id} is full: all {self.capacity} contributor "
                              "slots are taken; try again later")
        slot = Slot(peer=signed.peer, token_sha256=signed.token_sha256, contributor=contributor, role=role,
                    stage=self._least_occupied_stage() if role == "worker" else -1,
                    index=self._free_index(), expires=now, queued_at=now)
        self._slots[slot.peer] = slot
        log.info("granted slot %d to %s (%s, peer %s…), stage %d", slot.index, contributor, role,
                 slot.peer[:8], slot.stage)
        return slot

    def _own(self, signed: SignedRequest) -> Slot:
        """The requesting peer's slot, asked for under the token it was granted to."""
        slot = self._slots.get(signed.peer)
        if slot is None:
            raise AuthFailure(HTTPStatus.NOT_FOUND, "no_slot", "this peer holds no slot (expired?): join again")
        if slot.token_sha256 != signed.token_sha256:
            raise _token_mismatch()
        return slot

    def _renew(self, slot: Slot, now: float) -> Slot:
        slot.expires = now + self.lease_seconds
        self._store.put(slot)
        return slot

    def _place(self, slot: Slot, now: float) -> dict[str, Any]:
        if self._admitted(slot):
            return self._queue_answer(0, True)
        ahead = self._waiting().index(slot)
        if ahead == 0 and self._integrating() < self.max_integrating:
            slot.integrating_since = now
            self._store.put(slot)
            return self._queue_answer(0, True)
        return self._queue_answer(ahead + 1, False)

    def _mark_synced(self, slot: Slot, now: float) -> dict[str, Any]:
        if not self._admitted(slot):
            position = self._waiting().index(slot) + 1
            raise AuthFailure(HTTPStatus.CONFLICT, "not_admitted",
                              f"this peer is still waiting in the join queue (position {position}); it may report "
                              "its sync only once the queue has admitted it")
        slot.synced, slot.integrating_since = True, None
        self._renew(slot, now)
        return {"ok": True}

    def _check_join(self, slot: Slot, joiner: bytes, join: JoinRun) -> dict[str, Any]:
        """A join may be countersigned for the key, run, role and stage its slot was granted, and only those."""
        if joiner.hex() != slot.peer:
            raise refused_join(f"the join is for key {joiner.hex()[:8]}…, but this slot belongs to {slot.peer[:8]}…: "
                               "a slot admits only the key it was granted to")
        if join.run_id != self.run_id:
            raise refused_join(f"the join is for run {join.run_id!r}; this service admits to run {self.run_id!r}")
        if join.role.name.lower() != slot.role:
            raise refused_join(f"the join is as a {join.role.name.lower()}; the slot was granted for a {slot.role}")
        stage = slot.stage if slot.role == "worker" else limits.NO_STAGE
        if join.stage != stage:
            raise refused_join(f"the join asks for stage {join.stage}; the slot was granted stage {slot.stage}")
        log.info("countersigned the join of slot %d (%s, peer %s…)", slot.index, slot.role, slot.peer[:8])
        return {}

    def _release(self, signed: SignedRequest) -> dict[str, Any]:
        slot = self._slots.get(signed.peer)
        if slot is not None:
            if slot.token_sha256 != signed.token_sha256:
                raise _token_mismatch()
            del self._slots[signed.peer]
            self._store.drop(signed.peer)
            log.info("slot %d of %s left", slot.index, slot.contributor)
        return {"ok": True}

    def _expire(self, now: float) -> None:
        for peer, slot in list(self._slots.items()):
            if slot.expires <= now:
                del self._slots[peer]
                self._store.drop(peer)
                log.info("slot %d of %s expired", slot.index, slot.contributor)
            elif slot.integrating_since is not None and now - slot.integrating_since > self.integration_seconds:
                slot.integrating_since, slot.synced = None, True  # gave it its time; stop holding the queue
                self._store.put(slot)

    # --- reading the slots ---

    def _admitted(self, slot: Slot) -> bool:
        return self.max_integrating == 0 or slot.synced or slot.integrating_since is not None

    def _waiting(self) -> list[Slot]:
        """The join queue, in join order."""
        return sorted((s for s in self._slots.values() if not self._admitted(s)), key=lambda s: (s.queued_at, s.index))

    def _integrating(self) -> int:
        return sum(s.integrating_since is not None for s in self._slots.values())

    def _slots_of(self, contributor: str) -> int:
        return sum(s.contributor == contributor for s in self._slots.values())

    def _least_occupied_stage(self) -> int:
        counts = [0] * self.num_stages
        for slot in self._slots.values():
            if slot.stage >= 0:
                counts[slot.stage] += 1
        return counts.index(min(counts))

    def _free_index(self) -> int:
        taken = {s.index for s in self._slots.values()}
        return next(i for i in range(self.capacity) if i not in taken)

    def _queue_answer(self, position: int, admitted: bool) -> dict[str, Any]:
        return {"position": position, "admitted": admitted, "integrating": self._integrating(),
                "max_integrating": self.max_integrating}

    def _drop_misfits(self) -> None:
        """Slots kept from a run served with more stages or slots than now no longer exist."""
        misfits = [s for s in self._slots.values() if s.stage >= self.num_stages or s.index >= self.capacity]
        if not misfits:
            return
        with self._store.transaction():
            for slot in misfits:
                self._store.drop(slot.peer)
                del self._slots[slot.peer]
        log.warning("dropped %d kept slot(s) beyond %d stages or %d slots", len(misfits), self.num_stages,
                    self.capacity)


# ----- HTTP ----------------------------------------------------------------------------------------------


class AuthHTTPServer:
    """The auth service over HTTP: PUT /api/join, POST /api/queue|synced|leave|countersign, GET /api/occupancy and
    /api/contributors?run_id=.

    One asyncio loop holds the connections; each must deliver its whole request within ``request_timeout``
    (else 408), at most ``max_connections`` are open at once (more are answered 503), and requests run on
    ``workers`` threads. One request per connection.
    """

    def __init__(self, service: AuthService, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 workers: int = WORKERS) -> None:
        self.service = service
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="auth-request")
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving, self._stopped = threading.Event(), threading.Event()

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def start(self) -> AuthHTTPServer:
        """Serve in a background thread (tests, embedding); ``shutdown()`` stops it."""
        threading.Thread(target=self.serve_forever, name="auth-service", daemon=True).start()
        self._serving.wait()
        return self

    def shutdown(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._stopped.wait()

    def server_close(self) -> None:
        self._socket.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            server = await asyncio.start_server(self._connection, sock=self._socket, backlog=LISTEN_BACKLOG)
            async with server:
                self._serving.set()
                await self._stop.wait()
        finally:
            self._serving.set()
            self._stopped.set()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self.max_connections:
                status, answer = HTTPStatus.SERVICE_UNAVAILABLE, {
                    "error": "busy", "message": "the auth service has too many open connections; try again shortly"}
            else:
                status, answer = await self._respond(reader)
            writer.write(_response(status, answer))
            async with asyncio.timeout(self.request_timeout):
                await writer.drain()
            writer.write_eof()
            await _linger(reader)
            writer.close()
        except (OSError, TimeoutError):  # the client went away or does not read: nothing more to tell it
            writer.transport.abort()
        except Exception:  # nothing a client sends may stop the loop; a bug drops only this connection
            log.exception("auth connection failed")
            writer.transport.abort()
        finally:
            self._open -= 1

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[HTTPStatus, dict[str, Any]]:
        try:
            async with asyncio.timeout(self.request_timeout):
                request, body = await _read_request(reader)
        except TimeoutError:
            return HTTPStatus.REQUEST_TIMEOUT, {
                "error": "timeout", "message": f"the request did not arrive within {self.request_timeout:g} s"}
        except h11.RemoteProtocolError as exc:
            return HTTPStatus(exc.error_status_hint), {"error": "bad_request", "message": f"malformed HTTP: {exc}"}
        except AuthFailure as failure:
            return failure.status, failure.answer()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, self._dispatch, request, body)

    def _dispatch(self, request: h11.Request, body: bytes) -> tuple[HTTPStatus, dict[str, Any]]:
        method, target = request.method.decode(), request.target.decode("ascii", "replace")
        try:
            return HTTPStatus.OK, self._route(method, target, dict(request.headers), body)
        except AuthFailure as failure:
            return failure.status, failure.answer()
        except Exception:  # a bug must answer 500 and keep the service up, never leave the client hanging
            log.exception("auth request %s %s failed", method, target)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal", "message": "internal error"}

    def _route(self, method: str, target: str, headers: dict[bytes, bytes], body: bytes) -> dict[str, Any]:
        service = self.service
        if (method, target) == ("GET", "/api/occupancy"):
            return service.occupancy()
        path, _, query = target.partition("?")
        if (method, path) == ("GET", "/api/contributors"):
            return service.contributors(_query_value(query, "run_id"))
        if (method, target) == ("PUT", "/api/join"):
            request = _json_body(body)
            return service.join(_bearer(headers), request)
        actions = {"/api/queue": service.queue, "/api/synced": service.synced, "/api/leave": service.leave,
                   "/api/countersign": service.countersign}
        action = actions.get(target) if method == "POST" else None
        if action is None:
            raise AuthFailure(HTTPStatus.NOT_FOUND, "not_found", f"no {method} {target}")
        return action(_json_body(body))


async def _read_request(reader: asyncio.StreamReader) -> tuple[h11.Request, bytes]:
    """One request and its body, parsed by h11: headers stop at twice ``MAX_HEADER_BYTES``, the body at
    ``MAX_REQUEST_BYTES``."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(MAX_HEADER_BYTES))  # h11 refuses more once incomplete
        elif isinstance(event, h11.Request):
            request = event
            declared = dict(event.headers).get(b"content-length", b"0")  # h11 checked it: 1 to 20 digits
            if int(declared) > MAX_REQUEST_BYTES:
                raise _too_large()
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_REQUEST_BYTES:
                raise _too_large()
        elif isinstance(event, h11.EndOfMessage) and request is not None:
            return request, bytes(body)
        else:
            raise h11.RemoteProtocolError("the connection closed before a whole request arrived", 400)


async def _linger(reader: asyncio.StreamReader) -> None:
    """Let the client read the answer before closing: closing with its input unread (an oversize body, say)
    would reset the connection and lose the answer. At most ``LINGER_SECONDS``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            while await reader.read(MAX_HEADER_BYTES):
                pass


def _too_large() -> AuthFailure:
    return AuthFailure(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "too_large",
                       f"the body is over {MAX_REQUEST_BYTES} bytes; a request is a small JSON object")


def _json_body(body: bytes) -> Any:
    if not body:
        raise bad_request(f"the body must be 1..{MAX_REQUEST_BYTES} bytes of JSON")
    try:
        return json.loads(body)
    except RecursionError:
        raise bad_request("the body's JSON nests too deeply; a request is a flat object") from None
    except ValueError:
        raise bad_request("the body is not JSON") from None


def _query_value(query: str, name: str) -> str:
    """The one value of ``name`` in a query string; a missing or repeated one is a bad request."""
    try:
        values = urllib.parse.parse_qs(query, keep_blank_values=True, max_num_fields=8).get(name, [])
    except ValueError:  # more fields than a query of this service has
        values = []
    if len(values) != 1:
        raise bad_request(f"give exactly one {name}= in the query")
    return values[0]


def _bearer(headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
        raise AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                          "no Hugging Face token: send it as 'Authorization: Bearer <token>'")
    return auth.removeprefix("Bearer ").strip()


def _response(status: HTTPStatus, answer: dict[str, Any]) -> bytes:
    data = json.dumps(answer).encode()
    head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data
