"""Signed round records that clients publish in the DHT, and the board that stores and reads them.

- ``Commitment``: a trainer's result for its share of a round: its sample range, its mean loss, and every
  stage receipt the workers gave it, in full, each signed by its worker (``client.receipts``). Its hash is the key
  of a witness's batch filter.
- ``Report``: a worker's list of the hashes of the receipts it signed in a round (``SignedReceipt.hash``); it is
  also the worker's proof of presence.
- ``Presence``: a trainer's proof of presence in a round, published as the round opens: a trainer that cannot
  finish (a stage that emptied leaves it stalled) is still alive and must not be taken for dead. It earns
  nothing: credit needs a ``Commitment``.
- ``Accusation``: a trainer's evidence that workers answered its questions unlike their stage's majority
  (``accusations``: the signed answers side by side, which any reader checks); the witnesses leave the accused out.
- ``Ready``: a client's statement that it has loaded the model for an epoch (warmup witnesses read it).
- ``StateDigest``: a worker's digest of its stage's state after a swarm step (``client.pipeline.digests``), which
  its stage's replicas compare and joiners check downloads by (``client.witness.digests``).

Every record names its run and is signed by its author's ed25519 key over its canonical JSON. Anyone can
publish anything, so a record is admitted (``SignedRecord.admit``) only once every field has the type, length
and range it must have, the signature verifies, and it names the run, epoch and round it is read for: a
malformed or foreign record is refused with the reason, and never reaches a computation that could fail on it.
In the DHT each record lives under its author's subkey, sealed (``client.sealed``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from collections.abc import Collection
from typing import Any, ClassVar

from solders.keypair import Keypair

from client.identity import canonical, is_hex, verify
from client.receipts import FIELDS as RECEIPT_FIELDS
from client.receipts import SignedReceipt
from coordinator_program.spec import derived
from coordinator_program.spec.bloom import part_count
from coordinator_program.spec.config import valid_run_id
from coordinator_program.spec.state import CoordinatorState

log = logging.getLogger("psyswarm.records")

RECORD_TTL = 3600.0
"""How long a record lives in the DHT: long enough for a slow epoch, short enough not to pile up."""
MAX_RECEIPTS = 4096
"""The most receipts one record may list: a share of the global batch, one per microbatch and stage."""
MAX_TEXT = 128
"""The longest id (microbatch id, worker uid, stage name) a record may carry."""
MAX_NUMBER = 2**63 - 1
MAX_LOSS = 1e6
"""A mean cross-entropy above this is no model's (float32 probabilities bound it near 104); the bound keeps every
sum a reader makes of losses finite."""
MIN_SECONDS = 1e-6
"""The shortest training time a commitment may claim, other than 0 (not measured): no share trains in less, and
the floor keeps every rate a reader makes of tokens over seconds finite (2**63 tokens over it are 9.2e24/s)."""



class RecordError(ValueError):
    """A record that is malformed, forged, or filed for another run, epoch or round; the message says which."""


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise RecordError(problem)


def _is_number(value: object) -> bool:
    """A non-negative integer a record may hold (not a bool, which Python counts as an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_NUMBER


def _is_text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT and value.isprintable()


def parse_receipt(value: object) -> SignedReceipt:
    """A signed receipt as a trainer files it in a commitment (``SignedReceipt.to_value``), checked field by field
    (``RecordError`` naming the first bad one); whether its signature verifies is the judge's to ask."""
    _require(isinstance(value, dict) and set(value) == set(RECEIPT_FIELDS),
             f"a receipt must be an object with exactly the fields {', '.join(sorted(RECEIPT_FIELDS))}")
    receipt = SignedReceipt(**value)  # type: ignore[arg-type]
    for name in ("trainer_id", "worker"):
        _require(is_hex(getattr(receipt, name), 32), f"receipt.{name} must be a 64-hex public key")
    for name in ("microbatch_id", "stage", "worker_uid", "run"):
        _require(_is_text(getattr(receipt, name)), f"receipt.{name} must be text of 1-{MAX_TEXT} characters")
    _require(_is_number(receipt.sample_start) and _is_number(receipt.sample_end)
             and receipt.sample_start < receipt.sample_end, "receipt samples must be a non-empty range")
    _require(_is_number(receipt.epoch) and _is_number(receipt.round), "receipt epoch and round must be numbers")
    _require(is_hex(receipt.input_digest, 32), "receipt.input_digest must be a sha256 hex digest")
    for name in ("grad_output_digest", "grad_input_digest"):
        digest = getattr(receipt, name)
        _require(digest == "" or is_hex(digest, 32), f"receipt.{name} must be a sha256 hex digest or empty")
    _require(is_hex(receipt.signature, 64), "receipt.signature must be 128 hex characters")
    return receipt


@dataclasses.dataclass(frozen=True)
class SignedRecord:
    """Fields plus ``author`` (hex public key), the run and epoch it belongs to, and ``signature`` (hex) over
    the rest."""

    KIND: ClassVar[str]
    author: str
    signature: str
    run_id: str
    epoch: int

    def signed_bytes(self) -> bytes:
        """The canonical JSON of every field but the signature (read as they are: ``dataclasses.asdict`` would deep-copy
        a commitment's receipts, the bulk of a witness's time)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "signature"}
        return canonical({"kind": self.KIND, **fields})

    def digest(self) -> bytes:
        return hashlib.sha256(self.signed_bytes()).digest()

    def verifies(self) -> bool:
        try:
            return verify(bytes.fromhex(self.author), self.signed_bytes(), bytes.fromhex(self.signature))
        except (ValueError, TypeError):
            return False

    @classmethod
    def create(cls, keypair: Keypair, **fields: Any):
        unsigned = cls(author=bytes(keypair.pubkey()).hex(), signature="", **fields)
        return dataclasses.replace(unsigned, signature=bytes(keypair.sign_message(unsigned.signed_bytes())).hex())

    def to_value(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_value(cls, value: object):
        """Parse a DHT value; ``RecordError`` for anything that is not a well-formed record of this kind."""
        names = {f.name for f in dataclasses.fields(cls)}
        _require(isinstance(value, dict) and set(value) == names, f"not a {cls.__name__}")
        record = cls(**{k: tuple(v) if isinstance(v, list | tuple) else v for k, v in value.items()})  # type: ignore
        record.check()
        return record

    def check(self) -> None:
        """Raise ``RecordError`` unless every field has the type, length and range it must have."""
        _require(is_hex(self.author, 32), f"{self.KIND}.author must be a 64-hex public key")
        _require(is_hex(self.signature, 64), f"{self.KIND}.signature must be 128 hex characters")
        _require(isinstance(self.run_id, str) and valid_run_id(self.run_id), f"{self.KIND}.run_id is not a run id")
        _require(_is_number(self.epoch), f"{self.KIND}.epoch must be a non-negative integer")
        _require(self.round_height() is None or _is_number(self.round_height()),
                 f"{self.KIND}.round must be a non-negative integer")

    def round_height(self) -> int | None:
        """The round a round record belongs to (None for an epoch record such as Ready)."""
        return getattr(self, "round", None)

    def admit(self, author: str, run_id: str, epoch: int, round_: int | None = None) -> None:
        """Raise ``RecordError`` unless this is a well-formed record by ``author``, signed, for this run, epoch
        and (for round records) round: the one test every record passes before anything uses it."""
        self.check()
        _require(self.author == author, f"a {self.KIND} filed under another author")
        _require(self.run_id == run_id, f"a {self.KIND} of run {self.run_id!r}, not {run_id!r}")
        _require(self.epoch == epoch and self.round_height() == round_,
                 f"a {self.KIND} of another epoch or round")
        _require(self.verifies(), f"a {self.KIND} whose signature does not verify")


@dataclasses.dataclass(frozen=True)
class Commitment(SignedRecord):
    KIND = "commitment"
    round: int = 0
    start: int = 0
    end: int = 0
    loss: float = 0.0
    tokens: int = 0
    seconds: float = 0.0  # how long the trainer measured training its share: the dashboard's tokens/s
    receipts: tuple = ()  # every backward's receipt, signed by its worker (``SignedReceipt.to_value``)

    def check(self) -> None:
        super().check()
        for name in ("start", "end", "tokens"):
            _require(_is_number(getattr(self, name)), f"commitment.{name} must be a non-negative integer")
        _require(self.start <= self.end, "commitment.start must not exceed commitment.end")
        _require(isinstance(self.loss, int | float) and not isinstance(self.loss, bool) and math.isfinite(self.loss)
                 and 0 <= self.loss <= MAX_LOSS, f"commitment.loss must be a number in [0, {MAX_LOSS:g}]")
        _require(isinstance(self.seconds, int | float) and not isinstance(self.seconds, bool)
                 and math.isfinite(self.seconds) and (self.seconds == 0 or self.seconds >= MIN_SECONDS),
                 f"commitment.seconds must be 0 (not measured) or a finite number of at least {MIN_SECONDS:g}")
        self.claims()

    def claims(self) -> tuple[SignedReceipt, ...]:
        """The receipts, parsed and checked field by field (``RecordError`` on the first bad one)."""
        _require(isinstance(self.receipts, tuple) and len(self.receipts) <= MAX_RECEIPTS,
                 f"commitment.receipts must be a list of at most {MAX_RECEIPTS} receipts")
        return tuple(parse_receipt(r) for r in self.receipts)


@dataclasses.dataclass(frozen=True)
class Report(SignedRecord):
    KIND = "report"
    round: int = 0
    stage: int = 0
    uid: str = ""
    receipts: tuple = ()  # the hashes (hex) of the receipts the worker signed for the round

    def check(self) -> None:
        super().check()
        _require(_is_number(self.stage) and self.stage < 256, "report.stage must be a stage number")
        _require(_is_text(self.uid), f"report.uid must be text of 1-{MAX_TEXT} characters")
        _require(isinstance(self.receipts, tuple) and len(self.receipts) <= MAX_RECEIPTS
                 and all(is_hex(h, 32) for h in self.receipts),
                 f"report.receipts must be a list of at most {MAX_RECEIPTS} sha256 hex digests")


@dataclasses.dataclass(frozen=True)
class Presence(SignedRecord):
    KIND = "presence"
    round: int = 0


MAX_RECORD_BYTES = 48_000
"""The largest record a client publishes (its value as the DHT serializes it). A witness reads a round's records of a
kind in one DHT answer, every client's together (``fetch``), so this bounds what one client adds to what every witness
fetches: a group of eight's evidence against a reducer (30 KB, ``client.averaging.audit``) fits."""


def record_bytes(record: SignedRecord) -> int:
    """The size of ``record``'s value as the DHT serializes it."""
    from hivemind.utils.serializer import MSGPackSerializer

    return len(MSGPackSerializer.dumps(record.to_value()))


MAX_ACCUSATIONS = 16
"""The most pieces of evidence one trainer's accusation carries in a round (one per worker found wrong suffices)."""


@dataclasses.dataclass(frozen=True)
class Accusation(SignedRecord):
    KIND = "accusation"
    round: int = 0
    accusations: tuple = ()  # evidence objects, each checked by ``accusations.check_accusation``

    def check(self) -> None:
        super().check()
        _require(isinstance(self.accusations, tuple) and 0 < len(self.accusations) <= MAX_ACCUSATIONS,
                 f"accusation.accusations must be a list of 1 to {MAX_ACCUSATIONS} pieces of evidence")


@dataclasses.dataclass(frozen=True)
class Ready(SignedRecord):
    KIND = "ready"


@dataclasses.dataclass(frozen=True)
class StateDigest(SignedRecord):
    """A worker's digest of its stage's state once the swarm completed ``step`` steps, bound to the run's instance
    (``derived.run_instance``: a record of an earlier run under the same id proves nothing here) and its stage."""

    KIND = "state-digest"
    instance: str = ""
    step: int = 0
    stage: int = 0
    digest: str = ""

    def round_height(self) -> int:
        """A digest is filed, and admitted, under the step it describes where a round record names its round."""
        return self.step

    def check(self) -> None:
        super().check()
        _require(_is_text(self.instance), f"state-digest.instance must be text of 1-{MAX_TEXT} characters")
        _require(_is_number(self.stage) and self.stage < 256, "state-digest.stage must be a stage number")
        _require(is_hex(self.digest, 32), "state-digest.digest must be a sha256 hex digest")


class Board:
    """Stores and reads one run's round records in the DHT, one sealed subkey per author.

    Its keys are named for the run's instance (``derived.run_instance``), not its id alone, so a later run with the
    same id never reads an earlier one's records; ``fetch`` given the run's ``members`` keeps only their records,
    so no stranger on the DHT shows a loss or tokens in its place.

    Each kind of a round's records is spread over ``shards`` keys, one per proof part the run can have
    (``bloom.part_count`` of its ``max_clients``: one for up to 128 clients, eight at 1,024), and an author files
    under the shard its key names (``shard_of``). A DHT key is stored and served by the few peers nearest it, so
    one key holding every author's record would put a 1,024-client round's megabyte of commitments (1.07 MB in
    ``bench_scale``), read whole by each witness, on the same few peers; spread, each key holds about an eighth and a
    reader fetches the shards at once.
    The shard follows the key, not the client's index: an index moves as clients leave, a joiner has none, and a
    record must be found where it was filed. A record filed under another shard than its author's is skipped, so
    no author can show readers of different shards different records.
    """

    def __init__(self, dht, state: CoordinatorState) -> None:
        self.dht, self.run_id, self.instance = dht, state.run_id, derived.run_instance(state)
        self.shards = part_count(state.config.max_clients)

    def shard_of(self, author: str) -> int:
        """The shard an author (hex key) files under: its key's first 8 bytes, modulo the shards."""
        return int(author[:16], 16) % self.shards

    def key(self, kind: type[SignedRecord], epoch: int, round_: int | None = None, shard: int = 0) -> str:
        """The DHT key of shard ``shard`` of a run's records of ``kind`` for an epoch (and round)."""
        where = f"e{epoch}" if round_ is None else f"e{epoch}.r{round_}"
        return f"{self.instance}.{kind.KIND}.{where}.s{shard}"

    def publish(self, record: SignedRecord, keypair: Keypair) -> bool:
        """Store ``record``, signed by ``keypair``, for this run; whether the DHT accepted it. A record readers
        would not admit is refused here (``RecordError``), before it leaves this client."""
        from hivemind.utils import get_dht_time

        from client.sealed import store_sealed

        author = bytes(keypair.pubkey()).hex()
        record.admit(author, self.run_id, record.epoch, record.round_height())
        size = record_bytes(record)
        _require(size <= MAX_RECORD_BYTES, f"a {record.KIND} of {size:,} bytes is larger than the {MAX_RECORD_BYTES:,} "
                                           "a record may have")
        key = self.key(type(record), record.epoch, record.round_height(), self.shard_of(author))
        return store_sealed(self.dht, keypair, key, record.to_value(), get_dht_time() + RECORD_TTL)

    def fetch(self, kind: type[SignedRecord], epoch: int, round_: int | None = None,
              members: Collection[str] | None = None) -> dict[str, SignedRecord]:
        """Admitted records by author (hex), of ``members`` only when given, read from every shard at once;
        anything malformed, forged, misfiled or foreign is skipped."""
        from client.sealed import within_lifetime

        pending = [self.dht.get(self.key(kind, epoch, round_, shard), latest=True, return_future=True)
                   for shard in range(self.shards)]
        out: dict[str, SignedRecord] = {}
        for shard, future in enumerate(pending):
            found = future.result()
            if found is None or not isinstance(found.value, dict):
                continue
            for subkey, item in found.value.items():
                if members is not None and subkey not in members:
                    continue
                try:
                    record = kind.from_value(item.value)
                    record.admit(subkey, self.run_id, epoch, round_)
                    _require(within_lifetime(item.expiration_time), f"a {kind.KIND} stored to outlive any record")
                    _require(self.shard_of(subkey) == shard, f"a {kind.KIND} filed under another shard than "
                                                             "its author's")
                except RecordError as exc:
                    log.debug("skipping a %s under %r: %s", kind.KIND, subkey, exc)
                    continue
                out[record.author] = record
        return out


def members(state: CoordinatorState) -> set[str]:
    """The keys (hex) whose records a reader of the run counts: its clients and joiners, and every key its ledger
    credited (a trainer of an earlier epoch that has left)."""
    return {c.id.hex() for c in state.clients} | {j.id.hex() for j in state.pending} | {
        e.id.hex() for e in state.ledger}


def last_loss(board: Board, state: CoordinatorState) -> tuple[int, int, float] | None:
    """The newest round with commitments of the run's members, at or before the current one (this epoch or the
    last), and its sample-weighted mean loss."""
    authors = members(state)
    epoch, round_ = state.epoch, state.round.height
    for e in range(epoch, max(epoch - 2, -1), -1):
        for r in range(round_ if e == epoch else state.config.rounds_per_epoch - 1, -1, -1):
            found = list(board.fetch(Commitment, e, r, authors).values())
            if found:
                samples = sum(c.end - c.start for c in found)  # type: ignore[attr-defined]
                weighted = math.fsum(c.loss * ((c.end - c.start) / max(samples, 1)) for c in found)  # type: ignore
                return e, r, weighted
    return None
