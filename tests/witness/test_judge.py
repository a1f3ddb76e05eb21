"""What a witness counts: signed, assigned, receipt-confirmed commitments; and the filters it builds."""

from __future__ import annotations

import dataclasses

from solders.keypair import Keypair

from client.witness.judge import judge_round, judge_warmup, unhealthy_clients
from client.witness.records import Commitment, Ready, Report
from coordinator_program import limits, rules
from coordinator_program.bloom import batch_key, contains_raw, participant_key
from coordinator_program.state import CoordinatorState, Phase, Role
from tests.spec.scenario import RUN_ID, SMALL, new_run

STAGES = ["head", "body1", "tail"]


def run_with_keys() -> tuple[CoordinatorState, dict[bytes, Keypair]]:
    """A run in RoundTrain whose clients (3 workers, 2 trainers) have real keypairs."""
    state = new_run()
    keys: dict[bytes, Keypair] = {}
    for role in [Role.Worker] * 3 + [Role.Trainer] * 2:
        key = Keypair()
        me = bytes(key.pubkey())
        keys[me] = key
        rules.join(state, me, RUN_ID, role, limits.NO_STAGE, me)
    rules.tick(state, 0, 5)
    rules.tick(state, SMALL.warmup_time, 6)
    assert state.phase == Phase.RoundTrain
    return state, keys


def honest_records(state: CoordinatorState, keys: dict[bytes, Keypair]):
    """Every trainer commits its assigned range with one receipt per stage, and every worker reports them."""
    workers = {c.stage: c.id for c in state.clients if c.role == Role.Worker}
    reported: dict[bytes, list[str]] = {w: [] for w in workers.values()}
    commitments = {}
    for share in rules.data_assignment(state):
        receipts = []
        for stage, name in enumerate(STAGES):
            h = f"{share.client.hex()[:8]}-{name}".encode().hex()
            receipts.append((name, f"{name}.0.{stage}", h))
            reported[workers[stage]].append(h)
        commitments[share.client.hex()] = Commitment.create(
            keys[share.client], epoch=0, round=0, start=share.start, end=share.end, loss=4.2, tokens=64,
            receipts=tuple(receipts))
    reports = {w.hex(): Report.create(keys[w], epoch=0, round=0, stage=stage, uid=f"{STAGES[stage]}.0.{stage}",
                                      receipts=tuple(reported[w])) for stage, w in workers.items()}
    return commitments, reports


def test_honest_round_is_complete_and_filters_hold_everyone() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_records(state, keys)
    evidence = judge_round(state, commitments, reports)
    assert evidence.complete and evidence.missing == []
    assert evidence.participants == {c.id for c in state.clients}
    participants, batches = evidence.filters(state)
    assert all(contains_raw(participants, participant_key(c.id), SMALL.bloom_slices, SMALL.bloom_bits_per_slice)
               for c in state.clients)
    assert all(contains_raw(batches, batch_key(c.digest()), SMALL.bloom_slices, SMALL.bloom_bits_per_slice)
               for c in commitments.values())


def test_wrong_range_forgery_and_unconfirmed_receipts_are_not_counted() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_records(state, keys)
    trainers = list(commitments)
    cheat = commitments[trainers[0]]
    commitments[trainers[0]] = Commitment.create(keys[bytes.fromhex(trainers[0])], epoch=0, round=0,
                                                 start=cheat.start + 1, end=cheat.end, loss=cheat.loss,
                                                 tokens=cheat.tokens, receipts=cheat.receipts)
    other = commitments[trainers[1]]
    commitments[trainers[1]] = dataclasses.replace(other, loss=0.01)  # tampered after signing
    evidence = judge_round(state, {k: v for k, v in commitments.items() if v.verifies()}, reports)
    assert not evidence.complete
    assert set(evidence.missing) == {bytes.fromhex(t) for t in trainers}
    assert not any(bytes.fromhex(t) in evidence.participants for t in trainers)
    assert not dataclasses.replace(other, loss=0.01).verifies()


def test_receipts_must_be_reported_by_the_worker_of_that_stage() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_records(state, keys)
    head = next(c.id for c in state.clients if c.role == Role.Worker and c.stage == 0)
    reports[head.hex()] = Report.create(keys[head], epoch=0, round=0, stage=0, uid="head.0.0", receipts=())
    evidence = judge_round(state, commitments, reports)
    assert not evidence.complete and head in evidence.participants, "present, but confirms no batch"
    body = next(c.id for c in state.clients if c.role == Role.Worker and c.stage == 1)
    lying = Report.create(keys[body], epoch=0, round=0, stage=2, uid="tail.0.2", receipts=("ab",))
    assert body not in judge_round(state, {}, {body.hex(): lying}).participants


def test_warmup_and_health_targets() -> None:
    state, keys = run_with_keys()
    ready = {c.id.hex(): Ready.create(keys[c.id], epoch=0) for c in state.clients[:-1]}
    evidence = judge_warmup(state, ready)
    assert not evidence.complete and evidence.missing == [state.clients[-1].id]
    assert unhealthy_clients(state) == [], "no previous round in the epoch's first round"


def test_records_round_trip_and_reject_malformed_values() -> None:
    key = Keypair()
    record = Commitment.create(key, epoch=1, round=2, start=3, end=4, loss=1.5, tokens=9,
                               receipts=(("head", "head.0.1", "aa"),))
    assert Commitment.from_value(record.to_value()) == record and record.verifies()
    for bad in ({}, {"author": 1}, {**record.to_value(), "epoch": "1"}, {**record.to_value(), "extra": 0}):
        try:
            Commitment.from_value(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")
