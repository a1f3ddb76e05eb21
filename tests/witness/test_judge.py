"""What a witness counts: signed, assigned commitments proven by worker-signed receipts; and the filters it
builds."""

from __future__ import annotations

import dataclasses

import pytest
from solders.keypair import Keypair

from client.witness.judge import judge_round, judge_warmup, unhealthy_clients
from client.witness.records import Commitment, Ready, RecordError, Report, parse_receipt
from coordinator_program.spec.bloom import batch_key, contains_raw, participant_key
from coordinator_program.spec.state import Role
from tests.spec.scenario import SMALL
from tests.witness.rounds import (
    commitment,
    hash_of,
    honest_round,
    receipt,
    report,
    run_with_keys,
    shares,
    workers_by_stage,
)


def test_honest_round_is_complete_and_filters_hold_everyone() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    evidence = judge_round(state, commitments, reports)
    assert evidence.complete and evidence.missing == []
    assert evidence.participants == {c.id for c in state.clients}
    [(participants, batches)] = evidence.filters(state)  # one part: a run of at most 128 clients
    assert all(contains_raw(participants, participant_key(c.id), SMALL.bloom_slices, SMALL.bloom_bits_per_slice)
               for c in state.clients)
    assert all(contains_raw(batches, batch_key(c.digest()), SMALL.bloom_slices, SMALL.bloom_bits_per_slice)
               for c in commitments.values())


def test_wrong_range_forgery_and_unconfirmed_receipts_are_not_counted() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    first, second = shares(state)
    cheat = commitments[first.client.hex()]
    commitments[first.client.hex()] = commitment(state, keys, first, list(cheat.receipts), start=cheat.start + 1)
    other = commitments[second.client.hex()]
    commitments[second.client.hex()] = dataclasses.replace(other, loss=0.01)  # tampered after signing
    evidence = judge_round(state, commitments, reports)
    assert not evidence.complete
    assert set(evidence.missing) == {first.client, second.client}
    assert "assigned" in evidence.why_missing[first.client]
    assert "signature" in evidence.why_missing[second.client]
    assert not {first.client, second.client} & evidence.participants


def test_a_worker_reporting_none_of_its_receipts_is_charged_and_the_trainers_still_counted() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    head = workers_by_stage(state)[0]
    reports[head.hex()] = report(state, keys, head, [])
    evidence = judge_round(state, commitments, reports)
    assert not evidence.complete and head in evidence.participants, "present, but charged"
    assert evidence.missing == [] and {s.client for s in shares(state)} <= evidence.computed
    assert head not in evidence.computed and "left 6 receipts" in evidence.charged[head]
    body = workers_by_stage(state)[1]
    lying = report(state, keys, body, ["ab" * 32], stage=2, uid="tail.0.2")
    assert body not in judge_round(state, {}, {body.hex(): lying}).participants


def test_warmup_and_health_targets() -> None:
    state, keys = run_with_keys()
    ready = {c.id.hex(): Ready.create(keys[c.id], run_id=state.run_id, epoch=0) for c in state.clients[:-1]}
    evidence = judge_warmup(state, ready)
    assert not evidence.complete and evidence.missing == [state.clients[-1].id]
    assert unhealthy_clients(state) == [], "no previous round in the epoch's first round"


def test_records_round_trip_and_reject_malformed_values() -> None:
    state, keys = run_with_keys()
    key = Keypair()
    trainer = bytes(key.pubkey())
    record = Commitment.create(key, run_id="run", epoch=1, round=2, start=3, end=4, loss=1.5, tokens=9,
                               receipts=(receipt(state, keys, trainer, workers_by_stage(state)[0], 3, 4),))
    assert Commitment.from_value(record.to_value()) == record and record.verifies()
    claim = parse_receipt(record.receipts[0])
    assert claim.hash() == hash_of(record.receipts[0]) and claim.verifies()
    for bad in ({}, {"author": 1}, {**record.to_value(), "epoch": "1"}, {**record.to_value(), "extra": 0}):
        with pytest.raises(RecordError):
            Commitment.from_value(bad)


def test_a_worker_of_the_wrong_role_or_stage_is_not_present() -> None:
    state, keys = run_with_keys()
    trainer = next(c.id for c in state.clients if c.role == Role.Trainer)
    posing = Report.create(keys[trainer], run_id=state.run_id, epoch=0, round=0, stage=0, uid="head.0.9", receipts=())
    assert trainer not in judge_round(state, {}, {trainer.hex(): posing}).participants
