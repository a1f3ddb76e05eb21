"""Workers' signed answers: a worker signs the digest of every answer it gives, so that an answer can be held
against it.

Same-stage replicas that average their gradients every step hold bit-identical parameters, so they give
bit-identical answers to the same question. A trainer that asks two or three of them (``client.pipeline.checks``)
can therefore show that one answered wrong, to anyone: the accused's own signature over its answer, beside the
signatures of the replicas that agree on another answer to the very same question. This module is that
evidence's vocabulary, kept free of torch and of the pipeline so that witnesses (``client.witness``) check it
without running a model.

- The *question* is what the trainer signed for one Forward or Backward, less its time of issue and the worker
  it was sent to (two replicas are asked at different times, each in a request naming itself): run, stage, kind,
  trainer, microbatch, samples, wire codec and the digests of the tensors sent (``question_digest``). Who
  answered is the answer's signer.
- The *answer* is the digest of what came back: each returned tensor's wire-form digest and the loss, if any
  (``answer_digest``).
- The worker signs both with its identity key (``sign``), one ed25519 signature per answer (tens of
  microseconds), under a domain tag no other signed message of psyswarm uses.

May import: client.identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from solders.keypair import Keypair

from client.identity import canonical, is_hex, verify

DOMAIN = "psyswarm/stage-answer/v1"


def question_digest(header_fields: Mapping[str, Any]) -> str:
    """sha256 (hex) of a signed request's fields without ``issued_at`` and ``worker``: the same for every replica
    asked."""
    fields = {k: v for k, v in header_fields.items() if k not in ("issued_at", "worker")}
    return hashlib.sha256(canonical(fields)).hexdigest()


def answer_digest(tensor_digests: Mapping[str, str], loss: float | None) -> str:
    """sha256 (hex) of an answer: its tensors' wire-form digests by name, and its loss (exact: JSON keeps a float's
    repr)."""
    return hashlib.sha256(canonical({"tensors": dict(tensor_digests), "loss": loss})).hexdigest()


@dataclasses.dataclass(frozen=True)
class SignedAnswer:
    """``worker`` (hex public key) answered ``question`` with ``answer``; ``signature`` (hex) is its signature over
    both."""

    worker: str
    question: str
    answer: str
    signature: str

    @staticmethod
    def message(question: str, answer: str) -> bytes:
        return canonical({"domain": DOMAIN, "question": question, "answer": answer})

    def well_formed(self) -> bool:
        return (is_hex(self.worker, 32) and is_hex(self.question, 32) and is_hex(self.answer, 32)
                and is_hex(self.signature, 64))

    def verifies(self) -> bool:
        """Well formed and signed by ``worker``; anything malformed is simply false."""
        return self.well_formed() and verify(bytes.fromhex(self.worker), self.message(self.question, self.answer),
                                             bytes.fromhex(self.signature))

    def to_value(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_value(cls, value: object) -> SignedAnswer | None:
        """Parse a JSON object with exactly this class's fields as strings; ``None`` for anything else."""
        names = {f.name for f in dataclasses.fields(cls)}
        if not (isinstance(value, dict) and set(value) == names and all(isinstance(v, str) for v in value.values())):
            return None
        answer = cls(**value)
        return answer if answer.well_formed() else None


def sign(keypair: Keypair, question: str, answer: str) -> SignedAnswer:
    """``keypair``'s signed answer ``answer`` to ``question``."""
    signature = bytes(keypair.sign_message(SignedAnswer.message(question, answer))).hex()
    return SignedAnswer(bytes(keypair.pubkey()).hex(), question, answer, signature)


META_ANSWER = "answer.digest"
META_SIGNATURE = "answer.signature"
"""The response metadata fields that carry a worker's signed answer (its key is the one the trainer routed to)."""
