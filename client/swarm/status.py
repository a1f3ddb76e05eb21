"""A human-readable summary of a coordinator state, for ``psyswarm status`` and the demo's live view."""

from __future__ import annotations

from typing import TYPE_CHECKING

from client.stages import checkpoint_location, stage_name
from coordinator_program.spec import derived
from coordinator_program.spec.config import Checkpoint, CheckpointKind
from coordinator_program.spec.state import CoordinatorState, Health, Phase, Role

if TYPE_CHECKING:
    from client.pipeline.discovery import WorkerRecord

_TIMEOUTS = {
    Phase.Warmup: "warmup_time",
    Phase.RoundTrain: "max_round_train_time",
    Phase.RoundWitness: "round_witness_time",
    Phase.Cooldown: "cooldown_time",
}


def short(identity: bytes) -> str:
    return identity.hex()[:8]


def phase_limit(state: CoordinatorState) -> int | None:
    """Seconds the current phase lasts at most (its timeout in the run's config); None for a phase with none."""
    limit_field = _TIMEOUTS.get(state.phase)
    return None if limit_field is None else getattr(state.config, limit_field)


def phase_line(state: CoordinatorState, now: float) -> str:
    elapsed = max(0, int(now) - state.phase_start)
    limit = phase_limit(state)
    if limit is None:
        return f"{state.phase.name} for {elapsed}s"
    return f"{state.phase.name} for {elapsed}s (times out after {limit}s)"


def stage_counts(state: CoordinatorState) -> str:
    counts = derived.stage_workers(state.clients, state.config.num_stages)
    trainers = sum(1 for c in state.clients if c.role == Role.Trainer)
    stages = " ".join(f"{stage_name(i, state.config.num_stages)}={n}" for i, n in enumerate(counts))
    return f"{stages} trainers={trainers}"


ROUND_PHASES = (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness, Phase.Cooldown)
"""Phases whose epoch has a round: from WaitingForMembers on, the round the state holds is the last epoch's."""


def last_epoch(state: CoordinatorState) -> int:
    """The epoch the run is in, or for a finished run the last one it trained: finishing counts it as over."""
    return state.epoch - 1 if state.phase == Phase.Finished else state.epoch


def round_text(state: CoordinatorState) -> str:
    """Where the epoch stands, as ``round R/N``, never the previous epoch's last round."""
    total = state.config.rounds_per_epoch
    if state.phase == Phase.Warmup:
        return f"round 1/{total} after warmup"
    if state.phase in ROUND_PHASES:
        return f"round {state.round.height + 1}/{total}"
    if state.phase == Phase.Finished:
        return "finished"
    return f"no round yet ({total} per epoch)"


def describe(state: CoordinatorState, now: float) -> str:
    config = state.config
    lines = [
        f"run {state.run_id}: {phase_line(state, now)}" + ("  [pause requested]" if state.pause_requested
                                                            and state.phase != Phase.Paused else ""),
        f"epoch {last_epoch(state)}, {round_text(state)}, step {state.step}/{config.total_steps}",
        f"clients {len(state.clients)} ({stage_counts(state)}), pending {len(state.pending)}, "
        f"min {config.min_clients}, max {config.max_clients}",
    ]
    unhealthy = [c for c in state.clients if c.health != Health.Healthy]
    if unhealthy:
        lines.append("leaving at round end: " + ", ".join(f"{short(c.id)} ({c.health.name})" for c in unhealthy))
    if state.clients and state.phase in (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness):
        marks = []
        for position, witness in enumerate(derived.witnesses(state)):
            done = "+" if state.round.witnessed >> position & 1 else "."
            marks.append(f"{short(witness)}{done}")
        lines.append(f"witnesses (quorum {derived.quorum(state)}): {' '.join(marks)}")
    lines.append(f"checkpoint: {checkpoint_text(state)}")
    return "\n".join(lines)


def checkpoint_text(state: CoordinatorState) -> str:
    """Where each stage's parameters are, a place as ``psyswarm export --checkpoint`` takes it
    (``client.stages.checkpoint_location``): stages at one place are named together, in stage order, then how many
    are saved: ``Hub hub:org/m@epoch-2: head, tail; from peers (P2P): body1 (2 of 3 stages saved)``."""
    count = state.config.num_stages
    stages = state.checkpoints[:count]
    if all(cp.kind == CheckpointKind.Fresh for cp in stages):
        return "fresh initialisation"
    places: dict[str, list[str]] = {}
    for index, cp in enumerate(stages):
        places.setdefault(place_text(cp), []).append(stage_name(index, count))
    listed = "; ".join(f"{place}: {', '.join(names)}" for place, names in places.items())
    return f"{listed} ({sum(cp.saved for cp in stages)} of {count} stages saved)"


def place_text(cp: Checkpoint) -> str:
    """One stage's place: fresh, from peers, or where it is saved."""
    if cp.kind == CheckpointKind.Fresh:
        return "fresh initialisation"
    if cp.kind == CheckpointKind.P2P:
        return "from peers (P2P)"
    return f"{cp.kind.name} {checkpoint_location(cp.repo, cp.revision, hub=cp.kind == CheckpointKind.Hub)}"


def syncing_counts(found: list[WorkerRecord]) -> list[int]:
    """How many of a stage's announced workers are in sync phase 1 and in sync phase 2."""
    return [sum(1 for r in found if r.sync_phase == phase) for phase in (1, 2)]


def workers_line(records: dict[str, list[WorkerRecord]]) -> str:
    """The workers each stage announces in the DHT, and how many of them are still syncing (trainers skip
    phase 1; phase 1 and 2 average with weight 0): what a stage really has to offer, beyond its member count."""
    parts = []
    for stage, found in records.items():
        syncing = syncing_counts(found)
        detail = ", ".join(f"{n} in sync phase {phase}" for phase, n in zip((1, 2), syncing, strict=True) if n)
        parts.append(f"{stage}={len(found)}" + (f" ({detail})" if detail else ""))
    return "workers in the DHT: " + " ".join(parts)
