"""Data accusations: signed evidence that a trainer sent tokens other than the run's dataset, and what a witness does
with a trainer it proves.

A head or tail worker that refuses a request for its tokens (``client.pipeline.datacheck``) keeps the trainer's
signed request header; it publishes it in a ``DataAccusation``, one record per author and round, each piece of evidence
the quoted header and the trainer's signature. The record's author vouches for nothing: a witness checks every piece
itself, against the run's dataset (a check this package leaves to its caller, who can open the dataset), so an
accusation against an honest trainer proves nothing, whoever files it.

A trainer proven so (``convict``) is a liar like one that signed a false commitment: it is neither present nor
credited in the witness's proof, whatever else it published, so it earns nothing for the round and a quorum of
proofs leaves it out, which is what the coordinator's health check removes a client for (``rules.health_check``).
Its missing share no longer holds the witness back from sending its proof early: that share will not come.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from client.identity import is_hex
from client.witness.judge import Evidence
from client.witness.records import SignedRecord, _require

MAX_EVIDENCE = 16
"""The most pieces of evidence one accusation holds (one per trainer is enough to prove each)."""
MAX_REQUEST_CHARS = 4096
"""The longest signed request header a piece of evidence may quote."""
CONVICTED = "sent tokens that are not the run's dataset (its own signed request proves it): not present, not credited"


@dataclasses.dataclass(frozen=True)
class DataAccusation(SignedRecord):
    KIND = "data-accusation"
    round: int = 0
    evidence: tuple = ()  # {"request": the signed header's canonical JSON, "signature": the trainer's, hex}

    def check(self) -> None:
        super().check()
        _require(isinstance(self.evidence, tuple) and 0 < len(self.evidence) <= MAX_EVIDENCE,
                 f"accusation.evidence must list 1-{MAX_EVIDENCE} pieces")
        for piece in self.evidence:
            _require(isinstance(piece, dict) and set(piece) == {"request", "signature"},
                     "each piece of accusation.evidence must have exactly the fields request and signature")
            _require(isinstance(piece["request"], str) and 0 < len(piece["request"]) <= MAX_REQUEST_CHARS,
                     f"accusation.evidence request must be text of 1-{MAX_REQUEST_CHARS} characters")
            _require(is_hex(piece["signature"], 64), "accusation.evidence signature must be 128 hex characters")

    def pieces(self) -> list[tuple[str, str]]:
        """The (request, signature) pairs quoted."""
        return [(piece["request"], piece["signature"]) for piece in self.evidence]


def convict(evidence: Evidence, convicted: Collection[bytes], why: str = CONVICTED) -> None:
    """Take the trainers ``convicted`` (proven to have sent other data, or idle: ``idle``) out of a witness's
    ``evidence``, saying ``why``: not present, not credited, and not waited for."""
    for trainer in convicted:
        evidence.participants.discard(trainer)
        evidence.computed.discard(trainer)
        evidence.commitments.pop(trainer, None)
        evidence.losses.pop(trainer, None)
        if trainer in evidence.missing:
            evidence.missing.remove(trainer)
        evidence.why_missing[trainer] = why

