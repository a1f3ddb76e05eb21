"""Checked results: a trainer asks a second replica of a stage the same question now and then, and settles a
disagreement by majority.

Same-stage replicas that average their gradients every step hold bit-identical parameters on CPU, and a question
(``client.answers``) names samples of one round only (a worker answers only inside the round it accumulates), so
every honest replica gives it the same answer, digest for digest. The trainer chooses a share ``rate`` of its
microbatches with a keyed hash of a secret only it holds (``CheckPolicy``): a worker sees a checked microbatch's
requests exactly as any other (same fields, same signature scheme), so it cannot tell which of its answers are
compared. A checked microbatch's every Forward that returns activations (head, bodies) and every Backward that
returns an input gradient or a loss (bodies, tail) also goes to a second replica, the same one for both passes (it
holds the ticket its Forward left). Answers agree when their signed digests are equal, or, where the run sets a
``tolerance`` (non-deterministic kernels, such as bf16 on GPUs), when each value lies within it of the other's.

**Settling a disagreement** (``settle``). The question goes to a third replica if the stage has one. Answers that
agree form groups; a group of two or more is the stage's answer, and every replica outside it is *found wrong*:
the trainer continues the microbatch with the majority's answer, bans the wrong one for good (``StageRouter.exclude``)
and keeps a ``Verdict`` whose evidence anyone can check, the signed answers side by side
(``client.witness.accusations``); the contributor publishes it as an accusation, and the round's witnesses then
leave the accused out of their proofs, so it earns nothing and the coordinator's health check removes it. With
two replicas, or three answers all different, there is no majority: the disagreement is recorded (and logged),
nobody is punished, and the microbatch continues with the first answer, as it would unchecked. The trainer's own
recomputation is not a tiebreak, since a trainer holds no parameters.

**The chance of catching a liar.** A worker that falsifies a share ``f`` of its answers, each chosen
independently of the (secret) checks, gives ``n`` answers a round that a check can compare; each is compared with
probability at least ``c`` (the check rate), so each is caught with probability at least ``c·f``, independently,
and within ``R`` rounds it is caught with probability

    P(caught within R rounds) = 1 − (1 − c·f)^(n·R)     (``catch_probability``)

and found wrong when the stage has a third honest replica. Since ``(1 − c·f)^(nR) ≈ exp(−c·f·n·R)``, catching with
probability ``p`` needs about ``n·R ≥ −ln(1 − p) / (c·f)`` answers: at ``c = 5%`` and ``f = 1%``, 99% needs 9,210
answers (921 a round over 10 rounds); ``rate_needed`` gives ``c`` for a target. The figure is a lower bound: a
worker's answers to a checked microbatch's second request are compared too.

The cost is about ``c`` more compute and bytes per step: each checked request runs once more (plus a third time
on a disagreement). A checked microbatch's gradient is accumulated by both replicas, so it weighs twice in its
stage's step: a share ``c`` of samples counted twice.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from client.answers import META_ANSWER, META_SIGNATURE, SignedAnswer, answer_digest, question_digest
from client.pipeline.discovery import WorkerRecord
from client.pipeline.messages import WireTensor, tensor_digest
from client.pipeline.router import StageRouter
from client.pipeline.wire import from_wire

log = logging.getLogger(__name__)

DEFAULT_CHECK_RATE = 0.05
SIGNED = "answer"
"""The key under which the trainer keeps a response's checked ``SignedAnswer`` in its metadata (no wire field)."""


def catch_probability(f: float, c: float, answers_per_round: int, rounds: int) -> float:
    """The chance that a worker falsifying a share ``f`` of its answers is caught within ``rounds`` rounds at check
    rate ``c``, giving ``answers_per_round`` checkable answers a round: 1 − (1 − c·f)^(n·R)."""
    return 1.0 - (1.0 - c * f) ** (answers_per_round * rounds)


def rate_needed(f: float, answers_per_round: int, rounds: int, p: float) -> float:
    """The check rate that catches a liar falsifying a share ``f`` with probability ``p`` within ``rounds``."""
    return (1.0 - (1.0 - p) ** (1.0 / (answers_per_round * rounds))) / f


@dataclass(frozen=True)
class CheckPolicy:
    """Which microbatches are checked (``rate``, 0 to 1), chosen with a secret only this trainer knows, and how
    close two answers must be (``tolerance`` 0: identical digests)."""

    rate: float = DEFAULT_CHECK_RATE
    tolerance: float = 0.0
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"check rate {self.rate} must lie in [0, 1] (0.05 checks one microbatch in 20)")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"check tolerance {self.tolerance} must be a finite number ≥ 0 (0: identical answers)")

    def chosen(self, microbatch_id: str) -> bool:
        """Whether ``microbatch_id`` is checked: a keyed hash below the rate, unpredictable without the secret."""
        mac = hmac.new(self.secret, microbatch_id.encode(), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") < self.rate * 2.0**64


def signed_answer(question_fields: Mapping[str, Any], record: WorkerRecord, meta: Mapping[str, object],
                  out: Mapping[str, WireTensor]) -> SignedAnswer:
    """The answer ``record``'s worker signed for this response, checked against what it returned; ``ValueError``
    saying why when it is missing, names another answer or is not its worker's signature."""
    loss = meta.get("loss")
    digest = answer_digest({name: tensor_digest(t) for name, t in out.items()}, loss if isinstance(loss, float)
                           else None)
    signed = SignedAnswer(record.pubkey, question_digest(question_fields), str(meta.get(META_ANSWER)),
                          str(meta.get(META_SIGNATURE)))
    if signed.answer != digest:
        raise ValueError("the signed answer digest does not match the answer returned")
    if not signed.verifies():
        raise ValueError("the answer is not signed by the worker's key")
    return signed


@dataclass(frozen=True, eq=False)
class Reply:
    """One replica's answer to a checked question: who, what it returned, and its signature over it."""

    record: WorkerRecord
    meta: dict[str, object]
    out: dict[str, WireTensor]

    @property
    def signed(self) -> SignedAnswer:
        value = self.meta[SIGNED]
        assert isinstance(value, SignedAnswer)
        return value


def agree(a: Reply, b: Reply, tolerance: float) -> bool:
    """Identical signed digests; or, with a ``tolerance``, every value (loss, tensors) within it of the other's
    (``torch.allclose`` with that relative and absolute tolerance)."""
    if a.signed.answer == b.signed.answer:
        return True
    if tolerance == 0 or set(a.out) != set(b.out) or (a.meta.get("loss") is None) != (b.meta.get("loss") is None):
        return False
    loss_a, loss_b = a.meta.get("loss"), b.meta.get("loss")
    if isinstance(loss_a, float) and isinstance(loss_b, float) and not math.isclose(
            loss_a, loss_b, rel_tol=tolerance, abs_tol=tolerance):
        return False
    return all(torch.allclose(from_wire(a.out[n]).float(), from_wire(b.out[n]).float(), rtol=tolerance,
                              atol=tolerance) for n in a.out)


@dataclass(frozen=True)
class Verdict:
    """A disagreement among a stage's replicas over one question, and who, if anyone, was found wrong."""

    stage: str
    kind: str
    microbatch_id: str
    answers: tuple[SignedAnswer, ...]
    wrong: tuple[str, ...]  # public keys (hex) of the replicas outside the majority; empty without a majority

    def accusations(self) -> list[dict[str, object]]:
        """The evidence against each replica found wrong, as ``client.witness.accusations`` checks it."""
        return [{"stage": self.stage, "kind": self.kind, "microbatch": self.microbatch_id, "accused": key,
                 "answers": [a.to_value() for a in self.answers]} for key in self.wrong]


def settle(replies: list[Reply], tolerance: float) -> tuple[Reply | None, list[Reply]]:
    """(a reply of the majority, the replies outside it): the largest group of agreeing replies if it holds two or
    more and no other group is as large; else (None, [])."""
    groups: list[list[Reply]] = []
    for reply in replies:
        home = next((g for g in groups if agree(g[0], reply, tolerance)), None)
        if home is None:
            groups.append([reply])
        else:
            home.append(reply)
    groups.sort(key=len, reverse=True)
    if len(groups[0]) < 2 or (len(groups) > 1 and len(groups[1]) == len(groups[0])):
        return None, []
    return groups[0][0], [r for g in groups[1:] for r in g]


Exchange = Callable[[WorkerRecord, bool], tuple[dict[str, object], dict[str, WireTensor]]]
"""The trainer's call at hand put to another replica: ``(record, backward)`` → its checked answer (metadata with the
signed answer under ``SIGNED``, tensors) to the microbatch's Forward (False) or Backward (True); raises on any
failure."""


class Checker:
    """A trainer's checks: which microbatches, asking the second and third replica, and the verdicts; thread-safe."""

    def __init__(self, policy: CheckPolicy, routers: Mapping[str, StageRouter]) -> None:
        self.policy = policy
        self.routers = routers
        self.checked = 0  # questions compared with a second replica
        self._verdicts: list[Verdict] = []
        self._lock = threading.Lock()

    def chosen(self, microbatch_id: str) -> bool:
        return self.policy.rate > 0 and self.policy.chosen(microbatch_id)

    def drain(self) -> list[Verdict]:
        """The verdicts reached since the last call, oldest first."""
        with self._lock:
            verdicts, self._verdicts = self._verdicts, []
        return verdicts

    def check(self, stage: str, microbatch_id: str, backward: bool, first: Reply, partner: WorkerRecord | None,
              exchange: Exchange, costs: Mapping[bool, float], *, then_backward: bool,
              forward_first: bool) -> tuple[Reply, WorkerRecord | None]:
        """Compare ``first`` with a second replica's answer, settling a disagreement; return the reply to continue
        with and the replica to ask the same microbatch's Backward (it ran the Forward; None: no check then).

        ``partner`` is the replica that ran this microbatch's checked Forward (for its Backward); without one, the
        router picks one other than ``first``'s, charged this pass (and the Backward ``then_backward`` will ask).
        A settling third replica runs the Forward first where ``forward_first`` (a head or body Backward)."""
        router = self.routers[stage]
        if partner is not None:
            charge = 0.0  # its Forward's choice was charged with this Backward too
            second_record = router.claim(partner)
        else:
            charge = costs[backward] + (costs[True] if then_backward else 0.0)
            second_record = router.choose(charge, exclude={first.record.uid})
        if second_record is None or second_record.uid == first.record.uid:
            if second_record is not None:
                router.release(second_record.uid, charge)
            return first, None
        second = self._ask(stage, second_record, exchange, backward, costs, charge, forward_first=False)
        if second is None:
            return first, None
        with self._lock:
            self.checked += 1
        if agree(first, second, self.policy.tolerance):
            return first, second.record if then_backward else None
        replies = [first, second]
        extra = costs[backward] + (costs[False] if forward_first else 0.0)
        asked = {first.record.uid, second.record.uid}
        third_record = router.choose(extra, exclude=asked)
        if third_record is not None and third_record.uid not in asked:
            third = self._ask(stage, third_record, exchange, backward, costs, extra, forward_first=forward_first)
            if third is not None:
                replies.append(third)
        elif third_record is not None:
            router.release(third_record.uid, extra)
        return self._settled(stage, microbatch_id, backward, replies, then_backward)

    def _ask(self, stage: str, record: WorkerRecord, exchange: Exchange, backward: bool, costs: Mapping[bool, float],
             charge: float, *, forward_first: bool) -> Reply | None:
        """``record``'s reply, after the microbatch's Forward where ``forward_first``; None, with what is left of
        ``charge`` released, when a call fails: a check that cannot be made is skipped, never a reason to fail the
        microbatch (the worker's fault, if it is one, was handled by the trainer's exchange)."""
        owed = charge
        try:
            if forward_first:
                exchange(record, False)
                owed -= costs[False]
            meta, out = exchange(record, backward)
        except Exception as exc:  # noqa: BLE001 - a call that fails in any way only means no check is made
            self.routers[stage].release(record.uid, owed)
            log.info("check of %s on %s not made: %s", stage, record.uid, exc)
            return None
        return Reply(record, meta, out)

    def _settled(self, stage: str, microbatch_id: str, backward: bool, replies: list[Reply],
                 then_backward: bool) -> tuple[Reply, WorkerRecord | None]:
        winner, wrong = settle(replies, self.policy.tolerance)
        verdict = Verdict(stage, "backward" if backward else "forward", microbatch_id,
                          tuple(r.signed for r in replies), tuple(r.signed.worker for r in wrong))
        with self._lock:
            self._verdicts.append(verdict)
        if winner is None:
            log.warning("replicas of %s disagree on the %s of %s and no majority settles it (%s): recorded, nobody "
                        "punished", stage, verdict.kind, microbatch_id, ", ".join(r.record.uid for r in replies))
            return replies[0], None
        for reply in wrong:
            log.warning("worker %s of %s answered the %s of %s unlike the stage's majority: excluded and accused",
                        reply.record.uid, stage, verdict.kind, microbatch_id)
            self.routers[stage].exclude(reply.record.uid)
        partners = [r.record for r in replies if r not in wrong and r is not winner]
        return winner, (partners[0] if then_backward and partners else None)
