"""Weights that follow work: a gradient round's weight is the samples a trainer signed for, never a claim.

A worker's gradient for a step is the sum of the Backwards it accumulated, and each of them arrived as a request
signed by a trainer over the run, the stage, the kind, the worker it was sent to (that worker's public key), the
microbatch, the samples it covers, the issue time and its tensors' digests
(``client.pipeline.admission.RequestHeader``), which the worker verified, naming itself, before computing
anything. So the worker's declaration carries those headers and signatures (``evidence``: the fields that
differ between them; the run, stage and kind are the round's own and the worker is the declarer), and each
groupmate credits it with the distinct samples they prove (``proven_samples``):

- the evidence is a list of at most ``round_samples`` entries (each Backward covers at least one sample of
  the round, and an honest worker never differentiates a sample twice in a step), each of the exact form a
  request's header has: anything else drops the groupmate before a signature is checked, so a flood costs
  the others nothing but reading it;
- every signature must hold over the header rebuilt with the round's run, stage, kind "backward" and the
  declarer's own key as the worker: a forged header, one signed for another run, stage or a Forward, or one
  signed for another worker (copied from a groupmate's declaration, which every groupmate sees gathered) drops
  the groupmate like any malformed declaration. An honest worker keeps only headers it verified itself and
  that named itself (``StageCompute.parse`` refuses any other request), so a header that does not hold for its
  declarer is a lie, whoever signed it; a copier is dropped rather than merely not credited, so that copying
  costs it the round, as forging does;
- a header signed by a key that is not a trainer of the current epoch, or for samples outside the round's
  window ``[r·n, (r+1)·n)`` (n = the round's global batch: a header of another round, replayed), proves
  nothing and is not counted, without dropping anyone: an honest worker can hold one from a Backward that
  ran while its step was taken, or from a trainer the epoch just dropped.

A sample several groupmates prove credits each of them in full. Overlap is now honest by construction: each
header names its worker, so two groupmates prove the same sample only where a trainer sent it to both and both
differentiated it (a checked microbatch's Backward runs on two replicas, ``client.pipeline.checks``; a trainer
retries a microbatch on a second worker after the first went silent), and each then holds it in its gradient
sum. Crediting each with the samples its sum holds weights each replica's mean as the pooled mean of every
accumulated Backward needs, so an honest group's weights are exactly its declared ones. (Until headers named
their worker, a sample k groupmates proved credited each 1/k, so that a groupmate copying another's headers
took half their credit rather than all of it; that sharing would now only let overlap lower an honest worker's
weight, e.g. a trainer colluding with a worker signing, for its accomplice, the samples an honest worker did.)
The group's credits may then total more than its distinct samples, by the checked duplicates; no single
groupmate's exceeds the round's batch (``max_weight``), and the robust reduction caps each at the middle one.

The weight used is min(declared, credited samples): a worker may claim less than it did (a syncing worker
claims 0 and sends no evidence), never more. Every groupmate computes this from the same gathered
declarations, so all of them hold the same weights, and a reducer refuses any part sent with another.

What this does not stop: a trainer of the epoch signing Backwards for samples it never sent (a colluding
trainer and worker), or for samples outside its own share of the round (workers refuse those, groupmates do
not check shares); that is the trainers' accountability (receipts, witnesses), not the averaging's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client.identity import is_hex
from client.pipeline.admission import RequestHeader, signed_by_trainer
from client.pipeline.compute import MAX_ID_CHARS
from client.pipeline.messages import MAX_NAME_BYTES, MAX_TENSORS

_FIELDS = 8  # trainer, microbatch, sample_start, sample_end, dtype, issued_at, digests, signature


@dataclass(frozen=True)
class WorkRule:
    """How a stage's gradient rounds credit work: the run and stage every header must name, and the samples of
    each round (round r accumulates the global batch ``[r·round_samples, (r+1)·round_samples)``)."""

    run_id: str
    stage: str
    round_samples: int

    def __post_init__(self) -> None:
        if self.round_samples < 1:
            raise ValueError(f"round_samples must be at least 1, got {self.round_samples}")

    def window(self, round_: int) -> tuple[int, int]:
        return round_ * self.round_samples, (round_ + 1) * self.round_samples


def evidence(work: Sequence[tuple[RequestHeader, str]]) -> list[list[Any]]:
    """The declaration's form of a step's signed Backward headers (``StageCompute.work``)."""
    return [[h.trainer, h.microbatch_id, h.sample_start, h.sample_end, h.dtype, h.issued_at, dict(h.digests),
             signature] for h, signature in work]


def _text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and value.isprintable()


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _digests(value: object) -> bool:
    return isinstance(value, dict) and len(value) <= MAX_TENSORS and all(
        isinstance(name, str) and name.isascii() and 0 < len(name) <= MAX_NAME_BYTES and is_hex(digest, 32)
        for name, digest in value.items())


def _header(entry: object, rule: WorkRule, worker: str) -> tuple[RequestHeader, str] | str:
    """One evidence entry of ``worker`` (its public key, hex) as the header it stands for and its signature, or
    what is wrong with its form."""
    if not isinstance(entry, list | tuple) or len(entry) != _FIELDS:
        return f"is not a list of {_FIELDS} fields"
    trainer, microbatch, start, end, dtype, issued, digests, signature = entry
    if not (is_hex(trainer, 32) and is_hex(signature, 64)):
        return "has no trainer key or signature in hex"
    if not (_text(microbatch) and _text(dtype) and _count(start) and _count(end) and _count(issued)):
        return "has a malformed microbatch, dtype, sample or time"
    if not _digests(digests):
        return "has malformed tensor digests"
    header = RequestHeader(run_id=rule.run_id, stage=rule.stage, kind="backward", trainer=trainer, worker=worker,
                           microbatch_id=microbatch, sample_start=start, sample_end=end, dtype=dtype,
                           issued_at=issued, digests=dict(digests))
    return header, signature


def proven_samples(work: object, rule: WorkRule, round_: int, trainers: frozenset[bytes],
                   worker: bytes) -> frozenset[int] | str:
    """The samples of round ``round_`` that the evidence ``work`` of the groupmate whose key is ``worker`` proves
    it differentiated, signed by one of ``trainers``; or why the evidence drops it (module docstring)."""
    if not isinstance(work, list | tuple):
        return "its evidence of work is not a list"
    if len(work) > rule.round_samples:
        return f"its evidence lists {len(work)} Backwards, more than the round's {rule.round_samples} samples"
    headers = []
    for index, entry in enumerate(work):
        parsed = _header(entry, rule, worker.hex())
        if isinstance(parsed, str):
            return f"its evidence's Backward {index} {parsed}"
        headers.append(parsed)
    first, last = rule.window(round_)
    samples: set[int] = set()
    for index, (header, signature) in enumerate(headers):
        if not signed_by_trainer(header, signature):
            return (f"its evidence's Backward {index} is not signed by its trainer for run {rule.run_id!r}, stage "
                    f"{rule.stage!r} and this worker (forged, copied from another worker, or signed for another "
                    "run, stage or kind)")
        if header.pubkey in trainers and first <= header.sample_start < header.sample_end <= last:
            samples.update(range(header.sample_start, header.sample_end))
    return frozenset(samples)


def credited(declared: float, samples: frozenset[int] | None) -> float:
    """The weight a groupmate averages with: what it declared, at most the samples its evidence proves (None: no
    rule, the declared weight as it is)."""
    return declared if samples is None else min(declared, float(len(samples)))
