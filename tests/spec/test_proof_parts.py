"""Issue 22: a run of more than one part's clients. A witness's proof comes in parts (one per 128 clients), counted
as one proof once every part is in and never on a part; each part's votes go to its own clients; health checks read
the counts kept from the previous round; a round's end credits its clients a chunk a tick."""

from __future__ import annotations

import pytest

from coordinator_program.spec import derived, errors, limits, points, rules
from coordinator_program.spec.bloom import build_filter, compute_key, part_count, participant_key, proof_parts
from coordinator_program.spec.filter_sizing import bloom_params, filter_capacity
from coordinator_program.spec.state import CoordinatorState, LedgerEntry, Phase
from tests.spec.scenario import SMALL, join_pipeline, new_run, replace, start_training

CLIENTS = 300
"""Three parts: 128, 128 and 44 clients."""

SLICES, BITS = bloom_params(filter_capacity(limits.MAX_CLIENTS), 0.0009)
LARGE = replace(SMALL, max_clients=limits.MAX_CLIENTS, min_clients=5, witness_nodes=5, witness_quorum=3,
                bloom_slices=SLICES, bloom_bits_per_slice=BITS, global_batch_size=1000)


def training(clients: int = CLIENTS) -> tuple[CoordinatorState, int]:
    state = new_run(LARGE)
    join_pipeline(state, workers=clients - clients // 4, trainers=clients // 4)
    return state, start_training(state)


def parts_of(state: CoordinatorState, present: list[bytes], worked: list[bytes] = ()) -> list[tuple[bytes, bytes]]:
    return proof_parts(state.config, [c.id for c in state.clients], present, worked, {})


def send(state: CoordinatorState, witness: bytes, parts: list[tuple[bytes, bytes]], only: range | None = None) -> None:
    for part in only if only is not None else range(len(parts)):
        rules.witness(state, witness, state.round.height, *parts[part], part)


def ids(state: CoordinatorState) -> list[bytes]:
    return [c.id for c in state.clients]


def end_round(state: CoordinatorState, now: int) -> int:
    """From RoundTrain with a quorum of proofs, tick to RoundWitness and through the round's end."""
    rules.tick(state, now, 1)
    assert state.phase == Phase.RoundWitness
    now += state.config.round_witness_time
    while state.phase == Phase.RoundWitness:
        rules.tick(state, now, 1)
    return now


def test_a_partial_proof_never_counts_as_a_whole_one() -> None:
    state, _ = training()
    assert part_count(len(state.clients)) == 3
    parts = parts_of(state, ids(state))
    witnesses = derived.witnesses(state)
    for w in witnesses[:derived.quorum(state)]:  # a quorum of witnesses, each one part short
        send(state, w, parts, range(2))
    assert state.round.witness_count == 0 and state.phase == Phase.RoundTrain
    with pytest.raises(errors.NothingToTick):
        rules.tick(state, state.phase_start, 5)
    send(state, witnesses[0], parts, range(2, 3))
    assert state.round.witnessed.bit_count() == 1 and state.round.parts[0] == 0b111


def test_a_part_is_taken_once_and_only_if_it_exists() -> None:
    state, _ = training()
    parts = parts_of(state, ids(state))
    w = derived.witnesses(state)[0]
    send(state, w, parts, range(1))
    nonce = state.nonce
    with pytest.raises(errors.DuplicateWitness, match="part 0"):
        send(state, w, parts, range(1))
    with pytest.raises(errors.BadFilter, match="parts 0-2 .* not 3"):
        rules.witness(state, w, state.round.height, *parts[0], 3)
    assert state.nonce == nonce and state.round.parts[0] == 1
    send(state, w, parts, range(1, 3))
    with pytest.raises(errors.DuplicateWitness, match="already sent its proof"):
        send(state, w, parts, range(1))


def test_a_parts_votes_go_to_its_own_clients_only() -> None:
    state, _ = training()
    everyone = ids(state)
    # One filter naming every client, sent as part 1: only part 1's clients may gain votes from it.
    everything = build_filter(state.config, [participant_key(i) for i in everyone[:128]]
                              + [compute_key(i) for i in everyone[128:256]])
    rules.witness(state, derived.witnesses(state)[0], 0, everything, build_filter(state.config, []), 1)
    assert not any(state.presence_votes), "part 0's clients are in the filter, but it was sent as part 1"
    assert [i for i, v in enumerate(state.compute_votes) if v] == list(range(128, 256))


def test_health_reads_the_previous_rounds_counts_per_part() -> None:
    state, now = training()
    everyone = ids(state)
    victim, bystander = everyone[200], everyone[10]
    witnesses = derived.witnesses(state)
    honest = parts_of(state, [i for i in everyone if i != victim])
    for w in witnesses[:3]:
        send(state, w, honest)
    # Two more witnesses send part 0 only: part 1 (the victim's) has 3 proofs, part 0 has 5.
    for w in witnesses[3:]:
        send(state, w, honest, range(1))
    end_round(state, now)
    assert state.phase == Phase.RoundTrain and state.round.height == 1
    after = ids(state)
    assert state.left_out[after.index(victim)] == 3 and state.left_out[after.index(bystander)] == 0
    assert derived.missed_by_quorum(state, victim) and not derived.missed_by_quorum(state, bystander)
    checker = derived.witnesses(state)[0]
    with pytest.raises(errors.ClientHealthy):
        rules.health_check(state, checker, bystander)
    rules.health_check(state, checker, victim)


def test_a_minority_leaving_a_client_out_of_its_part_cannot_get_it_removed() -> None:
    state, now = training()
    everyone = ids(state)
    target = everyone[5]
    witnesses = derived.witnesses(state)
    with_target, without = parts_of(state, everyone), parts_of(state, [i for i in everyone if i != target])
    for w in witnesses[:2]:  # a minority of 5 lie
        send(state, w, without)
    for w in witnesses[2:]:
        send(state, w, with_target)
    end_round(state, now)
    assert state.left_out[ids(state).index(target)] == 2 < derived.quorum(state)
    with pytest.raises(errors.ClientHealthy):
        rules.health_check(state, derived.witnesses(state)[0], target)


def test_the_round_end_credits_a_chunk_a_tick_and_takes_no_proof_meanwhile() -> None:
    state, now = training()
    everyone = ids(state)
    parts = parts_of(state, everyone, everyone)
    for w in derived.witnesses(state):
        send(state, w, parts)
    rules.tick(state, now, 1)
    assert state.phase == Phase.RoundWitness
    expected = points.round_points(state)
    now += state.config.round_witness_time
    rules.tick(state, now, 1)
    assert state.phase == Phase.RoundWitness and state.round.credited == limits.CREDIT_CLIENTS
    assert len(state.ledger) == limits.CREDIT_CLIENTS
    with pytest.raises(errors.WrongPhase, match="closing"):
        rules.witness(state, derived.witnesses(state)[0], 0, *parts[0], 0)
    rules.tick(state, now, 1)
    assert state.round.credited == 2 * limits.CREDIT_CLIENTS
    rules.tick(state, now, 1)
    assert state.phase == Phase.RoundTrain and state.round.height == 1 and state.round.credited == 0
    assert {e.id: (e.presence, e.compute) for e in state.ledger} == dict(zip(everyone, expected, strict=True))
    # Every stage ran the whole batch, and so did the trainers together.
    assert sum(compute for _, compute in expected) == state.config.global_batch_size * (state.config.num_stages + 1)


def test_a_crediting_tick_stops_after_a_bounded_number_of_evictions() -> None:
    state, now = training()
    everyone = ids(state)
    state.ledger = [LedgerEntry(b"\xf0" + i.to_bytes(2, "big") + bytes(29), 9, 0) for i in range(limits.MAX_CLIENTS)]
    parts = parts_of(state, everyone)
    for w in derived.witnesses(state):
        send(state, w, parts)
    rules.tick(state, now, 1)
    now += state.config.round_witness_time
    rules.tick(state, now, 1)
    assert state.round.credited == limits.CREDIT_EVICTIONS and len(state.ledger) == limits.MAX_CLIENTS
    rules.tick(state, now, 1)
    assert state.round.credited == 2 * limits.CREDIT_EVICTIONS
