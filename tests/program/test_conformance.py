"""Conformance: the C program against the executable specification, operation by operation.

Random operation sequences from the specification's own generator (tests/spec/test_properties.py) and
hand-written scenarios are replayed through ``Replay``: real transactions signed by real keypairs at a
clock the test sets, and the same operations applied to the specification with ``apply_then_tick``.
After every operation the account bytes must be ``encode_state`` of the specification's state, and an
operation the specification rejects must fail on chain with the same custom error and change nothing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from coordinator_chain import ProgramChain, Replay, Swarm, key
from hypothesis import HealthCheck as HypothesisHealthCheck
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.keypair import Keypair

from coordinator_program.spec import derived, errors, limits
from coordinator_program.spec.config import Checkpoint, CheckpointKind, Config, Model
from coordinator_program.spec.filter_sizing import bloom_params, filter_capacity
from coordinator_program.spec.instructions import (
    CheckpointReport,
    CloseRun,
    HealthCheck,
    JoinRun,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
)
from coordinator_program.spec.state import Health, Phase, Role
from tests.spec.scenario import AUTHORITY, MODEL, RUN_ID, SMALL
from tests.spec.test_properties import COMMITTED, IDS, PREJOIN, build, op, prejoins

# The generator names identities by readable bytes; on chain each is a real keypair.
ALIASES = {**{i: Keypair.from_seed(i) for i in IDS}, AUTHORITY: Keypair.from_seed(AUTHORITY)}
BY_KEY = {key(kp): kp for kp in ALIASES.values()}
OUTCOMES: Counter[tuple[str, int | None]] = Counter()
"""(instruction, error code or None) of every replayed operation, to check the generator's coverage."""
EARNED: Counter[str] = Counter()
"""Kinds of points the replayed sequences credited (presence, compute), to check the ledger was exercised."""


def real(identity: bytes) -> bytes:
    """The on-chain identity of a generator identity (an unknown key stays as it is)."""
    return key(ALIASES[identity]) if identity in ALIASES else identity


def started_replay() -> Replay:
    """tests.spec.scenario.new_run on chain: the SMALL config, resumed and ticked into WaitingForMembers."""
    replay = Replay(ProgramChain(), ALIASES[AUTHORITY], RUN_ID)
    replay.chain.fund(*ALIASES.values())
    authority = ALIASES[AUTHORITY]
    assert replay.apply(Update(SMALL, MODEL, Checkpoint()), authority) is None
    assert replay.apply(SetPaused(False), authority) is None
    assert replay.apply(Tick(), authority) is None
    assert replay.state.phase == Phase.WaitingForMembers
    return replay


def replay_steps(prejoin: int, steps: list[tuple]) -> None:
    """Replay the generator's steps (tests/spec/test_properties.build) on chain and on the specification."""
    replay = started_replay()
    if prejoin:  # a full pipeline pending, as the specification's property test starts
        for i, join in enumerate(prejoins(real, prejoin == COMMITTED)):
            assert replay.apply(join, ALIASES[IDS[i]]) is None
    for step in steps:
        ix, signer, advance = build(replay.state, step, real)
        if isinstance(ix, HealthCheck):
            ix = HealthCheck(real(ix.target))
        code = replay.apply(ix, BY_KEY[real(signer)], advance=advance)
        OUTCOMES[(ix.NAME, code)] += 1
        EARNED["presence"] = max(EARNED["presence"], sum(e.presence for e in replay.state.ledger))
        EARNED["compute"] = max(EARNED["compute"], sum(e.compute for e in replay.state.ledger))


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HypothesisHealthCheck.too_slow, HypothesisHealthCheck.data_too_large])
@given(PREJOIN, st.lists(op, min_size=25, max_size=100))
def test_random_sequences_match_the_specification(prejoin: int, steps: list[tuple]) -> None:
    replay_steps(prejoin, steps)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, derandomize=True,
          suppress_health_check=[HypothesisHealthCheck.too_slow, HypothesisHealthCheck.data_too_large])
@given(PREJOIN, st.lists(op, min_size=25, max_size=200))
def test_many_random_sequences_match_the_specification(prejoin: int, steps: list[tuple]) -> None:
    replay_steps(prejoin, steps)


def test_random_sequences_reach_every_instruction_and_many_errors() -> None:
    """Guard against a generator that leaves parts of the program untested."""
    if not OUTCOMES:  # run alone (-k): replay first
        test_random_sequences_match_the_specification()
    accepted = {name for name, code in OUTCOMES if code is None}
    # Accepted checkpoints need a complete epoch, which the scenarios below drive instead.
    assert accepted >= {"update", "set_paused", "join_run", "tick", "witness", "warmup_witness", "health_check",
                        "withdraw", "commit_seed", "reveal_seed"}
    assert len({code for _, code in OUTCOMES if code is not None}) >= 15
    assert EARNED["presence"] > 0 and EARNED["compute"] > 0, "no replayed round credited points"


# --- scenarios: paths random sequences rarely reach ----------------------------------------------------


def test_permissioned_run_through_every_instruction() -> None:
    """A small run with a join authority from creation to Finished, checking every rule's outcome."""
    chain = ProgramChain()
    authority, gate = Keypair(), Keypair()
    chain.fund(gate)
    swarm = Swarm(Replay(chain, authority, "gated.run-1", join_authority=key(gate)))
    apply = swarm.replay.apply
    config = dataclasses.replace(SMALL, witness_nodes=3, witness_quorum=2, rounds_per_epoch=3, total_steps=4)
    assert apply(Tick(), authority) == errors.NotInitialized.code
    assert apply(SetPaused(False), authority) == errors.NotInitialized.code
    assert apply(Update(dataclasses.replace(config, min_clients=3), MODEL, Checkpoint()),
                 authority) == errors.InvalidConfig.code
    assert apply(Update(config, MODEL, Checkpoint(CheckpointKind.P2P)), authority) == errors.InvalidCheckpoint.code
    hub = Checkpoint(CheckpointKind.Hub, "org/model", "v1")
    assert apply(Update(config, MODEL, hub), authority) is None
    assert apply(SetPaused(False), gate) == errors.NotAuthorized.code
    assert apply(SetPaused(False), authority) is None
    assert apply(Tick(), authority, advance=1) is None and swarm.state.phase == Phase.WaitingForMembers
    assert apply(Update(config, MODEL, hub), authority) == errors.NotHalted.code
    assert apply(CloseRun(), authority) == errors.NotHalted.code

    workers, trainers = swarm.new_members(4), swarm.new_members(2)
    assert apply(JoinRun(RUN_ID, Role.Worker), workers[0], gate) == errors.WrongRunId.code
    assert apply(JoinRun("gated.run-1", Role.Worker), workers[0]) == errors.NotAuthorized.code
    assert apply(JoinRun("gated.run-1", Role.Worker, 3), workers[0], gate) == errors.InvalidJoin.code
    assert apply(JoinRun("gated.run-1", Role.Trainer, 0), trainers[0], gate) == errors.InvalidJoin.code
    assert apply(JoinRun("gated.run-1", Role.Worker, 2), workers[0], gate) is None
    for kp in workers[1:]:
        assert apply(JoinRun("gated.run-1", Role.Worker), kp, gate) is None
    assert apply(JoinRun("gated.run-1", Role.Trainer), workers[1], gate) == errors.AlreadyJoined.code
    for kp in trainers:
        assert apply(JoinRun("gated.run-1", Role.Trainer), kp, gate) is None
    late = swarm.new_members(3)
    for kp in late[:2]:
        assert apply(JoinRun("gated.run-1", Role.Trainer), kp, gate) is None
    assert apply(JoinRun("gated.run-1", Role.Trainer), late[2], gate) == errors.RunFull.code
    assert apply(Withdraw(), late[1]) is None  # a pending joiner leaves at once
    assert apply(Withdraw(), late[1]) == errors.NotJoined.code

    # Warmup: two of three proofs reach the quorum, and the next tick starts round 0 (a warmup proof never ticks).
    assert apply(Tick(), authority, advance=1) is None and swarm.state.phase == Phase.Warmup
    assert [c.stage for c in swarm.state.clients][:4] == [2, 0, 1, 0]
    outsider = next(c for c in swarm.clients() if c not in derived.witnesses(swarm.state))
    assert apply(WarmupWitness(b"", b""), swarm.of(outsider)) == errors.NotAWitness.code
    assert apply(Witness(0, b"", b""), swarm.of(outsider)) == errors.WrongPhase.code
    assert swarm.prove(swarm.clients())[:2] == [None, None]
    assert swarm.state.phase == Phase.Warmup
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.RoundTrain

    # Round 0 leaves one client out of every filter; round 1 judges it by them.
    lazy = next(c.id for c in swarm.state.clients if c.id not in derived.witnesses(swarm.state)
                and (c.role == Role.Trainer or c.stage == 0))  # its stage keeps a worker when it leaves
    witness = derived.witnesses(swarm.state)[0]
    size = swarm.state.config.bloom_bytes
    assert apply(Witness(1, bytes(size), bytes(size)), swarm.of(witness)) == errors.StaleRound.code
    assert apply(Witness(0, bytes(size - 1), bytes(size)), swarm.of(witness)) == errors.BadFilter.code
    assert apply(HealthCheck(lazy), swarm.of(witness)) == errors.NoPreviousRound.code
    assert swarm.prove([c for c in swarm.clients() if c != lazy])[:2] == [None, None]
    assert apply(Witness(0, bytes(size), bytes(size)), swarm.of(witness)) == errors.DuplicateWitness.code
    assert apply(Tick(), authority, advance=config.round_witness_time) is None
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 1
    checker = next(c for c in swarm.clients() if c != lazy)
    assert apply(HealthCheck(checker), swarm.of(lazy)) == errors.ClientHealthy.code
    assert apply(HealthCheck(key(gate)), swarm.of(checker)) == errors.UnknownClient.code
    assert apply(HealthCheck(lazy), swarm.of(checker)) is None
    assert swarm.state.clients[swarm.state.client_index(lazy)].health == Health.Unhealthy
    assert apply(HealthCheck(lazy), swarm.of(checker)) == errors.AlreadyMarked.code
    assert apply(HealthCheck(checker), swarm.of(lazy)) == errors.NotHealthy.code
    assert apply(Withdraw(), swarm.of(lazy)) is None
    assert apply(Withdraw(), swarm.of(lazy)) == errors.NotHealthy.code
    assert apply(CheckpointReport(CheckpointKind.Hub, "org/model", "v2"), swarm.of(checker)) == \
        errors.WrongPhase.code

    # Round 1 times out with one proof of the two it needs: the epoch ends, and the lazy client leaves with it.
    lone = next(w for w in derived.witnesses(swarm.state) if w != lazy)
    assert swarm.prove(swarm.clients(), [lone]) == [None]
    assert apply(Tick(), authority, advance=config.max_round_train_time - 1) == errors.NothingToTick.code
    assert apply(Tick(), authority, advance=1) is None and swarm.state.phase == Phase.RoundWitness
    assert apply(Tick(), authority, advance=config.round_witness_time) is None
    assert swarm.state.phase == Phase.Cooldown
    assert [cp.kind for cp in swarm.state.checkpoints[:3]] == [CheckpointKind.P2P] * 3
    assert swarm.state.client_index(lazy) is None

    # Cooldown: a saved checkpoint of every stage ends it early.
    staying = swarm.clients()
    assert apply(SetPaused(True), authority) is None
    trainer = next(c.id for c in swarm.state.clients if c.role == Role.Trainer)
    assert apply(CheckpointReport(CheckpointKind.Hub, "org/model", "v2"), swarm.of(trainer)) == \
        errors.NotAWorker.code
    by_stage = {c.stage: c.id for c in swarm.state.clients if c.role == Role.Worker}
    assert apply(CheckpointReport(CheckpointKind.P2P, "org/model", "v2"), swarm.of(by_stage[0])) == \
        errors.InvalidCheckpoint.code
    assert apply(CheckpointReport(CheckpointKind.Hub, "org/\tmodel", "v2"), swarm.of(by_stage[0])) == \
        errors.InvalidCheckpoint.code
    assert apply(CheckpointReport(CheckpointKind.Hub, "org/model", "v2"), swarm.of(by_stage[0])) is None
    assert apply(CheckpointReport(CheckpointKind.Local, "/ckpt", "v2"), swarm.of(by_stage[1])) is None
    assert swarm.state.checkpoints[:2] == [Checkpoint(CheckpointKind.Hub, "org/model", "v2"),
                                           Checkpoint(CheckpointKind.Local, "/ckpt", "v2")]  # a place per stage
    assert apply(CheckpointReport(CheckpointKind.Local, "/ckpt", "v2"), swarm.of(by_stage[0])) == \
        errors.CheckpointTaken.code  # a stage keeps its first place of the epoch
    assert apply(CheckpointReport(CheckpointKind.Hub, "org/model", "v2"), swarm.of(by_stage[0])) is None  # confirmed
    assert apply(CheckpointReport(CheckpointKind.Local, "/ckpt", "v2"), swarm.of(by_stage[2])) is None
    assert swarm.state.phase == Phase.Paused and swarm.state.epoch == 1  # paused as requested
    assert [p.id for p in swarm.state.pending] == staying  # queued for the next epoch, in order

    # Resume; a worker that leaves during warmup sends the run back to waiting; then run to the end.
    assert apply(SetPaused(False), authority) is None
    assert apply(Tick(), authority) is None and apply(Tick(), authority) is None
    assert swarm.state.phase == Phase.Warmup
    leaving = next(c.id for c in swarm.state.clients if c.role == Role.Worker and c.stage == 2)
    assert apply(Withdraw(), swarm.of(leaving)) is None
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.WaitingForMembers
    assert apply(JoinRun("gated.run-1", Role.Worker, 2), swarm.of(leaving), gate) is None
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert apply(Tick(), authority, advance=config.warmup_time) is None
    for _ in range(10):
        if swarm.state.phase == Phase.RoundTrain:
            assert None in swarm.prove(swarm.clients())
        if swarm.state.phase != Phase.Finished:
            assert apply(Tick(), authority, advance=config.cooldown_time) is None
    assert swarm.state.phase == Phase.Finished and swarm.state.step == config.total_steps
    assert apply(JoinRun("gated.run-1", Role.Trainer), late[1], gate) == errors.RunFinished.code
    assert apply(SetPaused(False), authority) == errors.RunFinished.code
    assert apply(Tick(), authority) == errors.RunFinished.code
    assert apply(CloseRun(), gate) == errors.NotAuthorized.code
    assert apply(CloseRun(), authority) is None  # Replay checks the accounts are gone and the rent returned


@pytest.mark.parametrize("phase", [Phase.Uninitialized, Phase.Paused, Phase.RoundTrain])
def test_close_run_returns_the_rent_of_a_halted_run(phase: Phase) -> None:
    """Closing needs a halted run; once closed, the run id is free for a new run on the same chain."""
    chain = ProgramChain()
    authority, member = Keypair(), Keypair()
    replay = Replay(chain, authority, RUN_ID)
    chain.fund(member)
    if phase != Phase.Uninitialized:
        assert replay.apply(Update(SMALL, MODEL, Checkpoint()), authority) is None
    if phase == Phase.RoundTrain:
        assert replay.apply(SetPaused(False), authority) is None
        assert replay.apply(Tick(), authority) is None
        for i, kp in enumerate(Keypair.from_seed(bytes([i]) * 32) for i in range(1, 5)):
            chain.fund(kp)
            assert replay.apply(JoinRun(RUN_ID, Role.Trainer if i == 3 else Role.Worker), kp) is None
        assert replay.apply(Tick(), authority) is None
        assert replay.apply(Tick(), authority, advance=SMALL.warmup_time) is None
    assert replay.state.phase == phase
    assert replay.apply(CloseRun(), member) == errors.NotAuthorized.code
    if phase == Phase.RoundTrain:
        assert replay.apply(CloseRun(), authority) == errors.NotHalted.code
        return
    assert replay.apply(CloseRun(), authority) is None
    again = Replay(chain, authority, RUN_ID)
    assert again.run.instance == replay.run.instance and again.state.phase == Phase.Uninitialized


def test_update_checks_the_joiners_already_pending() -> None:
    replay = started_replay()
    authority = ALIASES[AUTHORITY]
    assert replay.apply(SetPaused(True), authority) is None
    assert replay.apply(Tick(), authority) is None and replay.state.phase == Phase.Paused
    assert replay.apply(JoinRun(RUN_ID, Role.Worker, 2), ALIASES[IDS[0]]) is None  # joining while paused
    for identity in IDS[1:5]:
        assert replay.apply(JoinRun(RUN_ID, Role.Trainer), ALIASES[identity]) is None
    four = dataclasses.replace(SMALL, max_clients=4)
    two_stages = dataclasses.replace(SMALL, num_stages=2, min_clients=3)
    assert replay.apply(Update(four, MODEL, Checkpoint()), authority) == errors.InvalidConfig.code
    assert replay.apply(Update(two_stages, MODEL, Checkpoint()), authority) == errors.InvalidConfig.code
    assert replay.apply(Withdraw(), ALIASES[IDS[0]]) is None
    assert replay.apply(Update(two_stages, MODEL, Checkpoint()), authority) is None


@pytest.mark.parametrize("start", [-(2**63) + 1, 2**63 - 100], ids=["earliest", "latest"])
def test_clock_extremes_match_the_specification(start: int) -> None:
    """Deadlines past the largest clock time are never reached, as in the specification's integers."""
    authority = Keypair()
    replay = Replay(ProgramChain(), authority, RUN_ID, now=start)
    members = [Keypair.from_seed(bytes([i]) * 32) for i in range(1, 5)]
    replay.chain.fund(*members)
    config = dataclasses.replace(SMALL, warmup_time=2**32 - 1)
    assert replay.apply(Update(config, MODEL, Checkpoint()), authority) is None
    assert replay.apply(SetPaused(False), authority) is None
    assert replay.apply(Tick(), authority) is None
    for i, kp in enumerate(members):
        assert replay.apply(JoinRun(RUN_ID, Role.Trainer if i == 3 else Role.Worker), kp) is None
    assert replay.apply(Tick(), authority) is None and replay.state.phase == Phase.Warmup
    assert replay.apply(Tick(), authority, advance=99) == errors.NothingToTick.code
    if start < 0:
        assert replay.apply(Tick(), authority, advance=config.warmup_time - 99) is None
        assert replay.state.phase == Phase.RoundTrain


def full_config(clients: int) -> Config:
    """``clients`` clients, 32 witnesses, the default bloom error rate (``limits.MAX_CLIENTS``: the largest run the
    account holds)."""
    slices, bits = bloom_params(filter_capacity(clients), 0.0009)
    return Config(min_clients=limits.MAX_WITNESSES, max_clients=clients, witness_nodes=limits.MAX_WITNESSES,
                  witness_quorum=22, num_stages=4, bloom_slices=slices, bloom_bits_per_slice=bits,
                  warmup_time=30, max_round_train_time=60, round_witness_time=5, cooldown_time=30,
                  rounds_per_epoch=3, total_steps=100, global_batch_size=1024)


def end_round(swarm: Swarm, authority: Keypair, config: Config) -> None:
    """Tick through a round's end once its witness time is over: one tick for every 128 clients it credits."""
    assert swarm.replay.apply(Tick(), authority, advance=config.round_witness_time) is None
    while swarm.state.phase == Phase.RoundWitness:
        assert swarm.replay.apply(Tick(), authority) is None


@pytest.mark.parametrize("clients", [256, pytest.param(limits.MAX_CLIENTS, marks=pytest.mark.slow)])
def test_full_run(clients: int) -> None:
    """An epoch at full capacity: every join, warmup, three rounds with 32 witnesses each sending its proof in parts
    (one per 128 clients), health checks, a withdrawal, a saved checkpoint ending cooldown, and everyone queued for
    the next epoch. Transactions ask for compute units as the clients do (``onchain.budget``): a tick, which may
    elect a round's witnesses (a sha256 of every client's key), asks for more; every other instruction for none:
    each part tallies 128 clients at most, so it fits the default 200,000 units. The program's election must equal
    the specification's at every size."""
    chain = ProgramChain()
    authority = Keypair()
    swarm = Swarm(Replay(chain, authority, "full"))
    apply = swarm.replay.apply
    config = full_config(clients)
    assert apply(Update(config, Model(n_layers=4), Checkpoint()), authority) is None
    assert apply(SetPaused(False), authority) is None
    assert apply(Tick(), authority) is None
    members = swarm.new_members(clients)
    for i, kp in enumerate(members):
        assert apply(JoinRun("full", Role.Trainer if i % 8 == 7 else Role.Worker), kp) is None
    assert apply(JoinRun("full", Role.Trainer), swarm.new_members(1)[0]) == errors.RunFull.code
    assert apply(Tick(), authority, advance=1) is None
    assert swarm.state.phase == Phase.Warmup and len(swarm.state.clients) == clients

    assert swarm.prove(swarm.clients()).count(None) == config.witness_nodes
    assert swarm.state.phase == Phase.Warmup  # a warmup proof never ticks: round 0's start elects, a tick's work
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.RoundTrain
    lazy = [c for c in swarm.clients() if c not in derived.witnesses(swarm.state)][:3]
    assert swarm.prove([c for c in swarm.clients() if c not in lazy]).count(None) == config.witness_nodes
    assert swarm.state.phase == Phase.RoundWitness  # the quorum ended training early
    end_round(swarm, authority, config)
    assert swarm.state.round.height == 1

    checker, seen, leaver = [c for c in swarm.clients() if c not in lazy][:3]
    for target in lazy:
        assert apply(HealthCheck(target), swarm.of(checker)) is None
    assert apply(HealthCheck(lazy[0]), swarm.of(checker)) == errors.AlreadyMarked.code
    assert apply(HealthCheck(seen), swarm.of(checker)) == errors.ClientHealthy.code
    assert apply(Withdraw(), swarm.of(leaver)) is None
    assert swarm.prove(swarm.clients()).count(None) >= config.witness_quorum
    end_round(swarm, authority, config)
    assert swarm.state.round.height == 2 and len(swarm.state.clients) == clients - 4

    assert swarm.prove(swarm.clients()).count(None) >= config.witness_quorum
    end_round(swarm, authority, config)
    assert swarm.state.phase == Phase.Cooldown
    saver = {c.stage: c.id for c in swarm.state.clients if c.role == Role.Worker}
    for stage in range(config.num_stages):
        assert apply(CheckpointReport(CheckpointKind.Hub, "org/model", "step-3"), swarm.of(saver[stage])) is None
    assert swarm.state.phase == Phase.WaitingForMembers and swarm.state.epoch == 1
    assert len(swarm.state.pending) == clients - 4
