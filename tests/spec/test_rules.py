"""Every transition and rejection of the seed's General Workflow, one behaviour per test."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest

from coordinator_program.spec import derived, errors, limits, rules
from coordinator_program.spec.bloom import build_filter
from coordinator_program.spec.config import Checkpoint, CheckpointKind, Config
from coordinator_program.spec.instructions import CloseRun, InitCoordinator, apply
from coordinator_program.spec.selection import next_seed
from coordinator_program.spec.state import CoordinatorState, Health, Phase, Role, encode_state
from tests.spec.scenario import (
    AUTHORITY,
    MODEL,
    RUN_ID,
    SMALL,
    finish_round,
    full_filter,
    ident,
    join_pipeline,
    new_run,
    replace,
    start_training,
    witness_all,
)


def assert_rejected(state: CoordinatorState, error: type[errors.CoordinatorError], op: Callable[[], None]) -> None:
    """The operation raises ``error`` and the encoded state is byte-identical afterwards."""
    before = encode_state(state)
    with pytest.raises(error):
        op()
    assert encode_state(state) == before


# --- WaitingForMembers and joins ----------------------------------------------------------------------

def test_waiting_needs_min_clients() -> None:
    state = new_run()
    join_pipeline(state, workers=3, trainers=0)
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, 1, 5))
    assert state.phase == Phase.WaitingForMembers


def test_admission_assigns_least_occupied_stages_and_enters_warmup() -> None:
    state = new_run()
    rules.join(state, ident(50), RUN_ID, Role.Worker, 0, ident(50))  # asks for stage 0
    join_pipeline(state, workers=3, trainers=1)
    rules.tick(state, 3, 77)
    assert state.phase == Phase.Warmup and state.phase_start == 3
    assert state.pending == []
    stages = [c.stage for c in state.clients if c.role == Role.Worker]
    assert stages == [0, 1, 2, 0]  # stage 0 asked for is counted first; ties go to the lowest stage
    assert [c.stage for c in state.clients if c.role == Role.Trainer] == [limits.NO_STAGE]
    assert state.round.seed == next_seed(0, 77) and state.round.height == 0  # chained from the zero seed


def test_admission_waits_for_every_stage_and_a_trainer() -> None:
    state = new_run()
    for i in range(4):
        rules.join(state, ident(i + 1), RUN_ID, Role.Worker, 0, ident(i + 1))
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, 1, 5))
    state = new_run()
    join_pipeline(state, workers=4, trainers=0)
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, 1, 5))


@pytest.mark.parametrize("case", ["wrong_run", "duplicate_pending", "duplicate_admitted", "full", "bad_stage",
                                  "trainer_stage", "finished", "uninitialized", "authority"])
def test_join_rejections(case: str) -> None:
    state = new_run()
    ids = join_pipeline(state)
    if case == "wrong_run":
        assert_rejected(state, errors.WrongRunId, lambda: rules.join(state, ident(9), "other", Role.Worker, 255,
                                                                      ident(9)))
    elif case == "duplicate_pending":
        assert_rejected(state, errors.AlreadyJoined, lambda: rules.join(state, ids[0], RUN_ID, Role.Trainer, 255,
                                                                         ids[0]))
    elif case == "duplicate_admitted":
        rules.tick(state, 0, 1)
        assert_rejected(state, errors.AlreadyJoined, lambda: rules.join(state, ids[0], RUN_ID, Role.Trainer, 255,
                                                                         ids[0]))
    elif case == "full":
        join_pipeline(state, workers=4, trainers=0, first=20)
        assert len(state.pending) == SMALL.max_clients
        assert_rejected(state, errors.RunFull, lambda: rules.join(state, ident(9), RUN_ID, Role.Worker, 255,
                                                                   ident(9)))
    elif case == "bad_stage":
        assert_rejected(state, errors.InvalidJoin, lambda: rules.join(state, ident(9), RUN_ID, Role.Worker, 3,
                                                                       ident(9)))
    elif case == "trainer_stage":
        assert_rejected(state, errors.InvalidJoin, lambda: rules.join(state, ident(9), RUN_ID, Role.Trainer, 0,
                                                                       ident(9)))
    elif case == "finished":
        state.phase = Phase.Finished
        assert_rejected(state, errors.RunFinished, lambda: rules.join(state, ident(9), RUN_ID, Role.Worker, 255,
                                                                       ident(9)))
    elif case == "uninitialized":
        fresh = rules.init_coordinator(RUN_ID, AUTHORITY, bytes(32), now=0)
        assert_rejected(fresh, errors.NotInitialized, lambda: rules.join(fresh, ident(9), RUN_ID, Role.Worker,
                                                                          255, ident(9)))
    elif case == "authority":
        gated = new_run(join_authority=b"\x77" * 32)
        assert_rejected(gated, errors.NotAuthorized, lambda: rules.join(gated, ident(9), RUN_ID, Role.Worker, 255,
                                                                         ident(9)))
        rules.join(gated, ident(9), RUN_ID, Role.Worker, 255, b"\x77" * 32)
        assert gated.pending[-1].id == ident(9)


def test_joiner_mid_round_waits_for_next_epoch() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    late = ident(40)
    rules.join(state, late, RUN_ID, Role.Worker, limits.NO_STAGE, late)
    assert state.pending[-1].id == late and state.client_index(late) is None
    while state.phase != Phase.Cooldown:
        now = finish_round(state, now)
        assert state.client_index(late) is None
    rules.tick(state, now + SMALL.cooldown_time, 5)
    assert state.phase == Phase.WaitingForMembers
    assert [p.id for p in state.pending][-1] == late
    rules.tick(state, now + SMALL.cooldown_time, 6)
    assert state.phase == Phase.Warmup and state.client_index(late) is not None


def test_withdraw_pending_and_unknown() -> None:
    state = new_run()
    ids = join_pipeline(state)
    rules.withdraw(state, ids[0])
    assert state.pending_index(ids[0]) is None
    assert_rejected(state, errors.NotJoined, lambda: rules.withdraw(state, ids[0]))


# --- Warmup -------------------------------------------------------------------------------------------

def test_warmup_times_out_into_first_round() -> None:
    state = new_run()
    join_pipeline(state)
    rules.tick(state, 10, 1)
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, 10 + SMALL.warmup_time - 1, 2))
    rules.tick(state, 10 + SMALL.warmup_time, 2)
    assert state.phase == Phase.RoundTrain
    assert (state.round.height, state.round.seed, state.round.data_index) == (0, next_seed(next_seed(0, 1), 2), 0)


def test_warmup_witness_quorum_starts_training_early() -> None:
    state = new_run()
    join_pipeline(state)
    rules.tick(state, 10, 1)
    witness_all(state)
    rules.tick(state, 11, 2)
    assert state.phase == Phase.RoundTrain and state.phase_start == 11


def test_warmup_witness_rejections() -> None:
    state = new_run()
    ids = join_pipeline(state)
    rules.tick(state, 10, 1)
    f = full_filter(state)
    outsider = next(i for i in ids if i not in derived.witnesses(state))
    assert_rejected(state, errors.NotAWitness, lambda: rules.warmup_witness(state, outsider, f, f))
    assert_rejected(state, errors.NotAClient, lambda: rules.warmup_witness(state, ident(99), f, f))
    w, other = derived.witnesses(state)[:2]
    assert_rejected(state, errors.BadFilter, lambda: rules.warmup_witness(state, w, f + b"\0", f))
    rules.warmup_witness(state, w, f, f)
    assert_rejected(state, errors.DuplicateWitness, lambda: rules.warmup_witness(state, w, f, f))
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, 11, 2))  # one proof is no quorum
    rules.warmup_witness(state, other, f, f)
    rules.tick(state, 11, 2)
    assert_rejected(state, errors.WrongPhase, lambda: rules.warmup_witness(state, w, f, f))


def test_dropped_client_in_warmup_returns_run_to_waiting() -> None:
    state = new_run()
    ids = join_pipeline(state)
    rules.tick(state, 10, 1)
    stages = {c.id: c.stage for c in state.clients}
    rules.withdraw(state, ids[1])
    rules.tick(state, 11, 2)
    assert state.phase == Phase.WaitingForMembers and state.clients == []
    assert [p.id for p in state.pending] == [i for i in ids if i != ids[1]]
    assert all(p.stage == stages[p.id] for p in state.pending)


def test_dropped_client_in_warmup_is_removed_when_enough_remain() -> None:
    state = new_run()
    ids = join_pipeline(state, workers=4)
    rules.tick(state, 10, 1)
    spare = next(c.id for c in state.clients if c.stage == 0 and c.role == Role.Worker)
    rules.withdraw(state, spare)
    rules.tick(state, 11, 2)
    assert state.phase == Phase.Warmup and state.client_index(spare) is None and len(state.clients) == 4
    assert len(ids) == 5


# --- RoundTrain and witnessing ------------------------------------------------------------------------

def test_round_train_times_out_into_witness() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, now + SMALL.max_round_train_time - 1, 3))
    rules.tick(state, now + SMALL.max_round_train_time, 3)
    assert state.phase == Phase.RoundWitness


def test_opportunistic_witnessing_ends_training_early() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    ws = derived.witnesses(state)
    f = full_filter(state)
    rules.witness(state, ws[0], 0, f, f)
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, now + 1, 3))
    rules.witness(state, ws[1], 0, f, f)
    rules.tick(state, now + 1, 3)
    assert state.phase == Phase.RoundWitness and state.phase_start == now + 1


def test_a_stage_s_last_worker_withdrawing_ends_training_at_once() -> None:
    """Nothing more can be trained once a stage has no healthy worker: the round goes to its witnesses at the next
    tick rather than wait out max_round_train_time; a stage that keeps a worker trains on, even with fewer healthy
    clients than min_clients (the epoch ends with the round, not before it)."""
    state = new_run(replace(SMALL, min_clients=5))
    join_pipeline(state, workers=4)  # stage 0 has two workers; five clients in all
    now = start_training(state)
    pair = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 0]
    alone = next(c.id for c in state.clients if c.role == Role.Worker and c.stage == 1)
    rules.withdraw(state, pair[0])
    assert len([c for c in state.clients if c.health == Health.Healthy]) < state.config.min_clients
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, now + 1, 3))
    rules.withdraw(state, alone)
    rules.tick(state, now + 1, 3)
    assert state.phase == Phase.RoundWitness and state.phase_start == now + 1


def test_witness_rejections() -> None:
    state = new_run()
    ids = join_pipeline(state)
    now = start_training(state)
    f = full_filter(state)
    ws = derived.witnesses(state)
    outsider = next(i for i in ids if i not in ws)
    assert_rejected(state, errors.NotAClient, lambda: rules.witness(state, ident(99), 0, f, f))
    assert_rejected(state, errors.NotAWitness, lambda: rules.witness(state, outsider, 0, f, f))
    assert_rejected(state, errors.StaleRound, lambda: rules.witness(state, ws[0], 1, f, f))
    assert_rejected(state, errors.BadFilter, lambda: rules.witness(state, ws[0], 0, f[:-1], f))
    rules.witness(state, ws[0], 0, f, f)
    assert_rejected(state, errors.DuplicateWitness, lambda: rules.witness(state, ws[0], 0, f, f))
    rules.withdraw(state, ws[1])
    assert_rejected(state, errors.NotHealthy, lambda: rules.witness(state, ws[1], 0, f, f))
    rules.witness(state, ws[2], 0, f, f)
    rules.tick(state, now, 3)
    rules.tick(state, now + SMALL.round_witness_time, 4)
    state.phase = Phase.Cooldown
    assert_rejected(state, errors.WrongPhase, lambda: rules.witness(state, ws[0], 1, f, f))


# --- RoundWitness -------------------------------------------------------------------------------------

def test_witness_phase_times_out_into_next_round() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    witness_all(state)
    rules.tick(state, now, 3)
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, now + SMALL.round_witness_time - 1, 4))
    round_zero = state.round.seed
    rules.tick(state, now + SMALL.round_witness_time, 42)
    assert state.phase == Phase.RoundTrain and state.step == 1
    assert (state.round.height, state.round.seed, state.round.data_index) == (
        1, next_seed(round_zero, 42), SMALL.global_batch_size)


def test_last_round_of_epoch_enters_cooldown_with_p2p_checkpoint() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    for _ in range(SMALL.rounds_per_epoch):
        now = finish_round(state, now)
    assert state.phase == Phase.Cooldown and state.step == SMALL.rounds_per_epoch
    assert [cp.kind for cp in state.checkpoints] == [CheckpointKind.P2P] * SMALL.num_stages + [
        CheckpointKind.Fresh] * (limits.MAX_STAGES - SMALL.num_stages)


def test_missing_quorum_ends_epoch() -> None:
    state = new_run()
    ids = join_pipeline(state)
    now = start_training(state)
    f = full_filter(state)
    rules.witness(state, derived.witnesses(state)[0], 0, f, f)  # one proof of the two the round needs
    rules.tick(state, now + SMALL.max_round_train_time, 3)
    rules.tick(state, now + SMALL.max_round_train_time + SMALL.round_witness_time, 4)
    assert state.phase == Phase.Cooldown and state.step == 1
    assert [c.id for c in state.clients] == ids, "a proved round keeps its healthy clients for the next epoch"


def test_total_steps_finish_the_run() -> None:
    state = new_run(replace(SMALL, total_steps=2, rounds_per_epoch=5))
    join_pipeline(state)
    now = start_training(state)
    now = finish_round(state, now)
    now = finish_round(state, now)
    assert state.phase == Phase.Cooldown and state.step == 2
    rules.tick(state, now + SMALL.cooldown_time, 1)
    assert state.phase == Phase.Finished and state.clients == []
    assert_rejected(state, errors.RunFinished, lambda: rules.tick(state, now + 100, 1))


def _train_to_round_one(state: CoordinatorState, members: list[bytes] | None = None) -> int:
    now = start_training(state)
    return finish_round(state, now, members=members)


def test_health_check_removes_unseen_client_at_round_end() -> None:
    state = new_run(replace(SMALL, rounds_per_epoch=5))
    join_pipeline(state, workers=4)
    rules.tick(state, 0, 11)
    spare = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 0][-1]
    rules.tick(state, SMALL.warmup_time, 12)
    seen = [c.id for c in state.clients if c.id != spare]
    now = finish_round(state, SMALL.warmup_time, members=seen)
    checker = seen[0]
    assert_rejected(state, errors.ClientHealthy, lambda: rules.health_check(state, checker, seen[1]))
    rules.health_check(state, checker, spare)
    assert state.clients[state.client_index(spare)].health == Health.Unhealthy
    assert_rejected(state, errors.AlreadyMarked, lambda: rules.health_check(state, checker, spare))
    now = finish_round(state, now)
    assert state.phase == Phase.RoundTrain and state.client_index(spare) is None


def test_health_check_rejections() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    c = state.clients
    assert_rejected(state, errors.NoPreviousRound, lambda: rules.health_check(state, c[0].id, c[1].id))
    finish_round(state, now)
    assert_rejected(state, errors.NotAClient, lambda: rules.health_check(state, ident(99), c[1].id))
    assert_rejected(state, errors.UnknownClient, lambda: rules.health_check(state, c[0].id, ident(99)))
    state.phase = Phase.Cooldown
    assert_rejected(state, errors.WrongPhase, lambda: rules.health_check(state, c[0].id, c[1].id))


def test_emptied_stage_ends_epoch_but_a_surviving_peer_keeps_it() -> None:
    state = new_run(replace(SMALL, min_clients=4, rounds_per_epoch=5))
    join_pipeline(state, workers=4)  # stage 0 has two workers
    now = start_training(state)
    pair = [c.id for c in state.clients if c.role == Role.Worker and c.stage == 0]
    alone = next(c.id for c in state.clients if c.role == Role.Worker and c.stage == 1)
    rules.withdraw(state, pair[0])
    now = finish_round(state, now)
    assert state.phase == Phase.RoundTrain, "stage 0 still has a worker: training goes on"
    rules.withdraw(state, alone)
    now = finish_round(state, now)
    assert state.phase == Phase.Cooldown, "stage 1 emptied: the epoch ends"


# --- Cooldown, checkpoints, epochs --------------------------------------------------------------------

def _to_cooldown(state: CoordinatorState) -> int:
    now = start_training(state)
    while state.phase != Phase.Cooldown:
        now = finish_round(state, now)
    return now


def test_cooldown_timeout_starts_next_epoch_with_healthy_clients_pending() -> None:
    state = new_run()
    ids = join_pipeline(state)
    now = start_training(state)
    while state.phase != Phase.Cooldown:
        now = finish_round(state, now)
    stages = {c.id: c.stage for c in state.clients}
    leaver = state.clients[-1].id
    rules.withdraw(state, leaver)
    rules.tick(state, now + SMALL.cooldown_time, 1)
    assert state.phase == Phase.WaitingForMembers and state.epoch == 1 and state.clients == []
    assert [p.id for p in state.pending] == [i for i in ids if i != leaver]
    assert all(p.stage == stages[p.id] for p in state.pending)


def test_complete_checkpoint_ends_cooldown_early() -> None:
    state = new_run()
    join_pipeline(state)
    now = _to_cooldown(state)
    workers = [c for c in state.clients if c.role == Role.Worker]
    trainer = next(c for c in state.clients if c.role == Role.Trainer)
    assert_rejected(state, errors.NotAWorker, lambda: rules.checkpoint(state, trainer.id, CheckpointKind.Hub,
                                                                        "org/model", "abc"))
    assert_rejected(state, errors.InvalidCheckpoint, lambda: rules.checkpoint(state, workers[0].id,
                                                                               CheckpointKind.P2P, "x", ""))
    for w in workers[:-1]:
        rules.checkpoint(state, w.id, CheckpointKind.Hub, "org/model", "abc")
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, now + 1, 1))
    rules.checkpoint(state, workers[-1].id, CheckpointKind.Hub, "org/model", "abc")
    assert state.checkpoints[:SMALL.num_stages] == [Checkpoint(CheckpointKind.Hub, "org/model", "abc")] * 3
    rules.tick(state, now + 1, 1)
    assert state.phase == Phase.WaitingForMembers


def test_stages_saved_at_different_places_end_cooldown_early() -> None:
    """Each stage has its own place: contributors may save to repos of their own."""
    state = new_run()
    join_pipeline(state)
    now = _to_cooldown(state)
    workers = sorted((c for c in state.clients if c.role == Role.Worker), key=lambda c: c.stage)
    for w in workers:
        rules.checkpoint(state, w.id, CheckpointKind.Hub, f"org/stage-{w.stage}", "epoch-0")
    assert state.checkpoints[:3] == [Checkpoint(CheckpointKind.Hub, f"org/stage-{s}", "epoch-0") for s in range(3)]
    rules.tick(state, now + 1, 1)
    assert state.phase == Phase.WaitingForMembers


def test_a_worker_cannot_erase_or_repoint_another_stages_checkpoint() -> None:
    """Issue 20, 5: a report naming another place used to replace the whole record and keep only the reporter's
    stage, so the next epoch's joiners of every other stage found no checkpoint. Now it sets only its own stage."""
    state = new_run()
    join_pipeline(state)
    now = _to_cooldown(state)
    by_stage = {c.stage: c for c in state.clients if c.role == Role.Worker}
    honest = Checkpoint(CheckpointKind.Hub, "org/model", "epoch-0")
    for stage in (0, 2):
        rules.checkpoint(state, by_stage[stage].id, honest.kind, honest.repo, honest.revision)
    rules.checkpoint(state, by_stage[1].id, CheckpointKind.Local, "/attacker", "elsewhere")
    assert state.checkpoints[0] == state.checkpoints[2] == honest
    assert state.checkpoints[1] == Checkpoint(CheckpointKind.Local, "/attacker", "elsewhere")
    rules.tick(state, now + 1, 1)  # every stage is saved: Cooldown ends, and the record stays for the joiners
    assert state.phase == Phase.WaitingForMembers and state.checkpoints[0] == state.checkpoints[2] == honest


def test_a_stage_keeps_its_first_reported_place_for_the_epoch() -> None:
    """A second worker of a stage confirms the stage's place or is refused; it never moves it."""
    state = new_run()
    join_pipeline(state, workers=6)
    _to_cooldown(state)
    head = [c for c in state.clients if c.role == Role.Worker and c.stage == 0]
    assert len(head) == 2
    rules.checkpoint(state, head[0].id, CheckpointKind.Hub, "org/model", "epoch-0")
    rules.checkpoint(state, head[1].id, CheckpointKind.Hub, "org/model", "epoch-0")  # the same place: accepted
    assert_rejected(state, errors.CheckpointTaken, lambda: rules.checkpoint(
        state, head[1].id, CheckpointKind.Hub, "org/other", "epoch-0"))
    assert state.checkpoints[0] == Checkpoint(CheckpointKind.Hub, "org/model", "epoch-0")
    assert all(cp.kind == CheckpointKind.P2P for cp in state.checkpoints[1:3])


def test_checkpoint_outside_cooldown_is_rejected() -> None:
    state = new_run()
    join_pipeline(state)
    start_training(state)
    w = state.clients[0].id
    assert_rejected(state, errors.WrongPhase, lambda: rules.checkpoint(state, w, CheckpointKind.Hub, "a/b", "c"))


def test_pause_takes_effect_at_end_of_epoch_and_resume_restarts() -> None:
    state = new_run()
    join_pipeline(state)
    now = start_training(state)
    rules.set_paused(state, AUTHORITY, True)
    assert state.phase == Phase.RoundTrain
    while state.phase != Phase.Cooldown:
        now = finish_round(state, now)
    rules.tick(state, now + SMALL.cooldown_time, 1)
    assert state.phase == Phase.Paused
    assert_rejected(state, errors.NothingToTick, lambda: rules.tick(state, now + 100, 1))
    rules.set_paused(state, AUTHORITY, False)
    rules.tick(state, now + 101, 1)
    assert state.phase == Phase.WaitingForMembers


def test_pause_in_waiting_and_authority_checks() -> None:
    state = new_run()
    assert_rejected(state, errors.NotAuthorized, lambda: rules.set_paused(state, ident(1), True))
    rules.set_paused(state, AUTHORITY, True)
    rules.tick(state, 5, 1)
    assert state.phase == Phase.Paused
    fresh = rules.init_coordinator(RUN_ID, AUTHORITY, bytes(32), now=0)
    assert_rejected(fresh, errors.NotInitialized, lambda: rules.set_paused(fresh, AUTHORITY, False))


def test_update_rules() -> None:
    state = new_run(started=False)
    assert state.phase == Phase.Paused
    assert_rejected(state, errors.NotAuthorized, lambda: rules.update(state, ident(1), SMALL, MODEL, Checkpoint()))
    bad = replace(SMALL, witness_quorum=1)  # not a strict majority of 3 witnesses
    assert_rejected(state, errors.InvalidConfig, lambda: rules.update(state, AUTHORITY, bad, MODEL, Checkpoint()))
    assert_rejected(state, errors.InvalidCheckpoint, lambda: rules.update(
        state, AUTHORITY, SMALL, MODEL, Checkpoint(CheckpointKind.P2P)))
    assert_rejected(state, errors.InvalidCheckpoint, lambda: rules.update(
        state, AUTHORITY, SMALL, MODEL, Checkpoint(CheckpointKind.Hub, "", "main")))
    start = Checkpoint(CheckpointKind.Hub, "org/m", "main")
    rules.update(state, AUTHORITY, SMALL, MODEL, start)
    assert state.checkpoints == [start] * SMALL.num_stages + [Checkpoint()] * (limits.MAX_STAGES - SMALL.num_stages)
    rules.set_paused(state, AUTHORITY, False)
    rules.tick(state, 0, 1)
    assert_rejected(state, errors.NotHalted, lambda: rules.update(state, AUTHORITY, SMALL, MODEL, Checkpoint()))


def test_close_run_only_by_the_main_authority_of_a_halted_run() -> None:
    fresh = rules.init_coordinator(RUN_ID, AUTHORITY, bytes(32), now=0)
    assert_rejected(fresh, errors.NotAuthorized, lambda: rules.close_run(fresh, ident(1)))
    rules.close_run(fresh, AUTHORITY)  # Uninitialized
    paused = new_run(started=False)
    rules.close_run(paused, AUTHORITY)
    state = new_run(replace(SMALL, total_steps=1))
    assert_rejected(state, errors.NotHalted, lambda: rules.close_run(state, AUTHORITY))  # WaitingForMembers
    assert_rejected(state, errors.NotAuthorized, lambda: rules.close_run(state, ident(1)))  # authority first
    join_pipeline(state)
    now = start_training(state)
    assert_rejected(state, errors.NotHalted, lambda: rules.close_run(state, AUTHORITY))  # RoundTrain
    now = finish_round(state, now)
    assert state.phase == Phase.Cooldown
    assert_rejected(state, errors.NotHalted, lambda: rules.close_run(state, AUTHORITY))
    rules.tick(state, now + SMALL.cooldown_time, 1)
    assert state.phase == Phase.Finished
    assert_rejected(state, errors.NotAuthorized, lambda: rules.close_run(state, ident(1)))
    before = encode_state(state)
    rules.close_run(state, AUTHORITY)
    assert encode_state(state) == before  # validation only: the caller discards the state


@pytest.mark.parametrize("ix", [CloseRun(), InitCoordinator(RUN_ID, AUTHORITY, bytes(32))], ids=lambda ix: ix.NAME)
def test_apply_refuses_the_instructions_that_create_or_close_a_run(ix: CloseRun | InitCoordinator) -> None:
    state = new_run(started=False)
    assert_rejected(state, errors.MalformedInstruction, lambda: apply(state, ix, AUTHORITY, 0, 1))


def test_run_id_rules() -> None:
    with pytest.raises(errors.InvalidRunId):
        rules.init_coordinator("has space", AUTHORITY, bytes(32), now=0)
    with pytest.raises(errors.InvalidRunId):
        rules.init_coordinator("x" * 33, AUTHORITY, bytes(32), now=0)
    assert rules.init_coordinator("a.b-c_1", AUTHORITY, bytes(32), now=0).run_id == "a.b-c_1"


def test_every_accepted_operation_bumps_the_nonce() -> None:
    state = new_run()
    nonce = state.nonce
    join_pipeline(state)
    assert state.nonce == nonce + 4
    rules.tick(state, 0, 1)
    assert state.nonce == nonce + 5


def test_bloom_sizes_follow_the_config() -> None:
    config: Config = SMALL
    assert len(build_filter(config, [])) == config.bloom_bytes == (11 * 11 + 7) // 8


def test_a_run_instance_names_one_creation_of_a_run_id() -> None:
    first = rules.init_coordinator(RUN_ID, AUTHORITY, bytes(32), now=1_700_000_000)
    assert derived.run_instance(first) == derived.run_instance(copy.deepcopy(first))
    assert derived.run_instance(first).startswith(RUN_ID + ".")
    later = rules.init_coordinator(RUN_ID, AUTHORITY, bytes(32), now=1_700_000_001)
    other_creator = rules.init_coordinator(RUN_ID, bytes([9]) * 32, bytes(32), now=1_700_000_000)
    assert len({derived.run_instance(s) for s in (first, later, other_creator)}) == 3
