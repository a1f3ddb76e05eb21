"""Checked results over real gRPC workers and real torch stages: a worker that falsifies a share of its answers is
caught, found wrong by the stage's majority, excluded and accused with evidence that verifies; honest replicas
are never accused; two replicas without a third record a disagreement and punish nobody."""

from __future__ import annotations

import random

import torch
from torch import nn

from client.answers import SignedAnswer
from client.pipeline.checks import CheckPolicy, catch_probability, rate_needed
from client.pipeline.worker import StageWorker
from client.witness.accusations import AccusationError, check_accusation

from .conftest import TINY
from .test_pipeline import wait_for_stages


class _Falsified(nn.Module):
    """A stage module whose outputs (and so input gradients) are scaled by 1.01 in a share ``f`` of its calls: well
    formed, finite, wrong."""

    def __init__(self, inner: nn.Module, f: float, seed: int) -> None:
        super().__init__()
        self.inner, self.f, self.rng = inner, f, random.Random(seed)
        self.is_head, self.is_tail = inner.is_head, inner.is_tail
        self.falsified = 0

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = self.inner(x, targets)
        if self.rng.random() < self.f:
            self.falsified += 1
            return out * 1.01
        return out


def hostile(worker: StageWorker, f: float, seed: int = 0) -> _Falsified:
    """Make ``worker`` falsify a share ``f`` of its answers (it signs them as its own, as a liar must: a trainer
    refuses unsigned answers)."""
    module = _Falsified(worker.compute.module, f, seed)
    worker.compute.module = module  # type: ignore[assignment]
    return module


def train_checked(directory, dataset, run_id: str, samples: int):
    """Train ``samples`` samples in microbatches of 4 with every microbatch checked; (result, trainer)."""
    from client.pipeline.trainer import PipelineTrainer

    trainer = PipelineTrainer(TINY, dataset, directory, run_id=run_id, refresh_period=0.5, stall_timeout=30.0,
                              checks=CheckPolicy(rate=1.0))
    try:
        return trainer.train(list(range(samples)), microbatch_size=4), trainer
    finally:
        trainer.close()


def stage_of(workers: list[StageWorker]) -> dict[str, str]:
    return {w.pubkey.hex(): w.stage for w in workers}


def test_a_falsifying_worker_is_caught_excluded_and_accused(start_worker, directory, dataset, run_id) -> None:
    workers = [start_worker("head"), *(start_worker("body1") for _ in range(3)), start_worker("tail")]
    liar = workers[2]
    module = hostile(liar, f=0.5)
    wait_for_stages(directory, {"head": 1, "body1": 3, "tail": 1})
    result, trainer = train_checked(directory, dataset, run_id, 48)
    assert module.falsified > 0
    assert len(result.microbatches) == 12
    verdicts = trainer.checker.drain()
    accused = {key for v in verdicts for key in v.wrong}
    assert accused == {liar.pubkey.hex()}  # the liar, and no honest replica
    known, banned = trainer.routers["body1"].counts()
    assert (known, banned) == (3, 1)  # excluded from routing
    assert all(liar.uid not in m.workers.values() for m in result.microbatches[-3:])
    evidence = [e for v in verdicts for e in v.accusations()]
    for item in evidence:
        check_accusation(item, stage_of(workers))  # anyone holding the stage roster can check it
    # The evidence is the liar's own signature: tampering with it, or leaving out a majority, does not verify.
    item = evidence[0]
    answers = [SignedAnswer.from_value(a) for a in item["answers"]]
    forged = dict(item, answers=[dict(a.to_value(), answer="0" * 64) if a.worker == liar.pubkey.hex()
                                 else a.to_value() for a in answers])
    lone = dict(item, answers=[a.to_value() for a in answers if a.worker == liar.pubkey.hex()][:1]
                + [a.to_value() for a in answers if a.worker != liar.pubkey.hex()][:1])
    honest = dict(item, accused=next(a.worker for a in answers if a.worker != liar.pubkey.hex()))
    for bad in (forged, lone, honest):
        try:
            check_accusation(bad, stage_of(workers))
        except AccusationError:
            continue
        raise AssertionError(f"a false accusation verified: {bad}")


def test_honest_replicas_agree_and_nobody_is_accused(start_worker, directory, dataset, run_id) -> None:
    for stage, count in (("head", 2), ("body1", 2), ("tail", 2)):
        for _ in range(count):
            start_worker(stage)
    wait_for_stages(directory, {"head": 2, "body1": 2, "tail": 2})
    result, trainer = train_checked(directory, dataset, run_id, 32)
    assert len(result.microbatches) == 8
    # Every microbatch compared at head and body forwards, body and tail backwards: 4 questions each.
    assert trainer.checker.checked == 4 * 8
    assert trainer.checker.drain() == []


def test_two_replicas_disagreeing_record_it_and_punish_nobody(start_worker, directory, dataset, run_id) -> None:
    workers = [start_worker("head"), start_worker("body1"), start_worker("body1"), start_worker("tail")]
    hostile(workers[1], f=1.0)
    wait_for_stages(directory, {"head": 1, "body1": 2, "tail": 1})
    _, trainer = train_checked(directory, dataset, run_id, 8)
    verdicts = trainer.checker.drain()
    assert verdicts and all(v.wrong == () for v in verdicts)
    assert trainer.routers["body1"].counts() == (2, 0)


def test_checks_are_chosen_unpredictably_at_the_rate() -> None:
    a, b = CheckPolicy(rate=0.05), CheckPolicy(rate=0.05)
    ids = [f"s/{i}" for i in range(20_000)]
    chosen_a = {i for i in ids if a.chosen(i)}
    assert 0.04 < len(chosen_a) / len(ids) < 0.06
    assert len(chosen_a & {i for i in ids if b.chosen(i)}) < 0.1 * len(chosen_a)  # another secret, other choices


def test_catch_probability_formula() -> None:
    assert catch_probability(0.01, 0.05, 921, 10) >= 0.99
    assert catch_probability(0.01, 0.05, 900, 10) < 0.99
    c = rate_needed(0.01, 100, 10, 0.99)
    assert abs(catch_probability(0.01, c, 100, 10) - 0.99) < 1e-9


def test_a_tolerance_lets_close_answers_agree_and_settles_by_majority() -> None:
    from solders.keypair import Keypair

    from client.answers import sign
    from client.pipeline.checks import SIGNED, Reply, agree, settle
    from client.pipeline.discovery import WorkerRecord

    def reply(tensor: torch.Tensor) -> Reply:
        record = WorkerRecord(run_id="r", stage="body1", uid="body1.0.1", address="a", sync_phase=0, load=0,
                              throughput=0.0, model="m", pubkey="", expires=0.0, state="up")
        digest = tensor.numpy().tobytes().hex()[:64].ljust(64, "0")
        return Reply(record, {SIGNED: sign(Keypair(), "5e" * 32, digest)}, {"output": tensor})

    base = torch.randn(2, 4, 8)
    close, far = reply(base + 1e-5), reply(base + 1e-1)
    assert agree(reply(base), close, 1e-3) and not agree(reply(base), close, 0.0)
    assert not agree(reply(base), far, 1e-3)
    winner, wrong = settle([reply(base), far, close], 1e-3)
    assert winner is not None and wrong == [far]
    assert settle([reply(base), far], 1e-3) == (None, [])
