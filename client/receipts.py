"""A worker's receipt for one Backward, signed: what it returns with each answer, what the trainer files in its
commitment, and what the witnesses verify.

A receipt says which trainer asked (its public key, as authenticated by the request's signature), for which
microbatch and samples, on which data (the digests of the tensors exchanged). The worker signs it with its own
ed25519 key, the one the coordinator lists, over the receipt and the round it belongs to (the run's instance, the
epoch and the round): so the trainer holds proof of the work that the worker cannot take back by leaving it out of
its own report, nobody but the worker can make one, and one signed for another run or round proves nothing here.
Its cost is its samples, ``[sample_start, sample_end)``: the unit the coordinator pays compute points in.

One ed25519 signature per Backward (solders, as every other record here) costs tens of microseconds against the
milliseconds to seconds of the Backward it stands for.

May import: client.identity.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

from solders.keypair import Keypair

from client.identity import canonical, verify

DOMAIN = "psyswarm/receipt/v1"
"""The tag under which a receipt is signed, so that no other signed message of psyswarm reads as one."""


@dataclasses.dataclass(frozen=True)
class Receipt:
    """What a worker did for one Backward: which trainer asked, for which microbatch and samples, on which data.

    Digests are sha256 of the tensors' wire form (``client.pipeline.messages.tensor_digest``), so the trainer
    computes the same values from what it sent and received. The head returns no gradient and the tail receives
    none (empty digests).
    """

    trainer_id: str  # the trainer's public key (hex)
    microbatch_id: str
    stage: str
    worker_uid: str
    sample_start: int  # the microbatch covers global sample indices [sample_start, sample_end)
    sample_end: int
    input_digest: str
    grad_output_digest: str  # "" where the stage receives no gradient (the tail)
    grad_input_digest: str  # "" where the stage returns none (the head)


@dataclasses.dataclass(frozen=True)
class ReceiptRound:
    """The round a receipt belongs to: the run's instance (``derived.run_instance``), its epoch and round."""

    run: str
    epoch: int
    round: int


@dataclasses.dataclass(frozen=True)
class SignedReceipt(Receipt):
    """A ``Receipt`` with its round, signed by ``worker`` (hex public key): ``signature`` (hex) covers the rest."""

    run: str = ""
    epoch: int = 0
    round: int = 0
    worker: str = ""
    signature: str = ""

    @classmethod
    def sign(cls, keypair: Keypair, receipt: Receipt, round_: ReceiptRound) -> SignedReceipt:
        unsigned = cls(**dataclasses.asdict(receipt), **dataclasses.asdict(round_),
                       worker=bytes(keypair.pubkey()).hex())
        return dataclasses.replace(unsigned, signature=bytes(keypair.sign_message(unsigned.message)).hex())

    @functools.cached_property
    def message(self) -> bytes:
        """The canonical bytes signed: every field but the signature, as JSON with sorted keys, under ``DOMAIN``
        (kept once computed: a witness hashes and verifies each receipt)."""
        fields = {name: getattr(self, name) for name in FIELDS if name != "signature"}
        return canonical({"domain": DOMAIN, **fields})

    def hash(self) -> str:
        """What the worker's report lists for it: the sha256 (hex) of the signed message."""
        return hashlib.sha256(self.message).hexdigest()

    def verifies(self) -> bool:
        """Whether ``worker`` signed exactly this receipt (malformed keys or signatures simply do not verify)."""
        try:
            return verify(bytes.fromhex(self.worker), self.message, bytes.fromhex(self.signature))
        except (ValueError, TypeError):
            return False

    @property
    def work(self) -> Receipt:
        """The receipt without its round and signature."""
        return Receipt(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Receipt)})

    @property
    def belongs_to(self) -> ReceiptRound:
        return ReceiptRound(self.run, self.epoch, self.round)

    def to_value(self) -> dict[str, Any]:
        """The JSON object a trainer files in its commitment, and a worker's answer carries as metadata."""
        return dataclasses.asdict(self)


FIELDS = tuple(f.name for f in dataclasses.fields(SignedReceipt))
"""The fields of a signed receipt, in the order its JSON object holds them."""
