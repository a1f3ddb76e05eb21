"""Worker discovery over hivemind's DHT: signed, expiring, stage-keyed announcements.

Each worker stores a record under the DHT key ``<run_id>.<stage>``, subkey its uid (``body1.0.N``), with
its gRPC address, sync phase, load and model fingerprint, signed with its ed25519 identity. It re-announces
every ``period`` seconds with an expiration of two periods, so a worker that dies vanishes on its own; one
that stops cleanly overwrites its record with a "left" one. A DHT is writable by anyone, so readers keep
only records whose signature verifies, whose subkey is the signed uid and whose DHT expiration does not
outlive the signed one (an old record re-stored by someone else cannot be stretched).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from solders.keypair import Keypair

from client.identity import verify

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)

STATE_UP = "up"
STATE_LEFT = "left"
SYNC_PHASES = (
    0,
    1,
    2,
)  # 0: active; 1: catching up, serves no batches; 2: serves batches, averages with weight 0
_EXPIRY_SLACK = 1e-3


def worker_uid(stage: str, index: int) -> str:
    """The stage-prefixed id under which a worker announces itself."""
    return f"{stage}.0.{index}"


def default_index(pubkey: bytes) -> int:
    """A uid index derived from the identity, so that honest workers never collide on a subkey."""
    return int.from_bytes(hashlib.sha256(pubkey).digest()[:4], "little")


def stage_key(run_id: str, stage: str) -> str:
    return f"{run_id}.{stage}"


@dataclass(frozen=True)
class WorkerRecord:
    """A worker's announcement as stored in the DHT and as trainers see it."""

    run_id: str
    stage: str
    uid: str
    address: str
    sync_phase: int
    load: int
    throughput: float
    model: str
    pubkey: str  # hex
    expires: float
    state: str
    signature: str = ""  # hex

    def signed_bytes(self) -> bytes:
        fields = asdict(self)
        del fields["signature"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def signed_by(self, keypair: Keypair) -> WorkerRecord:
        unsigned = replace(self, pubkey=bytes(keypair.pubkey()).hex(), signature="")
        return replace(unsigned, signature=bytes(keypair.sign_message(unsigned.signed_bytes())).hex())

    def verifies(self) -> bool:
        try:
            return verify(bytes.fromhex(self.pubkey), self.signed_bytes(), bytes.fromhex(self.signature))
        except ValueError:
            return False

    @classmethod
    def from_value(cls, value: object) -> WorkerRecord:
        """Parse a DHT value, raising ``ValueError`` for anything that is not exactly a record."""
        if not isinstance(value, dict) or set(value) != set(cls.__dataclass_fields__):
            raise ValueError("not a worker record")
        types = {"sync_phase": int, "load": int, "throughput": (int, float), "expires": (int, float)}
        for key, item in value.items():
            if not isinstance(item, types.get(key, str)) or isinstance(item, bool):
                raise ValueError(f"worker record field {key} has type {type(item).__name__}")
        return cls(**value)


class Announcer:
    """Background thread keeping one worker's record alive in the DHT (the SWARM "DHTHandler")."""

    def __init__(
        self,
        dht: hivemind.DHT,
        keypair: Keypair,
        make_record: Callable[[float], WorkerRecord],
        *,
        period: float,
    ) -> None:
        """``make_record(expires)`` returns the worker's current, unsigned record."""
        if period <= 0:
            raise ValueError("announce period must be positive")
        self.dht = dht
        self.keypair = keypair
        self.make_record = make_record
        self.period = period
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._last: WorkerRecord | None = None
        self._thread = threading.Thread(target=self._run, name="dht-announcer", daemon=True)

    def start(self) -> None:
        self._publish()
        self._thread.start()

    def announce_now(self) -> None:
        """Publish at once (after a sync-phase change) instead of at the next period."""
        self._wake.set()

    def stop(self, *, leave: bool = True) -> None:
        """Stop re-announcing; with ``leave``, overwrite the record by a "left" one: trainers drop it now."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        if leave and self._last is not None:
            # The DHT keeps the value with the latest expiration per subkey, so the farewell must outlive the
            # current record, by a little.
            gone = replace(self._last, state=STATE_LEFT, expires=self._last.expires + 1.0)
            self._store(gone.signed_by(self.keypair))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.period)
            self._wake.clear()
            if not self._stopping.is_set():
                self._publish()

    def _publish(self) -> None:
        from hivemind.utils import get_dht_time

        record = self.make_record(get_dht_time() + 2 * self.period).signed_by(self.keypair)
        if self._store(record):
            self._last = record

    def _store(self, record: WorkerRecord) -> bool:
        try:
            ok = bool(
                self.dht.store(
                    stage_key(record.run_id, record.stage),
                    asdict(record),
                    expiration_time=record.expires,
                    subkey=record.uid,
                )
            )
        except Exception as exc:  # the DHT being briefly unreachable must not kill the worker
            log.warning("announcing %s failed: %s", record.uid, exc)
            return False
        if not ok:
            log.warning("the DHT did not accept the announcement of %s", record.uid)
        return ok


class WorkerDirectory:
    """Reads the verified, live, routable workers of each stage from the DHT."""

    def __init__(self, dht: hivemind.DHT, run_id: str, model_fingerprint: str) -> None:
        self.dht = dht
        self.run_id = run_id
        self.model_fingerprint = model_fingerprint
        self._warned: set[str] = set()

    def records(self, stage: str) -> list[WorkerRecord]:
        """Every valid record of ``stage``, whatever its phase (for monitoring and matchmaking)."""
        from hivemind.utils import get_dht_time

        found = self.dht.get(stage_key(self.run_id, stage), latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        now = get_dht_time()
        valid = []
        for subkey, item in found.value.items():
            try:
                record = WorkerRecord.from_value(item.value)
            except ValueError as exc:
                self._warn(f"{stage}/{subkey!r}", f"ignoring a malformed record in stage {stage}: {exc}")
                continue
            problem = self._problem(record, subkey, stage, item.expiration_time, now)
            if problem:
                self._warn(f"{record.uid}/{record.pubkey}", f"ignoring worker {record.uid}: {problem}")
                continue
            valid.append(record)
        return sorted(valid, key=lambda r: r.uid)

    def workers(self, stage: str) -> list[WorkerRecord]:
        """Workers a trainer may route to: up and not in sync phase 1."""
        return [r for r in self.records(stage) if r.state == STATE_UP and r.sync_phase != 1]

    def _problem(self, record: WorkerRecord, subkey: object, stage: str, expiration: float, now: float) -> str:
        if record.run_id != self.run_id or record.stage != stage or subkey != record.uid:
            return "record does not match its DHT key"
        if not record.uid.startswith(f"{stage}.0."):
            return f"uid is not prefixed with {stage}.0."
        if not record.verifies():
            return "signature does not verify"
        if expiration > record.expires + _EXPIRY_SLACK or record.expires < now:
            return "expired or re-stored past its signed expiration"
        if record.sync_phase not in SYNC_PHASES:
            return f"unknown sync phase {record.sync_phase}"
        if record.model != self.model_fingerprint:
            return f"it serves model {record.model}, this run uses {self.model_fingerprint}"
        return ""

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


def start_dht(initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0) -> hivemind.DHT:
    """A hivemind DHT node listening on ``host:port`` (0: any free port), joined to ``initial_peers``."""
    import hivemind

    from client.helper_processes import forking_helpers

    with forking_helpers():  # stopped by dht.shutdown(), not by Ctrl+C; killed with this process
        return hivemind.DHT(
            initial_peers=list(initial_peers) or None,
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            start=True,
        )


def run_bootstrap(initial_peers: Sequence[str], host: str, port: int, stop: threading.Event) -> None:
    """Run a DHT node that stores no model data and only lets peers find each other, until ``stop``."""
    dht = start_dht(initial_peers, host, port)
    try:
        for addr in dht.get_visible_maddrs():
            print(f"DHT bootstrap listening: --initial-peer {addr}", flush=True)
        stop.wait()
    finally:
        dht.shutdown()
        log.info("DHT bootstrap stopped")
