"""The points ledger (issue 14): presence and compute earned at the end of each round on a quorum of proofs, shared
as the rules say, kept across epochs, and a full ledger making room for a new earner."""

from __future__ import annotations

from coordinator_program.spec import derived, limits, points, rules
from coordinator_program.spec.bloom import build_filter, compute_key, participant_key
from coordinator_program.spec.state import CoordinatorState, LedgerEntry, Phase, Role
from tests.spec.scenario import RUN_ID, SMALL, ident, join_pipeline, new_run, replace, start_training

EVERYONE = None


def prove(state: CoordinatorState, present: list[bytes], worked: list[bytes],
          witnesses: list[bytes] | None = EVERYONE) -> None:
    """``witnesses`` (every elected one by default) prove ``present`` present and ``worked`` working."""
    bloom = build_filter(state.config, [participant_key(i) for i in present] + [compute_key(i) for i in worked])
    for w in derived.witnesses(state) if witnesses is None else witnesses:
        rules.witness(state, w, state.round.height, bloom, build_filter(state.config, []))


def end_round(state: CoordinatorState, now: int) -> int:
    """Tick through RoundWitness (after the train time if the proofs did not end it early)."""
    if state.phase == Phase.RoundTrain:
        now += state.config.max_round_train_time
        rules.tick(state, now, 3)
    now += state.config.round_witness_time
    rules.tick(state, now, 3)
    return now


def ledger_points(state: CoordinatorState) -> dict[bytes, tuple[int, int]]:
    return {e.id: (e.presence, e.compute) for e in state.ledger}


def training(workers: int = 3, trainers: int = 1, config=SMALL) -> tuple[CoordinatorState, int]:
    state = new_run(config)
    join_pipeline(state, workers=workers, trainers=trainers)
    return state, start_training(state)


def test_a_counted_round_pays_presence_and_the_samples_each_client_worked() -> None:
    state, now = training(workers=4, trainers=2)
    ids = [c.id for c in state.clients]
    assigned = {a.client: a.size for a in derived.data_assignment(state)}
    prove(state, ids, ids)
    end_round(state, now)
    by_stage = {c.id: c.stage for c in state.clients if c.role == Role.Worker}
    sharing = [i for i in by_stage if by_stage[i] == 0]
    assert len(sharing) == 2, "stage 0 has two workers"
    for client in ids:
        expected = assigned[client] if client in assigned else (5 if client in sharing else 10)
        assert ledger_points(state)[client] == (1, expected)
    assert sum(assigned.values()) == SMALL.global_batch_size


def test_presence_without_counted_work_earns_presence_only() -> None:
    state, now = training()
    ids = [c.id for c in state.clients]
    prove(state, ids, [])
    end_round(state, now)
    assert ledger_points(state) == {i: (1, 0) for i in ids}


def test_a_stage_shares_its_batch_among_its_counted_workers_remainder_to_the_first() -> None:
    state = new_run(replace(SMALL, min_clients=6))
    for i in range(3):
        rules.join(state, ident(i + 1), RUN_ID, Role.Worker, 0, ident(i + 1))
    join_pipeline(state, workers=2, trainers=1, first=10)
    now = start_training(state)
    stage0 = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 0]
    ids = [c.id for c in state.clients]
    prove(state, ids, ids)
    end_round(state, now)
    assert [ledger_points(state)[i][1] for i in stage0] == [4, 3, 3]  # 10 samples: 10 // 3 each, the remainder first

    # Only two of them counted next round: 5 each; the uncounted one earns presence only.
    ids = [c.id for c in state.clients]
    prove(state, ids, [i for i in ids if i != stage0[0]])
    end_round(state, now + 100)
    assert [ledger_points(state)[i] for i in stage0] == [(2, 4), (2, 8), (2, 8)]


def test_one_witness_of_three_can_neither_award_nor_withhold_points() -> None:
    """Quorum 2 of 3: a lying witness that names a client the other two left out gives it nothing, and one that
    leaves an honest client out takes nothing from it."""
    state, now = training(workers=3, trainers=2)
    liar, *honest = derived.witnesses(state)
    victim = next(c.id for c in state.clients if c.id != liar)
    favourite = next(c.id for c in state.clients if c.id not in (liar, victim))
    ids = [c.id for c in state.clients]
    others = [i for i in ids if i != favourite]
    prove(state, ids, ids, [liar])  # the liar names its favourite, which the honest witnesses leave out
    prove(state, others, others, honest[:1])
    prove(state, others, others, honest[1:])
    assert state.presence_votes[state.client_index(favourite)] == 1
    end_round(state, now)
    assert favourite not in ledger_points(state)

    liar, *honest = derived.witnesses(state)
    without_victim = [c.id for c in state.clients if c.id != victim]
    everyone = [c.id for c in state.clients]
    prove(state, without_victim, without_victim, [liar])
    prove(state, everyone, everyone, honest)
    before = ledger_points(state)[victim]
    end_round(state, now + 100)
    gained = ledger_points(state)[victim][0] - before[0], ledger_points(state)[victim][1] - before[1]
    assert gained[0] == 1 and gained[1] > 0


def test_warmup_proofs_and_unproven_rounds_earn_nothing() -> None:
    state = new_run()
    join_pipeline(state)
    rules.tick(state, 0, 11)
    ids = [c.id for c in state.clients]
    bloom = build_filter(state.config, [participant_key(i) for i in ids] + [compute_key(i) for i in ids])
    for w in derived.witnesses(state):
        rules.warmup_witness(state, w, bloom, build_filter(state.config, []))
    rules.tick(state, 0, 12)  # the quorum of warmup proofs starts round 0
    assert state.phase == Phase.RoundTrain and not any(state.presence_votes)
    end_round(state, 0)  # nobody proved round 0
    assert state.ledger == [] and state.phase == Phase.Cooldown


def test_points_survive_the_epoch_and_keep_adding_up() -> None:
    config = replace(SMALL, rounds_per_epoch=2, total_steps=10)
    state, now = training(config=config)
    for _ in range(2):
        ids = [c.id for c in state.clients]
        prove(state, ids, ids)
        now = end_round(state, now)
    assert state.phase == Phase.Cooldown and state.epoch == 0
    after_epoch_0 = ledger_points(state)
    now += config.cooldown_time
    rules.tick(state, now, 4)
    assert state.phase == Phase.WaitingForMembers and ledger_points(state) == after_epoch_0
    now = start_training(state, now)
    ids = [c.id for c in state.clients]
    prove(state, ids, ids)
    end_round(state, now)
    assert all(ledger_points(state)[i][0] == 3 for i in ids)


def full_ledger() -> list[LedgerEntry]:
    """MAX_CLIENTS entries, sorted by id (0x80 0x0000.., 0x80 0x0001.., ...): 5 points each but entries 16 and 32,
    2."""
    entries = [LedgerEntry(b"\x80" + i.to_bytes(2, "big") + bytes(29), 5, 0) for i in range(limits.MAX_CLIENTS)]
    entries[16].presence = entries[32].presence = 2
    return entries


def test_a_new_earner_in_a_full_ledger_replaces_the_fewest_points_first_on_ties() -> None:
    ledger = full_ledger()
    fewest = [e.id for e in ledger if e.presence == 2]
    points.award(ledger, b"\x01" * 32, 3, 0)  # sorts first; of the two 2-point entries the first goes
    assert len(ledger) == limits.MAX_CLIENTS and ledger[0].id == b"\x01" * 32
    assert fewest[0] not in [e.id for e in ledger] and fewest[1] in [e.id for e in ledger]
    points.award(ledger, b"\xff" * 32, 0, 7)  # sorts last; the other 2-point entry goes
    assert ledger[-1] == LedgerEntry(b"\xff" * 32, 0, 7) and fewest[1] not in [e.id for e in ledger]
    points.award(ledger, b"\x50" * 32, 1, 0)  # now the 3-point newcomer has the fewest
    assert ledger[0].id == b"\x50" * 32 and b"\x01" * 32 not in [e.id for e in ledger]
    assert [e.id for e in ledger] == sorted(e.id for e in ledger)
    points.award(ledger, b"\x50" * 32, 1, 1)  # an existing earner just adds up
    assert ledger[0] == LedgerEntry(b"\x50" * 32, 2, 1) and len(ledger) == limits.MAX_CLIENTS


def test_points_stop_at_the_u32_limit() -> None:
    ledger = [LedgerEntry(b"\x01" * 32, points.POINTS_MAX, points.POINTS_MAX - 3)]
    points.award(ledger, b"\x01" * 32, 1, 10)
    assert ledger == [LedgerEntry(b"\x01" * 32, points.POINTS_MAX, points.POINTS_MAX)]
