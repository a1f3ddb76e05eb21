"""Presence is not enough: a trainer that publishes presences alone while another trains is left out of the proofs
from its third round and removed by the health check in the next (the real judge, the real specification); two
trainers stalled together (the pipeline could not train) stay, however long it lasts."""

from __future__ import annotations

from client.witness.data_accusations import convict
from client.witness.idle import IDLE, IDLE_ROUNDS, candidates, idle_trainers
from client.witness.judge import judge_round, unhealthy_clients
from client.witness.records import Commitment, Presence
from coordinator_program.spec import derived, rules
from coordinator_program.spec.state import CoordinatorState, Phase
from tests.spec.scenario import SMALL, replace
from tests.witness.rounds import honest_round, run_with_keys, shares

LONG_EPOCHS = replace(SMALL, rounds_per_epoch=8, total_steps=20)


def play_round(state: CoordinatorState, keys, now: int, trainers_committing: set[bytes],
               history: dict[int, dict[str, Commitment]]) -> tuple[int, dict[bytes, object]]:
    """One round: every trainer publishes a presence, those in ``trainers_committing`` their commitment too; every
    elected witness judges it as ``witnessing`` does (idle trainers left out, from the earlier rounds' commitments
    in ``history``) and proves it; then the round ends. Returns the time reached and each witness's evidence."""
    commitments, reports = honest_round(state, keys)
    commitments = {k: c for k, c in commitments.items() if bytes.fromhex(k) in trainers_committing}
    presences = {s.client.hex(): Presence.create(keys[s.client], run_id=state.run_id, epoch=state.epoch,
                                                 round=state.round.height) for s in shares(state)}
    height, proofs = state.round.height, {}
    for witness in derived.witnesses(state):
        evidence = judge_round(state, commitments, reports, presences)
        if candidates(state, evidence):
            earlier = [history.get(r, {}) for r in range(height - IDLE_ROUNDS + 1, height)]
            convict(evidence, idle_trainers(state, evidence, earlier), IDLE)
        [(participants, batches)] = evidence.filters(state)
        rules.witness(state, witness, height, participants, batches)
        proofs[witness] = evidence
    history[height] = commitments  # what the DHT holds of the round for later witnesses
    for target in unhealthy_clients(state):
        rules.health_check(state, derived.witnesses(state)[0], target)
    rules.tick(state, now, 7)  # a quorum of proofs ends the round's training early
    if state.phase == Phase.RoundTrain:  # no proof was complete: the round ran to its time limit
        now += state.config.max_round_train_time
        rules.tick(state, now, 7)
    assert state.phase == Phase.RoundWitness
    now += state.config.round_witness_time
    rules.tick(state, now, 7)
    return now, proofs


def test_a_trainer_with_presences_alone_is_removed_after_its_fourth_round() -> None:
    state, keys = run_with_keys(config=LONG_EPOCHS)
    lazy, busy = (s.client for s in shares(state))
    history: dict[int, dict[str, Commitment]] = {}
    now = LONG_EPOCHS.warmup_time
    for height in range(IDLE_ROUNDS + 1):
        assert lazy in {c.id for c in state.clients}, f"still in the run in round {height}"
        now, proofs = play_round(state, keys, now, {busy}, history)
        for evidence in proofs.values():
            left_out = height >= IDLE_ROUNDS - 1
            assert (lazy not in evidence.participants) == left_out, f"round {height}"
            assert (evidence.why_missing.get(lazy) == IDLE) == left_out
            assert evidence.complete == left_out, "from then on nobody waits for its share"
            assert busy in evidence.computed
    assert lazy not in {c.id for c in state.clients} and busy in {c.id for c in state.clients}
    assert next(e.compute for e in state.ledger if e.id == lazy) == 0


def test_trainers_stalled_together_stay() -> None:
    """Nobody commits (a stage that cannot serve): no trainer shows the pipeline could train, so none is idle."""
    state, keys = run_with_keys(config=LONG_EPOCHS)
    trainers = {s.client for s in shares(state)}
    history: dict[int, dict[str, Commitment]] = {}
    now = LONG_EPOCHS.warmup_time
    for _ in range(IDLE_ROUNDS + 2):
        now, proofs = play_round(state, keys, now, set(), history)
        assert all(trainers <= evidence.participants for evidence in proofs.values())
    assert trainers <= {c.id for c in state.clients}


def test_a_lone_trainer_and_a_trainer_that_commits_now_and_then_stay() -> None:
    state, keys = run_with_keys(config=LONG_EPOCHS)
    patchy, busy = (s.client for s in shares(state))
    history: dict[int, dict[str, Commitment]] = {}
    now = LONG_EPOCHS.warmup_time
    for height in range(2 * IDLE_ROUNDS):
        committing = {busy, patchy} if height % (IDLE_ROUNDS - 1) == 0 else {busy}
        now, proofs = play_round(state, keys, now, committing, history)
        assert all(patchy in evidence.participants for evidence in proofs.values()), f"round {height}"

    state, keys = run_with_keys(trainers=1, config=LONG_EPOCHS)
    [lone] = [s.client for s in shares(state)]
    history = {}
    now = LONG_EPOCHS.warmup_time
    for _ in range(IDLE_ROUNDS + 1):
        now, proofs = play_round(state, keys, now, set(), history)
        assert all(lone in evidence.participants for evidence in proofs.values())
