"""Worker discovery over hivemind's DHT: signed, expiring, stage-keyed announcements.

Each worker stores a record under the DHT key ``<run_id>.<stage>`` with its uid (``body1.0.N``), gRPC
address, sync phase, load and model fingerprint, signed with its ed25519 identity. It re-announces every
``period`` seconds with an expiration of two periods, so a worker that dies vanishes on its own; one that
stops cleanly overwrites its record with a "left" one.

A DHT is writable by anyone, so:
- the record lives under its owner's subkey, sealed (``client.sealed``: every node psyswarm starts refuses
  anything else there), so nobody can overwrite, hide or stretch another worker's announcement;
- a uid is bound to a key: its index N is derived from the worker's public key (64 bits of a hash, too many
  to grind a key that derives another's), and a directory refuses a record whose uid another key derives.
  Indices below ``HAND_PICKED_INDICES`` are chosen by hand (tests and benchmarks pass ``index=``); they bind
  to no key, so when two keys announce the same one, neither is listed;
- readers keep only records whose every field is well formed, whose signature verifies, that name this run
  and stage, and whose DHT expiration neither outlives the signed one nor any record's lifetime.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from solders.keypair import Keypair

from client.identity import verify
from client.pipeline.addresses import Dialing, Resolving, announced_dht, reach_of, split_endpoint
from client.stages import HAND_PICKED_INDICES, default_index

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
def uid_index(uid: str, stage: str) -> int | None:
    """N of a ``<stage>.0.N`` uid (decimal, no leading zeros), or None if ``uid`` is not one."""
    prefix = f"{stage}.0."
    digits = uid[len(prefix):]
    if not uid.startswith(prefix) or not re.fullmatch(r"0|[1-9][0-9]{0,24}", digits):
        return None
    return int(digits)


def _text(limit: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and 0 < len(v) <= limit and v.isprintable()


def _hex(nbytes: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, str) and re.fullmatch(f"[0-9a-f]{{{2 * nbytes}}}", v) is not None


def _endpoint(v: str) -> bool:
    try:
        split_endpoint(v)
    except ValueError:
        return False
    return True


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


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
        """Parse a DHT value, raising ``ValueError`` for anything that is not exactly a well-formed record."""
        if not isinstance(value, dict) or set(value) != set(_FIELD_RULES):
            raise ValueError("not a worker record")
        for key, item in value.items():
            if not _FIELD_RULES[key](item):
                raise ValueError(f"worker record field {key} is malformed ({type(item).__name__})")
        return cls(**value)


_FIELD_RULES: dict[str, Callable[[object], bool]] = {
    "run_id": _text(64),
    "stage": _text(64),
    "uid": _text(128),
    "address": lambda v: _text(255)(v) and _endpoint(v),
    "sync_phase": lambda v: _count(v) and v in SYNC_PHASES,
    "load": _count,
    "throughput": _finite,
    "model": _text(64),
    "pubkey": _hex(32),
    "expires": _finite,
    "state": lambda v: v in (STATE_UP, STATE_LEFT),
    "signature": _hex(64),
}
"""What each field of a worker record read from the DHT must be."""


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
        from client.sealed import MAX_LIFETIME

        if not 0 < period <= MAX_LIFETIME / 2:
            raise ValueError(f"announce period must be positive and at most {MAX_LIFETIME / 2:.0f} s")
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

        try:
            record = self.make_record(get_dht_time() + 2 * self.period).signed_by(self.keypair)
        except Exception:  # the thread keeps announcing: a worker that stops announcing drops out of the run
            log.exception("building this worker's announcement failed; trying again in %.0f s", self.period)
            return
        if self._store(record):
            self._last = record

    def _store(self, record: WorkerRecord) -> bool:
        from client.sealed import store_sealed

        try:
            key = stage_key(record.run_id, record.stage)
            ok = store_sealed(self.dht, self.keypair, key, asdict(record), record.expires)
        except Exception as exc:  # the DHT being briefly unreachable must not kill the worker
            log.warning("announcing %s failed: %s", record.uid, exc)
            return False
        if not ok:
            log.warning("the DHT did not accept the announcement of %s", record.uid)
        return ok


class WorkerDirectory:
    """Reads the verified, live, routable workers of each stage from the DHT."""

    def __init__(self, dht: hivemind.DHT, run_id: str, model_fingerprint: str,
                 dialing: Dialing | None = None) -> None:
        """``dialing``: which addresses a listed worker may have, each listed at the IP address to dial; by default
        those the DHT node's own addresses reach (``addresses.reach_of``: a run on this machine alone dials
        anything, one across the internet only internet addresses)."""
        self.dht = dht
        self.run_id = run_id
        self.model_fingerprint = model_fingerprint
        self._dialing = dialing
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
            try:
                record = replace(record, address=self.dialing.target(record.address)) if not problem else record
            except Resolving:  # listed once its name's lookup answers, a refresh or two later
                continue
            except ValueError as exc:
                problem = str(exc)
            if problem:
                self._warn(f"{record.uid}/{record.pubkey}", f"ignoring worker {record.uid}: {problem}")
                continue
            valid.append(record)
        claims = Counter(r.uid for r in valid)
        for uid in (uid for uid, n in claims.items() if n > 1):
            self._warn(f"{uid}/contested", f"ignoring worker {uid}: {claims[uid]} identities announce this uid")
        return sorted((r for r in valid if claims[r.uid] == 1), key=lambda r: r.uid)

    @property
    def dialing(self) -> Dialing:
        """Which workers' addresses this directory lists, and at what IP address: the scopes its DHT node is
        reached at, read from the node at first use unless given."""
        if self._dialing is None:
            self._dialing = Dialing(reach_of([str(m).split("/")[2] for m in self.dht.get_visible_maddrs()]))
        return self._dialing

    def workers(self, stage: str) -> list[WorkerRecord]:
        """Workers a trainer may route to: up and not in sync phase 1."""
        return [r for r in self.records(stage) if r.state == STATE_UP and r.sync_phase != 1]

    def _problem(self, record: WorkerRecord, subkey: object, stage: str, expiration: float, now: float) -> str:
        from client.sealed import within_lifetime

        if record.run_id != self.run_id or record.stage != stage or subkey != record.pubkey:
            return "record does not match its DHT key"
        index = uid_index(record.uid, stage)
        if index is None:
            return f"uid is not {stage}.0.N"
        if index >= HAND_PICKED_INDICES and index != default_index(bytes.fromhex(record.pubkey)):
            return "its uid belongs to another identity"
        if not record.verifies():
            return "signature does not verify"
        if expiration > record.expires + _EXPIRY_SLACK or record.expires < now or not within_lifetime(record.expires):
            return "expired, or stored to outlive its signed expiration or any announcement"
        if record.model != self.model_fingerprint:
            return f"it serves model {record.model}, this run uses {self.model_fingerprint}"
        return ""

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


def start_dht(initial_peers: Sequence[str] = (), host: str = "127.0.0.1", port: int = 0,
              public_host: str | None = None) -> hivemind.DHT:
    """A hivemind DHT node listening on ``host:port`` (0: any free port), joined to ``initial_peers``, that
    stores and reads only records sealed by the owner their subkey names (``client.sealed``). With
    ``public_host``, peers are told to reach it there at the same port instead, as behind a router that forwards
    it (``addresses.announced_dht``); its averagers share its daemon, so their traffic comes in that way too."""
    from client.helper_processes import forking_helpers
    from client.pipeline.dht_node import DHTNode
    from client.sealed import SealValidator

    port, announce = announced_dht(host, port, public_host)
    with forking_helpers():  # stopped by dht.shutdown(), not by Ctrl+C; killed with this process
        return DHTNode(
            initial_peers=list(initial_peers) or None,
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            announce_maddrs=list(announce) or None,
            record_validators=[SealValidator()],
            start=True,
        )


BOOTSTRAP_SHUTDOWN_GRACE = 1.0
"""Seconds a stopping bootstrap node waits for hivemind's DHT process to shut down."""


def run_bootstrap(initial_peers: Sequence[str], host: str, port: int, stop: threading.Event,
                  public_host: str | None = None) -> None:
    """Run a DHT node that stores no model data and only lets peers find each other, until ``stop``; peers reach
    it at ``public_host`` (``addresses``), ``host`` by default."""
    dht = start_dht(initial_peers, host, port, public_host)
    try:
        for addr in dht.get_visible_maddrs():
            print(f"DHT bootstrap listening: --initial-peer {addr}", flush=True)
        stop.wait()
    finally:
        # A signal to the process group reaches hivemind's own DHT process too, and a shutdown request to a
        # process that is already gone waits for ever: give it a few seconds, then leave.
        closing = threading.Thread(target=dht.shutdown, daemon=True)
        closing.start()
        closing.join(BOOTSTRAP_SHUTDOWN_GRACE)
        log.info("DHT bootstrap stopped")
