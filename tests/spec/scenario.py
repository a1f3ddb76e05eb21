"""Building blocks for specification tests: runs, identities, and driving a run to a given phase."""

from __future__ import annotations

import dataclasses

from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.bloom import build_filter, participant_key
from coordinator_program.spec.config import Checkpoint, Config, Model
from coordinator_program.spec.state import CoordinatorState, Health, Phase, Role

AUTHORITY = b"\xaa" * 32
RUN_ID = "test-run"

SMALL = Config(min_clients=4, max_clients=8, witness_nodes=3, witness_quorum=2, num_stages=3,
               bloom_slices=11, bloom_bits_per_slice=11, warmup_time=5, max_round_train_time=20,
               round_witness_time=2, cooldown_time=5, rounds_per_epoch=3, total_steps=7, global_batch_size=10)
MODEL = Model(n_layers=3, n_heads=2, d_model=16, seq_len=8)


def ident(i: int) -> bytes:
    """A distinct, readable 32-byte identity."""
    return i.to_bytes(2, "big") * 16


def new_run(config: Config = SMALL, *, join_authority: bytes = bytes(32), started: bool = True) -> CoordinatorState:
    """A configured run, resumed and ticked into WaitingForMembers unless ``started`` is False."""
    state = rules.init_coordinator(RUN_ID, AUTHORITY, join_authority, now=0)
    rules.update(state, AUTHORITY, config, MODEL, Checkpoint())
    if started:
        rules.set_paused(state, AUTHORITY, False)
        rules.tick(state, 0, 1)
        assert state.phase == Phase.WaitingForMembers
    return state


def join_pipeline(state: CoordinatorState, workers: int = 3, trainers: int = 1, first: int = 1) -> list[bytes]:
    """Join ``workers`` auto-staged workers and ``trainers`` trainers; returns their identities."""
    ids = []
    for i in range(workers + trainers):
        role = Role.Worker if i < workers else Role.Trainer
        rules.join(state, ident(first + i), RUN_ID, role, limits.NO_STAGE, ident(first + i))
        ids.append(ident(first + i))
    return ids


def full_filter(state: CoordinatorState, members: list[bytes] | None = None) -> bytes:
    """A participant filter holding every client (or ``members``), sized for the run."""
    ids = [c.id for c in state.clients] if members is None else members
    return build_filter(state.config, [participant_key(i) for i in ids])


def witness_all(state: CoordinatorState, members: list[bytes] | None = None) -> None:
    """Every healthy elected witness of the round sends a proof naming ``members`` (default: everyone)."""
    participants = full_filter(state, members)
    batches = build_filter(state.config, [])
    for w in derived.witnesses(state):
        if state.clients[state.client_index(w)].health != Health.Healthy:
            continue
        if state.phase == Phase.Warmup:
            rules.warmup_witness(state, w, participants, batches)
        else:
            rules.witness(state, w, state.round.height, participants, batches)


def start_training(state: CoordinatorState, now: int = 0) -> int:
    """From WaitingForMembers with a full pipeline pending, tick to RoundTrain; returns the time reached."""
    rules.tick(state, now, 11)
    assert state.phase == Phase.Warmup
    now += state.config.warmup_time
    rules.tick(state, now, 12)
    assert state.phase == Phase.RoundTrain
    return now


def finish_round(state: CoordinatorState, now: int, seed: int = 99, members: list[bytes] | None = None) -> int:
    """Witness the current round fully, tick to RoundWitness, then past it; returns the time reached."""
    witness_all(state, members)
    rules.tick(state, now, seed)
    assert state.phase == Phase.RoundWitness
    now += state.config.round_witness_time
    rules.tick(state, now, seed)
    return now


def replace(config: Config, **changes: int) -> Config:
    return dataclasses.replace(config, **changes)
