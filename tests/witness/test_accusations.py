"""Accusations reach the witnesses: a worker proven wrong by its own signed answer against its stage's majority is
left out of the round's proof (no points; the health check removes it), and evidence that does not hold moves
nothing."""

from __future__ import annotations

from client.answers import sign
from client.witness.judge import judge_round
from client.witness.records import Accusation
from coordinator_program.spec.state import Role
from tests.witness.rounds import STAGES, honest_round, run_with_keys

QUESTION = "5e" * 32


def stage_workers(state, stage: int) -> list[bytes]:
    return [c.id for c in state.clients if c.role == Role.Worker and c.stage == stage]


def crowded(state) -> tuple[int, int]:
    """(a stage with three workers, another stage): the run holds 8 clients, 7 of them workers."""
    full = next(s for s in range(3) if len(stage_workers(state, s)) == 3)
    return full, (full + 1) % 3


def accusation(state, keys, accused: bytes, signers: list[bytes], stage: int, *, majority: str = "b" * 64,
               author: bytes | None = None) -> dict[str, Accusation]:
    """A trainer's accusation of ``accused``: its answer "a…" to QUESTION beside ``signers``' ``majority``."""
    trainer = author or next(c.id for c in state.clients if c.role == Role.Trainer)
    answers = [sign(keys[accused], QUESTION, "a" * 64)] + [sign(keys[w], QUESTION, majority) for w in signers]
    item = {"stage": STAGES[stage], "kind": "forward", "microbatch": "m/1", "accused": accused.hex(),
            "answers": [a.to_value() for a in answers]}
    record = Accusation.create(keys[trainer], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                               accusations=(item,))
    return {trainer.hex(): record}


def test_a_proven_wrong_worker_is_left_out_and_its_trainers_keep_their_credit() -> None:
    state, keys = run_with_keys(workers=7, trainers=1)
    commitments, reports = honest_round(state, keys)
    stage, _ = crowded(state)
    accused, *others = stage_workers(state, stage)
    evidence = judge_round(state, commitments, reports, {}, accusation(state, keys, accused, others, stage))
    assert accused not in evidence.participants and accused not in evidence.computed
    assert evidence.participants == {c.id for c in state.clients} - {accused}
    assert evidence.complete and len(evidence.commitments) == len(commitments)


def test_evidence_that_does_not_hold_leaves_everyone_in() -> None:
    state, keys = run_with_keys(workers=7, trainers=1)
    commitments, reports = honest_round(state, keys)
    stage, other = crowded(state)
    accused, a, b = stage_workers(state, stage)
    elsewhere = stage_workers(state, other)
    false = [
        accusation(state, keys, accused, [a], stage),  # one other worker: no majority
        accusation(state, keys, accused, elsewhere[:2], stage),  # the "majority" are workers of another stage
        accusation(state, keys, accused, [a, b], stage, majority="a" * 64),  # the majority gave the accused's answer
        accusation(state, keys, accused, [a, b], other),  # filed under a stage the accused is not in
    ]
    for records in false:
        evidence = judge_round(state, commitments, reports, {}, records)
        assert evidence.participants == {c.id for c in state.clients}
    # An answer's signature covers it: a majority whose answers were altered after signing does not verify.
    records = accusation(state, keys, accused, [a, b], stage)
    [record] = records.values()
    item = dict(record.accusations[0])
    item["answers"] = [dict(x, answer="c" * 64) if x["worker"] != accused.hex() else x for x in item["answers"]]
    trainer = bytes.fromhex(record.author)
    altered = Accusation.create(keys[trainer], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                                accusations=(item,))
    evidence = judge_round(state, commitments, reports, {}, {record.author: altered})
    assert accused in evidence.participants
