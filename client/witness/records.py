"""Signed round records that clients publish in the DHT, and the board that stores and reads them.

- ``Commitment``: a trainer's result for its share of a round (its sample range, its mean loss, and the
  hash of every stage receipt the workers gave it). Its hash is the key of a witness's batch filter.
- ``Report``: a worker's list of receipt hashes for the backward passes it ran in a round; it is also the
  worker's proof of presence.
- ``Ready``: a client's statement that it has loaded the model for an epoch (warmup witnesses read it).

Every record is signed by its author's ed25519 key over its canonical JSON; a record whose signature does
not verify, or that sits under another author's subkey, is ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, ClassVar

from solders.keypair import Keypair

from client.identity import verify

log = logging.getLogger("psyswarm.records")

RECORD_TTL = 3600.0
"""How long a record lives in the DHT: long enough for a slow epoch, short enough not to pile up."""


@dataclasses.dataclass(frozen=True)
class SignedRecord:
    """Fields plus ``author`` (hex public key) and ``signature`` (hex) over the other fields."""

    KIND: ClassVar[str]
    author: str
    signature: str

    def signed_bytes(self) -> bytes:
        fields = dataclasses.asdict(self)
        del fields["signature"]
        return json.dumps({"kind": self.KIND, **fields}, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> bytes:
        return hashlib.sha256(self.signed_bytes()).digest()

    def verifies(self) -> bool:
        try:
            return verify(bytes.fromhex(self.author), self.signed_bytes(), bytes.fromhex(self.signature))
        except ValueError:
            return False

    @classmethod
    def create(cls, keypair: Keypair, **fields: Any):
        unsigned = cls(author=bytes(keypair.pubkey()).hex(), signature="", **fields)
        return dataclasses.replace(unsigned, signature=bytes(keypair.sign_message(unsigned.signed_bytes())).hex())

    def to_value(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_value(cls, value: object):
        """Parse a DHT value; ``ValueError`` for anything that is not exactly a record of this kind."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(value, dict) or set(value) != names:
            raise ValueError(f"not a {cls.__name__}")
        fields = {}
        for f in dataclasses.fields(cls):
            item = value[f.name]
            if f.type in ("str", str) and not isinstance(item, str):
                raise ValueError(f"{cls.__name__}.{f.name} must be a string")
            if f.type in ("int", int) and (isinstance(item, bool) or not isinstance(item, int)):
                raise ValueError(f"{cls.__name__}.{f.name} must be an integer")
            if f.type in ("float", float) and (isinstance(item, bool) or not isinstance(item, (int, float))):
                raise ValueError(f"{cls.__name__}.{f.name} must be a number")
            fields[f.name] = _freeze(item) if isinstance(item, list) else item
        return cls(**fields)


def _freeze(items: list) -> tuple:
    return tuple(tuple(i) if isinstance(i, list) else i for i in items)


@dataclasses.dataclass(frozen=True)
class Commitment(SignedRecord):
    KIND = "commitment"
    epoch: int = 0
    round: int = 0
    start: int = 0
    end: int = 0
    loss: float = 0.0
    tokens: int = 0
    receipts: tuple = ()  # (stage name, worker uid, receipt hash hex) for every backward of the batch


@dataclasses.dataclass(frozen=True)
class Report(SignedRecord):
    KIND = "report"
    epoch: int = 0
    round: int = 0
    stage: int = 0
    uid: str = ""
    receipts: tuple = ()  # receipt hashes (hex)


@dataclasses.dataclass(frozen=True)
class Ready(SignedRecord):
    KIND = "ready"
    epoch: int = 0


def receipt_hash(receipt_bytes: bytes) -> str:
    return hashlib.sha256(receipt_bytes).hexdigest()


class Board:
    """Stores and reads one run's round records in the DHT, one subkey per author."""

    def __init__(self, dht, run_id: str) -> None:
        self.dht, self.run_id = dht, run_id

    def _key(self, kind: type[SignedRecord], epoch: int, round_: int | None) -> str:
        where = f"e{epoch}" if round_ is None else f"e{epoch}.r{round_}"
        return f"{self.run_id}.{kind.KIND}.{where}"

    def publish(self, record: SignedRecord, round_: int | None = None) -> bool:
        from hivemind.utils import get_dht_time

        key = self._key(type(record), record.epoch, round_)  # type: ignore[attr-defined]
        return bool(self.dht.store(key, record.to_value(), get_dht_time() + RECORD_TTL, subkey=record.author))

    def fetch(self, kind: type[SignedRecord], epoch: int, round_: int | None = None) -> dict[str, SignedRecord]:
        """Verified records by author (hex); forged, malformed or misfiled ones are skipped."""
        found = self.dht.get(self._key(kind, epoch, round_), latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        out: dict[str, SignedRecord] = {}
        for subkey, item in found.value.items():
            try:
                record = kind.from_value(item.value)
            except (ValueError, TypeError) as exc:
                log.debug("skipping a malformed %s: %s", kind.KIND, exc)
                continue
            if subkey != record.author or not record.verifies() or record.epoch != epoch:  # type: ignore[attr-defined]
                log.debug("skipping a %s that does not verify", kind.KIND)
                continue
            if round_ is not None and record.round != round_:  # type: ignore[attr-defined]
                continue
            out[record.author] = record
        return out


def last_loss(board: Board, epoch: int, round_: int, rounds_per_epoch: int) -> tuple[int, int, float] | None:
    """The newest round with commitments, at or before (epoch, round), and its sample-weighted mean loss."""
    for e in range(epoch, max(epoch - 2, -1), -1):
        for r in range(round_ if e == epoch else rounds_per_epoch - 1, -1, -1):
            found = list(board.fetch(Commitment, e, r).values())
            if found:
                samples = sum(c.end - c.start for c in found)  # type: ignore[attr-defined]
                return e, r, sum(c.loss * (c.end - c.start) for c in found) / max(samples, 1)  # type: ignore
    return None
