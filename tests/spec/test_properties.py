"""Property tests: random operation sequences keep the coordinator's invariants after every step."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Callable

from hypothesis import HealthCheck as HypothesisHealthCheck
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator_program.spec import derived, errors, limits, rules
from coordinator_program.spec.beacon import NO_COMMITMENT, join_commitment, seed_commitment
from coordinator_program.spec.bloom import build_filter, compute_key, participant_key
from coordinator_program.spec.config import Checkpoint, CheckpointKind
from coordinator_program.spec.instructions import (
    CheckpointReport,
    CommitSeed,
    HealthCheck,
    Instruction,
    JoinRun,
    RevealSeed,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
    apply,
    decode_instruction,
)
from coordinator_program.spec.state import (
    CoordinatorState,
    Health,
    Phase,
    Role,
    decode_state,
    encode_state,
    unelected,
)
from tests.spec.scenario import AUTHORITY, MODEL, RUN_ID, SMALL, ident, new_run

IDS = [ident(i) for i in range(1, 11)]
RUN_PHASES = (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness)
VISITED: set[Phase] = set()

identity = st.sampled_from(IDS)


def tick_op() -> st.SearchStrategy[tuple]:
    return st.tuples(st.just("tick"), st.sampled_from([0, 1, 2, 3, 5, 20, 60]))


def witness_op() -> st.SearchStrategy[tuple]:
    return st.tuples(st.just("witness"), st.integers(0, 12) | st.just(0),
                     st.sampled_from(["all", "half", "none", "short"]), st.just(0) | st.integers(-1, 1))


def seed_op() -> st.SearchStrategy[tuple]:
    """A commitment to the next seed or a reveal: by the index-th candidate (``_seeder``), for the current round or
    a neighbour, opening its commitment with the right secret or a wrong one."""
    return st.tuples(st.sampled_from(["commit", "reveal"]), st.integers(0, 12) | st.just(0) | st.just(0),
                     st.just(0) | st.integers(-1, 1), st.sampled_from([True, True, False]))


def health_op() -> st.SearchStrategy[tuple]:
    return st.tuples(st.just("health"), st.integers(0, 12), st.integers(0, 12))


# one_of draws each distinct strategy equally often (and ignores a strategy listed twice), so the operations
# that need to come in runs have several copies: most interesting states need several ticks in a row, and a
# health check is taken only after a round that reached its quorum of proofs.
op = st.one_of(
    st.tuples(st.just("join"), identity, st.sampled_from(list(Role)), st.sampled_from([0, 1, 2, 3, 255]),
              st.sampled_from([RUN_ID, "other-run"]), st.sampled_from([False, False, False, True])),
    st.tuples(st.just("withdraw"), identity),
    *(tick_op() for _ in range(3)),
    *(witness_op() for _ in range(2)),
    *(seed_op() for _ in range(2)),
    *(health_op() for _ in range(3)),
    st.tuples(st.just("checkpoint"), st.integers(0, 12), st.sampled_from(list(CheckpointKind)),
              st.sampled_from(["org/a", "org/b", ""])),
    st.tuples(st.just("pause"), st.booleans(), st.booleans()),
    st.tuples(st.just("update"), st.booleans(), st.integers(1, 9)),
)


def _member(state: CoordinatorState, index: int) -> bytes:
    """The index-th client if there is one, else an identity that may or may not be pending."""
    return state.clients[index].id if index < len(state.clients) else IDS[index % len(IDS)]


def _prover(state: CoordinatorState, index: int) -> bytes:
    """The index-th of: the elected witnesses yet to prove, then the clients, then other identities. Most
    proofs drawn are thus taken, so that rounds reach their quorum on filters that leave clients out, and
    health checks find clients to remove."""
    elected = derived.witnesses(state) if state.clients else []
    waiting = [w for position, w in enumerate(elected) if not state.round.witnessed >> position & 1]
    candidates = waiting + [c.id for c in state.clients]
    return candidates[index] if index < len(candidates) else IDS[index % len(IDS)]


def _seeder(state: CoordinatorState, index: int, reveal: bool) -> bytes:
    """The index-th of: the elected witnesses yet to commit (to reveal, for a reveal; in a revealing warmup, the
    clients yet to open their join's commitment), then the clients, then other identities; most commitments and
    reveals drawn thus come from a client that may send them."""
    elected = derived.witnesses(state) if state.clients else []
    mask = state.round.committed & ~state.round.revealed if reveal else ~state.round.committed
    waiting = [w for position, w in enumerate(elected) if mask >> position & 1]
    if derived.revealing(state):
        waiting = [c.id for c in state.clients if c.commitment != NO_COMMITMENT]
    candidates = waiting + [c.id for c in state.clients]
    return candidates[index] if index < len(candidates) else IDS[index % len(IDS)]


def _suspect(state: CoordinatorState, index: int) -> bytes:
    """The index-th of: the healthy clients a quorum of the previous round's proofs left out, then the clients, then
    other identities; most health checks drawn thus name a client they may remove."""
    missed = [c.id for c in state.clients if c.health == Health.Healthy and derived.missed_by_quorum(state, c.id)]
    candidates = missed + [c.id for c in state.clients]
    return candidates[index] if index < len(candidates) else IDS[index % len(IDS)]


def secret_of(client: bytes, seed: int) -> bytes:
    """The secret a generated witness commits to for the round of ``seed``: fixed, so that its reveal can open it."""
    return hashlib.sha256(b"secret" + client + seed.to_bytes(8, "little")).digest()


def join_secret(client: bytes) -> bytes:
    """The secret a generated joiner commits to when it joins: fixed, so that its reveal in the warmup can open it."""
    return hashlib.sha256(b"join" + client).digest()


def committed_join(run_id: str, role: Role, stage: int, client: bytes) -> JoinRun:
    """A join committing to ``join_secret(client)``, where ``client`` is the key that signs it."""
    return JoinRun(run_id, role, stage, commitment=join_commitment(client, join_secret(client)))


def build(state: CoordinatorState, step: tuple, key_of: Callable[[bytes], bytes] = lambda who: who,
          ) -> tuple[Instruction, bytes, int]:
    """Turn a drawn step into (instruction, signer, seconds to advance) against the current state; ``key_of`` maps a
    generated identity to the key that signs for it (a commitment binds that key)."""
    kind = step[0]
    if kind == "join":
        _, who, role, stage, run_id, commits = step
        return (committed_join(run_id, role, stage, key_of(who)) if commits else JoinRun(run_id, role, stage)), who, 0
    if kind == "withdraw":
        return Withdraw(), step[1], 0
    if kind == "tick":
        return Tick(), IDS[0], step[1]
    if kind == "witness":
        _, who, members, height_shift = step
        ids = [c.id for c in state.clients]
        present, worked = {"all": (ids, ids), "half": (ids[::2], ids[1::2]), "none": ([], []),
                           "short": (ids, ids)}[members]
        bloom = build_filter(state.config, [participant_key(i) for i in present] + [compute_key(i) for i in worked])
        if members == "short":
            bloom = bloom[:-1]
        signer = _prover(state, who)
        if state.phase == Phase.Warmup:
            return WarmupWitness(bloom, bloom), signer, 0
        return Witness(max(0, state.round.height + height_shift), bloom, bloom), signer, 0
    if kind in ("commit", "reveal"):
        _, who, height_shift, honest = step
        kind = "reveal" if state.phase == Phase.Warmup else kind  # a warmup takes joiners' reveals, no commitment
        signer, height = _seeder(state, who, kind == "reveal"), max(0, state.round.height + height_shift)
        secret = secret_of(signer, state.round.seed) if honest else bytes(32)
        if state.phase == Phase.Warmup:
            secret = join_secret(signer) if honest else bytes(32)
        if kind == "commit":
            return CommitSeed(height, seed_commitment(signer, state.round.seed, secret)), signer, 0
        return RevealSeed(height, secret), signer, 0
    if kind == "health":
        return HealthCheck(_suspect(state, step[2])), _member(state, step[1]), 0
    if kind == "checkpoint":
        _, who, cp_kind, repo = step
        return CheckpointReport(cp_kind, repo, "main"), _member(state, who), 0
    if kind == "pause":
        _, paused, by_authority = step
        return SetPaused(paused), AUTHORITY if by_authority else IDS[0], 0
    _, valid, min_clients = step
    config = dataclasses.replace(SMALL, min_clients=min_clients if valid else 2)
    return Update(config, MODEL, Checkpoint()), AUTHORITY, 0


def check_invariants(state: CoordinatorState, before: tuple[int, int, int]) -> None:
    config = state.config
    ids = [c.id for c in state.clients]
    pending = [p.id for p in state.pending]
    assert len(ids) == len(set(ids)) and len(pending) == len(set(pending))
    assert not set(ids) & set(pending), "an identity is both pending and admitted"
    assert len(ids) + len(pending) <= config.max_clients <= limits.MAX_CLIENTS
    step, epoch, nonce = before
    assert state.step >= step and state.epoch >= epoch, "step and epoch never go back"
    assert state.nonce > nonce, "an accepted operation bumps the nonce"
    assert state.step <= config.total_steps
    if state.phase in RUN_PHASES:
        assert derived.pipeline_complete(state.clients, config), "a run phase without a complete pipeline"
        assert state.round.witness_count <= min(config.witness_nodes, len(ids))
        revealing = derived.revealing(state)
        election = unelected() if revealing else derived.election(state)
        assert state.round.witnesses == election, "the stored election is the round's clients' ranks, or none yet"
        assert revealing or all(c.commitment == NO_COMMITMENT for c in state.clients), "a commitment outlived reveals"
    assert all(c.stage < config.num_stages for c in state.clients if c.role == Role.Worker)
    ledger = [entry.id for entry in state.ledger]
    assert ledger == sorted(set(ledger)) and len(ledger) <= limits.MAX_CLIENTS, "the ledger is sorted by id, once each"
    if state.phase not in (Phase.RoundTrain, Phase.RoundWitness):
        assert not any(state.presence_votes) and not any(state.compute_votes), "votes belong to a round"
    assert max(state.presence_votes + state.compute_votes) <= state.round.witness_count
    assert state.round.revealed & ~state.round.committed == 0, "a reveal without a commitment"


def fresh_run(prejoin: int) -> CoordinatorState:
    """A started run, with a full pipeline queued if ``prejoin`` (its first joiner committing to a secret if it is
    ``COMMITTED``): most interesting sequences need one, which random
    joins rarely assemble."""
    state = new_run()
    if prejoin:
        for i, join in enumerate(prejoins(lambda who: who, prejoin == COMMITTED)):
            apply(state, join, IDS[i], 0, 0)
    return state


PREJOIN = st.sampled_from([0, 1, 1, 2])
"""No joins before the steps, a full pipeline's, or a full pipeline's whose first joiner commits (``COMMITTED``)."""
COMMITTED = 2


def prejoins(key_of: Callable[[bytes], bytes], committed: bool) -> list[JoinRun]:
    """A full pipeline's joins by IDS[0..3], the first committing to a secret for its warmup if ``committed``."""
    roles = [Role.Worker, Role.Worker, Role.Worker, Role.Trainer]
    return [committed_join(RUN_ID, role, limits.NO_STAGE, key_of(IDS[i])) if i == 0 and committed
            else JoinRun(RUN_ID, role) for i, role in enumerate(roles)]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HypothesisHealthCheck.too_slow])
@given(PREJOIN, st.lists(op, min_size=25, max_size=100))
def test_random_sequences_keep_invariants(prejoin: int, steps: list[tuple]) -> None:
    state = fresh_run(prejoin)
    now = 0
    for step in steps:
        ix, signer, advance = build(state, step)
        now += advance
        assert decode_instruction(ix.encode()) == ix
        snapshot = pickle.dumps(state)  # cheaper than encoding the 115 KB account at every step
        before = (state.step, state.epoch, state.nonce)
        elected = derived.witnesses(state) if state.clients else []
        try:
            apply(state, ix, signer, now, entropy=now * 7919 + 1)
        except errors.CoordinatorError:
            assert state == pickle.loads(snapshot), f"rejected {ix.NAME} changed the state"
            continue
        joiner_reveal = isinstance(ix, RevealSeed) and state.phase == Phase.Warmup
        if isinstance(ix, (Witness, WarmupWitness, CommitSeed, RevealSeed)) and not joiner_reveal:
            assert signer in elected, f"a {ix.NAME} was accepted from a client that was not elected"
        check_invariants(state, before)
        VISITED.add(state.phase)
    encoded = encode_state(state)
    assert encode_state(decode_state(encoded)) == encoded


def test_random_sequences_reach_every_phase() -> None:
    """Guard against a generator that never gets past WaitingForMembers."""
    if not VISITED:  # run alone (-k): explore first
        test_random_sequences_keep_invariants()
    assert VISITED >= {Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness, Phase.Cooldown, Phase.Paused}


def check_tick_due(state: CoordinatorState, now: int) -> None:
    """``tick_due`` says exactly whether ticking a copy at ``now`` changes it: a tick it calls not due raises and
    leaves the copy as it was, one it calls due is accepted."""
    for later in (now, now + 5, now + 60, now + 10**6):
        copy = pickle.loads(pickle.dumps(state))
        due = rules.tick_due(state, later)
        try:
            rules.tick(copy, later, 1)
        except errors.CoordinatorError:
            assert not due, f"tick_due said due in {state.phase.name} at {later}, and the tick raised"
            assert copy == state
        else:
            assert due, f"tick_due said nothing is due in {state.phase.name} at {later}, and the tick moved the run"


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HypothesisHealthCheck.too_slow])
@given(PREJOIN, st.lists(op, min_size=25, max_size=100))
def test_tick_due_says_exactly_when_a_tick_changes_the_state(prejoin: bool, steps: list[tuple]) -> None:
    check_tick_due(rules.init_coordinator(RUN_ID, AUTHORITY, bytes(32), now=0), 0)  # uninitialised: never due
    check_tick_due(new_run(started=False), 0)  # paused
    state = fresh_run(prejoin)
    now = 0
    for step in steps:
        ix, signer, advance = build(state, step)
        now += advance
        check_tick_due(state, now)
        try:
            apply(state, ix, signer, now, entropy=now * 7919 + 1)
        except errors.CoordinatorError:
            continue
    check_tick_due(state, now)
