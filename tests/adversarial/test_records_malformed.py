"""Validly signed but malformed records, sent to silence every witness: the real judge never raises on one, counts
it against its author only, and every honest client is still counted."""

from __future__ import annotations

import pytest
from solders.keypair import Keypair

from client.receipts import Receipt, ReceiptRound, SignedReceipt
from client.witness.judge import judge_round, judge_warmup
from client.witness.records import MAX_RECEIPTS, MAX_TEXT, Commitment, Ready, RecordError, Report
from coordinator_program.spec.state import Role
from tests.witness.rounds import DIGEST, commitment, honest_round, report, run_with_keys, shares, workers_by_stage

A_RECEIPT = SignedReceipt.sign(Keypair(), Receipt("01" * 32, "m", "head", "head.0.1", 0, 1, DIGEST, DIGEST, ""),
                               ReceiptRound("run.0123456789abcdef", 0, 0)).to_value()
MALFORMED_RECEIPTS = [
    7, [[1, 2]], [[{}, "u", {}]], [{}],  # the values of issue 11 that made judge_round raise, killing the witness
    "abc", None, [{"trainer_id": 1}], [{**A_RECEIPT, "extra": 1}], [{**A_RECEIPT, "sample_end": 0}],
    [{**A_RECEIPT, "worker_uid": "h" * 999}], [{**A_RECEIPT, "input_digest": "AB" * 32}],
    [{**A_RECEIPT, "worker": "w"}], [{**A_RECEIPT, "signature": "00"}], [{**A_RECEIPT, "epoch": "0"}],
    [{**A_RECEIPT, "round": -1}], [{**A_RECEIPT, "run": ""}],
    [A_RECEIPT] * (MAX_RECEIPTS + 1),
]
MALFORMED_FIELDS = [{"loss": float("nan")}, {"loss": float("inf")}, {"loss": -1.0}, {"loss": "0.001"},
                    {"loss": True}, {"start": -1}, {"end": True}, {"tokens": 2**70}, {"epoch": "0"}, {"round": -1},
                    {"run_id": "x" * 100}, {"run_id": 5}]


def short(value: object) -> str:
    return repr(value)[:40]


@pytest.mark.parametrize("receipts", MALFORMED_RECEIPTS, ids=short)
def test_a_malformed_commitment_counts_against_its_author_only(receipts: object) -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    attacker, honest = shares(state)
    bad = Commitment.create(keys[attacker.client], run_id=state.run_id, epoch=0, round=0, start=attacker.start,
                            end=attacker.end, loss=0.001, tokens=attacker.size * state.model.seq_len,
                            receipts=receipts)
    assert bad.verifies(), "validly signed: only its content is at fault"
    commitments[attacker.client.hex()] = bad
    evidence = judge_round(state, commitments, reports)
    assert attacker.client in evidence.missing and attacker.client not in evidence.participants
    assert honest.client in evidence.participants and honest.client not in evidence.missing
    assert commitments[honest.client.hex()].digest() in evidence.batches
    assert {w for w in workers_by_stage(state).values()} <= evidence.participants
    with pytest.raises(RecordError):  # nor does it parse when it comes from the DHT
        Commitment.from_value(bad.to_value())


@pytest.mark.parametrize("change", MALFORMED_FIELDS, ids=short)
def test_a_commitment_with_a_malformed_field_is_refused_with_the_reason(change: dict) -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    attacker, honest = shares(state)
    commitments[attacker.client.hex()] = commitment(state, keys, attacker, list(commitments[attacker.client.hex()]
                                                                              .receipts), **change)
    evidence = judge_round(state, commitments, reports)
    assert attacker.client in evidence.missing and honest.client in evidence.participants
    assert evidence.why_missing[attacker.client]
    with pytest.raises(RecordError):
        Commitment.from_value(commitments[attacker.client.hex()].to_value())


@pytest.mark.parametrize("change", [{"receipts": 7}, {"receipts": [[1, 2]]}, {"receipts": [{}]},
                                    {"receipts": ("zz",)}, {"receipts": ("ab" * 32,) * (MAX_RECEIPTS + 1)},
                                    {"stage": "0"}, {"stage": 300}, {"uid": 5}, {"uid": "u" * (MAX_TEXT + 1)},
                                    {"uid": "line\nbreak"}], ids=short)
def test_a_malformed_report_counts_against_its_author_only(change: dict) -> None:
    state, keys = run_with_keys(workers=4)  # two head workers: the spare one confirms nobody's receipts
    commitments, reports = honest_round(state, keys)
    spare = next(c.id for c in state.clients if c.role == Role.Worker and c.id not in workers_by_stage(state).values())
    reports[spare.hex()] = report(state, keys, spare, [], **change)
    evidence = judge_round(state, commitments, reports)
    assert spare not in evidence.participants
    assert evidence.complete and {s.client for s in shares(state)} <= evidence.participants
    with pytest.raises(RecordError):
        Report.from_value(reports[spare.hex()].to_value())


def test_malformed_ready_records_leave_only_their_authors_out_of_the_warmup() -> None:
    state, keys = run_with_keys()
    ready = {c.id.hex(): Ready.create(keys[c.id], run_id=state.run_id, epoch=0) for c in state.clients}
    first, second, third = state.clients[:3]
    ready[first.id.hex()] = Ready.create(keys[first.id], run_id=state.run_id, epoch=-1)
    ready[second.id.hex()] = Ready.create(keys[second.id], run_id=state.run_id, epoch=[0])  # type: ignore[arg-type]
    ready[third.id.hex()] = Report.create(keys[third.id], run_id=state.run_id, epoch=0, round=0, stage=0, uid="u",
                                          receipts=())  # a record of another kind
    evidence = judge_warmup(state, ready)  # type: ignore[arg-type]
    assert set(evidence.missing) == {first.id, second.id, third.id}
    assert evidence.participants == {c.id for c in state.clients[3:]}


def test_records_replayed_from_another_run_are_refused() -> None:
    state, keys = run_with_keys(workers=4)
    commitments, reports = honest_round(state, keys)
    replayed, honest = shares(state)
    elsewhere = commitment(state, keys, replayed, list(commitments[replayed.client.hex()].receipts),
                           run_id="another-run")  # the same trainer's record, same epoch and round, in another run
    assert elsewhere.verifies()
    commitments[replayed.client.hex()] = elsewhere
    spare = next(c.id for c in state.clients if c.role == Role.Worker and c.id not in workers_by_stage(state).values())
    reports[spare.hex()] = report(state, keys, spare, [], run_id="another-run")
    evidence = judge_round(state, commitments, reports)
    assert replayed.client in evidence.missing and "another-run" in evidence.why_missing[replayed.client]
    assert honest.client in evidence.participants
    assert spare not in evidence.participants, "a report of another run is no proof of presence in this one"
    ready = {c.id.hex(): Ready.create(keys[c.id], run_id="another-run", epoch=0) for c in state.clients}
    assert judge_warmup(state, ready).participants == set()
