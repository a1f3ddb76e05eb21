"""A reducer's result is checked against the inputs its senders signed (issue 20: a reducer's output is checked, and a
peer caught lying is excluded with evidence the others and the witnesses can check).

- the pure rules (``client.averaging.audit``): an honest reducer's statement holds for every sender and no evidence
  against it can be assembled, however its parts are moved or re-attributed; a result that is not the robust mean
  of the signed inputs, or a statement listing an input its sender did not sign, convicts the reducer's key and
  no other; malformed evidence and statements are refused, never raised;
- real hivemind averagers: a reducer returning its shard shifted by 0.01 (well within the result bound, so on the
  old code every groupmate took it and nothing noticed) is audited by its groupmates and its own signed statement
  convicts it; a reducer whose statement lists a forged input gets its shard refused and is convicted by the
  statement alone; an honest group keeps no evidence and gets the result it got before;
- a witness (``accusing.reduction_lie``) convicts the reducer only where it is a worker of the stage the evidence's
  averaging belongs to, and its proof of the round leaves the reducer out and everyone else in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from solders.keypair import Keypair

from client.averaging.audit import (
    BLOCK,
    Entry,
    Place,
    Statement,
    evidence,
    false_block,
    forged,
    make_statement,
    proven_liar,
    reduce_blocks,
    signed_entry,
    statement_refusal,
)
from client.averaging.gradients import GradAveraging, GradientAverager, GradientProcess, GradientSettings
from client.averaging.runner import RobustReducer, RobustRunner
from client.averaging.sparta import averager_prefix
from client.averaging.stage_averager import PART_BYTES
from client.averaging.values import GradValues, encoded_bytes
from client.contributor.accusing import (
    FALSE_DECLARATION,
    false_declaration_accuser,
    false_declarers,
    reduction_lie,
)
from client.contributor.rounds import RoundKey
from client.witness.data_accusations import convict
from client.witness.judge import judge_round
from client.witness.records import MAX_RECORD_BYTES, Accusation, Board, RecordError, record_bytes
from coordinator_program.spec.derived import run_instance
from coordinator_program.spec.state import Role
from tests.averaging.test_attacks import TRIO, gradient_pairs, gradient_round, shared_gradient
from tests.witness.rounds import STAGES, honest_round, run_with_keys

PREFIX = "run.body1.grad"
FLOAT32 = GradValues.FLOAT32
PLACE = Place(PREFIX, b"group-id", b"reducer-peer", 0)


SIZE = 3 * BLOCK - 100  # three blocks, the last one short


def reduction(n: int = 3, shift: float = 0.0, reducer: Keypair | None = None, place: Place = PLACE,
              size: int = SIZE, shifted: slice = slice(BLOCK, BLOCK + 1)
              ) -> tuple[Keypair, list[Keypair], Statement, list[torch.Tensor], torch.Tensor]:
    """``n`` senders' signed inputs to ``place``, and the reducer's statement of their blockwise robust mean, with
    ``shift`` added to the values ``shifted`` (one value of the second block)."""
    reducer = reducer or Keypair()
    senders = [Keypair() for _ in range(n)]
    generator = torch.Generator().manual_seed(n)
    inputs = [torch.randn(size, generator=generator) for _ in range(n)]
    entries = [signed_entry(k, place, p, 4.0) for k, p in zip(senders, inputs, strict=True)]
    result = reduce_blocks(inputs, [4.0] * n)
    result[shifted] += shift
    return reducer, senders, make_statement(reducer, place, entries, result, FLOAT32), inputs, result


@pytest.mark.parametrize("n", [2, 3, 5])
def test_an_honest_reducer_s_statement_holds_for_every_sender_and_convicts_no_one(n: int) -> None:
    reducer, senders, statement, inputs, result = reduction(n)
    for sender, entry in zip(senders, statement.entries, strict=True):
        assert statement_refusal(statement, PLACE, bytes(reducer.pubkey()), result, entry, FLOAT32) == ""
        assert entry.key == bytes(sender.pubkey())
    assert not forged(statement, PLACE)
    assert false_block(statement, inputs, result) is None
    for block in range(3):
        assert proven_liar(evidence(PLACE, bytes(reducer.pubkey()), statement, inputs, result, block)) is None
    assert Statement.from_bytes(statement.to_bytes()) == statement


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_result_that_is_not_the_robust_mean_of_the_signed_inputs_convicts_its_reducer(n: int) -> None:
    reducer, _, statement, inputs, result = reduction(n, shift=1e-3)
    assert false_block(statement, inputs, result) == 1
    key = bytes(reducer.pubkey())
    assert proven_liar(evidence(PLACE, key, statement, inputs, result, 1)) == (key, PREFIX)
    assert proven_liar(evidence(PLACE, key, statement, inputs, result, 0)) is None  # a true block proves nothing
    item = evidence(PLACE, key, statement, inputs, result, 1)
    assert len(json.dumps(item)) < 3_500 * (n + 2)  # one block and its paths per input: what a record carries


def test_a_statement_listing_an_input_its_sender_did_not_sign_convicts_its_reducer_by_itself() -> None:
    reducer, senders, statement, inputs, result = reduction(3)
    victim = statement.entries[0]
    altered = Entry(victim.key, statement.entries[1].digest, victim.weight, victim.signature)  # another input
    twice = [statement.entries[0], statement.entries[0], statement.entries[2]]  # one sender counted twice
    for entries in ([altered, *statement.entries[1:]], twice):
        lie = make_statement(reducer, PLACE, entries, result, FLOAT32)
        assert forged(lie, PLACE)
        assert proven_liar(evidence(PLACE, bytes(reducer.pubkey()), lie)) == (bytes(reducer.pubkey()), PREFIX)
    assert proven_liar(evidence(PLACE, bytes(reducer.pubkey()), statement)) is None  # no inputs: no proof


def test_a_sender_takes_a_part_back_only_with_a_statement_that_lists_its_input_as_sent() -> None:
    reducer, senders, statement, _, result = reduction(3)
    key, own = bytes(reducer.pubkey()), statement.entries[1]
    stranger = bytes(Keypair().pubkey())
    assert "not signed by its key" in statement_refusal(statement, PLACE, stranger, result, own, FLOAT32)
    assert "not signed by its key" in statement_refusal(statement, Place(PREFIX, b"group-id", b"reducer-peer", 1),
                                                        key, result, own, FLOAT32)
    assert "another result" in statement_refusal(statement, PLACE, key, torch.zeros(SIZE), own, FLOAT32)
    other = signed_entry(senders[1], PLACE, torch.ones(SIZE), 4.0)  # what it sent was not what is listed
    assert "does not list" in statement_refusal(statement, PLACE, key, result, other, FLOAT32)
    dropped = make_statement(reducer, PLACE, [statement.entries[0], statement.entries[2]], result, FLOAT32)
    assert "does not list" in statement_refusal(dropped, PLACE, key, result, own, FLOAT32)


def test_no_evidence_against_an_honest_reducer_can_be_assembled() -> None:
    """Anyone may file evidence: moving an honest statement to another place, swapping its inputs or result,
    re-attributing it, or shifting a value, proves nothing."""
    reducer, _, statement, inputs, result = reduction(3)
    key = bytes(reducer.pubkey())
    genuine = evidence(PLACE, key, statement, inputs, result, 1)["reduction"]
    swapped = dict(genuine["inputs"][0])
    swapped["values"] = genuine["inputs"][1]["values"]  # another sender's block under this one's hashes
    changed = {
        "another part": {**genuine, "part": 1},
        "another group": {**genuine, "group": b"other".hex()},
        "another prefix": {**genuine, "prefix": "run.tail.grad"},
        "another reducer key": {**genuine, "key": bytes(Keypair().pubkey()).hex()},
        "inputs swapped": {**genuine, "inputs": [genuine["inputs"][1], genuine["inputs"][0], genuine["inputs"][2]]},
        "an input dropped": {**genuine, "inputs": genuine["inputs"][:2]},
        "another result": evidence(PLACE, key, statement, inputs, torch.zeros(SIZE), 1)["reduction"],
        "another block's values": {**genuine, "block": 0},
        "an input's block swapped": {**genuine, "inputs": [swapped, *genuine["inputs"][1:]]},
        "an extra field": {**genuine, "note": 1},
    }
    for why, body in changed.items():
        assert proven_liar({"reduction": body}) is None, why


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4), max_leaves=20))
def test_malformed_evidence_proves_nothing_and_raises_nothing(junk: Any) -> None:
    assert proven_liar(junk) is None
    assert proven_liar({"reduction": junk}) is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_a_malformed_statement_is_refused_with_a_value_error(data: bytes) -> None:
    try:
        Statement.from_bytes(data)
    except ValueError:
        pass


def test_a_witness_convicts_a_false_reducer_only_in_its_own_stage_s_averaging() -> None:
    state, keys = run_with_keys(workers=7, trainers=1)
    worker = next(c.id for c in state.clients if c.role == Role.Worker and c.stage == 1)
    trainer = next(c.id for c in state.clients if c.role == Role.Trainer)
    for kind in ("grad", "sparta"):
        place = Place(averager_prefix(run_instance(state), STAGES[1], kind), b"g", b"r", 0)
        reducer, _, statement, inputs, result = reduction(3, shift=0.5, reducer=keys[worker], place=place)
        assert reduction_lie(evidence(place, worker, statement, inputs, result, 1), state) == worker
    for prefix, signer in ((averager_prefix(run_instance(state), "tail", "grad"), worker),  # not its stage
                           (averager_prefix(state.run_id, STAGES[1], "grad"), worker),  # not this run's instance
                           (averager_prefix(run_instance(state), STAGES[1], "grad"), trainer)):  # not a worker
        place = Place(prefix, b"g", b"r", 0)
        _, _, statement, inputs, result = reduction(3, shift=0.5, reducer=keys[signer], place=place)
        assert reduction_lie(evidence(place, signer, statement, inputs, result, 1), state) is None


def test_a_witness_s_proof_leaves_a_false_reducer_out_and_everyone_else_in() -> None:
    """The evidence as a worker publishes it, in an ``Accusation`` record of the round, through the witness's judge."""
    state, keys = run_with_keys(workers=7, trainers=1)
    commitments, reports = honest_round(state, keys)
    liar, accuser = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 1][:2]
    place = Place(averager_prefix(run_instance(state), STAGES[1], "grad"), b"g", b"r", 0)
    _, _, statement, inputs, result = reduction(3, shift=0.5, reducer=keys[liar], place=place)
    record = Accusation.create(keys[accuser], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                               accusations=(evidence(place, liar, statement, inputs, result, 1),))
    accusations = {accuser.hex(): record}
    proof = judge_round(state, commitments, reports, {}, accusations)
    convict(proof, false_declarers(state, accusations), FALSE_DECLARATION)
    assert proof.participants == {c.id for c in state.clients} - {liar}
    assert proof.why_missing[liar] == FALSE_DECLARATION


def test_evidence_of_full_size_parts_travels_in_a_record_through_a_real_dht(dht, new_dht, run_id: str) -> None:
    """Parts of ``PART_BYTES``, as the averagers send them, in a group of eight: one block's evidence fits a record,
    which the accuser's node publishes and another's reads back whole, still a proof."""
    state, keys = run_with_keys(workers=7, trainers=1, run_id=run_id)
    liar, accuser = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 1][:2]
    place = Place(averager_prefix(run_instance(state), STAGES[1], "grad"), b"g", b"r", 0)
    _, _, statement, inputs, result = reduction(8, shift=0.5, reducer=keys[liar], place=place, size=PART_BYTES // 4)
    item = evidence(place, liar, statement, inputs, result, 1)
    record = Accusation.create(keys[accuser], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                               accusations=(item,))
    assert record_bytes(record) <= MAX_RECORD_BYTES
    assert Board(dht, state).publish(record, keys[accuser])
    read = Board(new_dht(), state).fetch(Accusation, state.epoch, state.round.height)
    assert read == {accuser.hex(): record}
    assert false_declarers(state, read) == {liar}


def test_a_record_larger_than_a_record_may_be_is_refused_before_it_is_stored(dht, run_id: str) -> None:
    """Four blocks of evidence from a group of eight (about 120 KB) would make every witness fetch that much more
    with the round's records: such a record is refused, and nothing is stored."""
    state, keys = run_with_keys(workers=7, trainers=1, run_id=run_id)
    liar, accuser = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 1][:2]
    place = Place(averager_prefix(run_instance(state), STAGES[1], "grad"), b"g", b"r", 0)
    _, _, statement, inputs, result = reduction(8, shift=0.5, reducer=keys[liar], place=place, size=PART_BYTES // 4)
    pieces = tuple(evidence(place, liar, statement, inputs, result, b) for b in range(4))
    record = Accusation.create(keys[accuser], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                               accusations=pieces)
    with pytest.raises(RecordError, match="larger than"):
        Board(dht, state).publish(record, keys[accuser])


def test_an_accuser_publishes_the_first_pieces_that_fit_a_record(dht, new_dht, run_id: str) -> None:
    """Two false reducers' evidence in a group of eight (30 KB each): one record carries the first, and the accuser
    does not try again with the other, which no record could carry beside it."""
    state, keys = run_with_keys(workers=7, trainers=1, run_id=run_id)
    workers = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 1]
    accuser = workers[0]
    place = Place(averager_prefix(run_instance(state), STAGES[1], "grad"), b"g", b"r", 0)
    pieces = []
    for liar in workers[1:3]:
        _, _, statement, inputs, result = reduction(8, shift=0.5, reducer=keys[liar], place=place,
                                                    size=PART_BYTES // 4)
        pieces.append(evidence(place, liar, statement, inputs, result, 1))
    context = SimpleNamespace(board=Board(dht, state), keypair=keys[accuser])
    accuser_ = false_declaration_accuser(context)  # type: ignore[arg-type]
    asyncio.run(accuser_.publish(RoundKey(state.epoch, state.round.height), pieces))
    read = Board(new_dht(), state).fetch(Accusation, state.epoch, state.round.height)
    assert [len(r.accusations) for r in read.values()] == [1]
    assert false_declarers(state, read) == {workers[1]}


# ----- real averagers -----


class _ShiftedReducer(RobustReducer):
    shift = 0.01

    async def accumulate_part(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return (await super().accumulate_part(*args, **kwargs)) + self.shift


class _ShiftingRunner(RobustRunner):
    """A reducer that returns its shard's robust mean plus 0.01, and signs that."""

    reducer_class = _ShiftedReducer


def shifting_by(shift: float) -> type[RobustRunner]:
    """A reducer that returns its shard's robust mean plus ``shift``, and signs that."""
    return type("_ShiftingRunner", (RobustRunner,), {
        "reducer_class": type("_ShiftedReducer", (_ShiftedReducer,), {"shift": shift})})


class _FarShiftingRunner(_ShiftingRunner):
    """A reducer that returns its shard's robust mean plus 10, far above any honest average's norm, and signs that."""

    reducer_class = type("_FarShiftedReducer", (_ShiftedReducer,), {"shift": 10.0})


class _ForgingRunner(RobustRunner):
    """A reducer whose statements list, besides its true inputs, one that nobody signed."""

    def _answer(self, part_index: int, averaged: torch.Tensor) -> tuple[Any, torch.Tensor, Statement]:
        wire, result, true = super()._answer(part_index, averaged)
        fake = Entry(bytes(Keypair().pubkey()), bytes(32), 4.0, bytes(64))
        return wire, result, make_statement(self.signer, self.place(self.peer_id, part_index), [*true.entries, fake],
                                            result, self.values)


def averager_class(runner: type[RobustRunner] = RobustRunner) -> type[GradientAverager]:
    """A gradient averager reducing with ``runner`` (hivemind names a peer's handlers after its class: every peer's
    process must be called what an honest peer's is)."""
    process = type("GradientProcess", (GradientProcess,), {"runner_class": runner})
    return type("GradientAverager", (GradientAverager,), {"process_class": process})


def lies_after(averagers: list[GradientAverager], expected: int, wait: float = 15.0) -> list[dict[str, Any]]:
    """What the averagers keep as evidence once their audits (after the round) are done: polled until ``expected``
    pieces arrived or ``wait`` seconds passed."""
    found: list[dict[str, Any]] = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        for averager in averagers:
            found += averager.process.drain_lies()
        if len(found) >= expected:
            time.sleep(1.0)  # and whatever else was coming
            for averager in averagers:
                found += averager.process.drain_lies()
            break
        time.sleep(0.2)
    return found


def trio(make_grad_averager, liar: type[RobustRunner], audit_rate: float = 1.0,
         values: GradValues = GradValues.FLOAT32) -> tuple[list[GradientAverager], list[Any], list[Any]]:
    """A round of three in the codec ``values``, the third reducing with ``liar``; each peer audits each other
    reducer at ``audit_rate`` (the run's: every one, unless a test says otherwise)."""
    timeouts = dataclasses.replace(TRIO, audit_rate=audit_rate)
    settings = GradientSettings(GradAveraging.FULL, timeouts=timeouts, max_weight=16.0, values=values)
    per_value = encoded_bytes(values, 1 << 16) / (1 << 16)  # bytes a value takes in the codec
    shared = shared_gradient(384, int(256 * 4 / per_value))  # six parts of 64 KiB: every peer reduces a shard
    pairs = [gradient_pairs(i, shared) for i in (1, 2, 3)]
    keys = [Keypair() for _ in range(3)]
    classes = [averager_class(), averager_class(), averager_class(liar)]
    averagers = [make_grad_averager(p, settings, cls=c, keypair=k) for p, c, k in zip(pairs, classes, keys,
                                                                                       strict=True)]
    values = [[t.clone() for _, t in p] for p in pairs]
    results = gradient_round(averagers, values, [4.0, 4.0, 4.0])
    return averagers, results, [values, keys]


@pytest.mark.parametrize("codec", [GradValues.FLOAT32, GradValues.INT8])
def test_an_honest_group_s_audits_keep_no_evidence_and_change_no_result(make_grad_averager,
                                                                        codec: GradValues) -> None:
    averagers, results, (values, _) = trio(make_grad_averager, RobustRunner, values=codec)
    assert all(r is not None and r.complete and r.group_size == 3 for r in results)
    assert lies_after(averagers, expected=1, wait=6.0) == []
    assert all(torch.equal(a, b) for a, b in zip(values[0], values[1], strict=True))  # bit-identical replicas


@pytest.mark.parametrize(("codec", "shift"), [(GradValues.FLOAT32, 0.01), (GradValues.INT8, 0.1),
                                              (GradValues.INT4, 1.0)])
def test_a_reducer_shifting_its_shard_is_caught_by_an_audit_and_convicted_by_its_own_statement(
        make_grad_averager, codec: GradValues, shift: float) -> None:
    """Audits travel in the round's codec (the inputs as the reducer decoded them, encoded back): they still
    convict, of any shift beyond what the codec's rounding of the result may move it (``audit.false_block``)."""
    averagers, results, (values, keys) = trio(make_grad_averager, shifting_by(shift), values=codec)
    assert all(r is not None and r.complete for r in results[:2]), results  # within the bound: taken, as on the
    # old code
    lies = lies_after(averagers[:2], expected=2)
    assert len(lies) == 2, lies  # each honest groupmate audited it
    liar = bytes(keys[2].pubkey())
    assert {proven_liar(item) for item in lies} == {(liar, averagers[0].process.prefix)}


def test_with_the_run_s_audit_rate_0_a_shifted_shard_is_never_audited(make_grad_averager) -> None:
    """The audit rate is the run's: at 0 nobody audits, so the reducer shifting its shard (within the robust bound)
    goes unconvicted. What audits cost and catch is the run's trade (README, threat model)."""
    averagers, results, _ = trio(make_grad_averager, _ShiftingRunner, audit_rate=0.0)
    assert all(a.process.audit_rate == 0.0 for a in averagers)
    assert all(r is not None and r.complete for r in results[:2]), results
    assert lies_after(averagers[:2], expected=1, wait=6.0) == []


def test_a_reducer_whose_false_part_is_refused_for_its_size_is_audited_and_convicted_even_at_audit_rate_0(
        make_grad_averager) -> None:
    """A false reducer cannot escape the audits by lying by more than the bound: the part is refused (kept out of
    the round) and audited every time, whatever the run's audit rate. CI saw this escape: a shift within the bound
    while gradients were large went over it once they were small, and twelve rounds went unaudited."""
    averagers, results, (_, keys) = trio(make_grad_averager, _FarShiftingRunner, audit_rate=0.0)
    assert all(r is not None and r.group_size == 3 and not r.complete for r in results[:2]), results  # refused
    lies = lies_after(averagers[:2], expected=2)
    assert len(lies) == 2, lies  # each honest groupmate audited it
    assert {proven_liar(item) for item in lies} == {(bytes(keys[2].pubkey()), averagers[0].process.prefix)}


def test_a_reducer_listing_a_forged_input_has_its_shard_refused_and_is_convicted(make_grad_averager) -> None:
    averagers, results, (values, keys) = trio(make_grad_averager, _ForgingRunner)
    assert all(r is not None and r.group_size == 3 and not r.complete for r in results[:2]), results  # its shard
    # refused: the round is not whole
    lies = lies_after(averagers[:2], expected=2)
    assert lies and {proven_liar(item) for item in lies} == {(bytes(keys[2].pubkey()), averagers[0].process.prefix)}
    assert all(item["reduction"]["inputs"] == [] for item in lies)  # the statement alone convicts
