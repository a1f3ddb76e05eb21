"""A human-readable summary of a coordinator state, for ``psyswarm status`` and the demo's live view."""

from __future__ import annotations

from typing import TYPE_CHECKING

from client.stages import stage_name
from coordinator_program import rules
from coordinator_program.config import CheckpointKind
from coordinator_program.state import CoordinatorState, Health, Phase, Role

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


def phase_line(state: CoordinatorState, now: float) -> str:
    elapsed = max(0, int(now) - state.phase_start)
    limit_field = _TIMEOUTS.get(state.phase)
    if limit_field is None:
        return f"{state.phase.name} for {elapsed}s"
    limit = getattr(state.config, limit_field)
    return f"{state.phase.name} for {elapsed}s (times out after {limit}s)"


def stage_counts(state: CoordinatorState) -> str:
    counts = rules.stage_workers(state.clients, state.config.num_stages)
    trainers = sum(1 for c in state.clients if c.role == Role.Trainer)
    stages = " ".join(f"{stage_name(i, state.config.num_stages)}={n}" for i, n in enumerate(counts))
    return f"{stages} trainers={trainers}"


def describe(state: CoordinatorState, now: float) -> str:
    config = state.config
    lines = [
        f"run {state.run_id}: {phase_line(state, now)}" + ("  [pause requested]" if state.pause_requested
                                                            and state.phase != Phase.Paused else ""),
        f"epoch {state.epoch}, round {state.round.height + 1}/{config.rounds_per_epoch}, "
        f"step {state.step}/{config.total_steps}",
        f"clients {len(state.clients)} ({stage_counts(state)}), pending {len(state.pending)}, "
        f"min {config.min_clients}, max {config.max_clients}",
    ]
    unhealthy = [c for c in state.clients if c.health != Health.Healthy]
    if unhealthy:
        lines.append("leaving at round end: " + ", ".join(f"{short(c.id)} ({c.health.name})" for c in unhealthy))
    if state.clients and state.phase in (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness):
        marks = []
        for position, witness in enumerate(rules.witnesses(state)):
            done = "+" if state.round.witnessed >> position & 1 else "."
            marks.append(f"{short(witness)}{done}")
        lines.append(f"witnesses (quorum {rules.quorum(state)}): {' '.join(marks)}")
    cp = state.checkpoint
    where = {CheckpointKind.Fresh: "fresh initialisation", CheckpointKind.P2P: "from peers (P2P)"}.get(
        cp.kind, f"{cp.kind.name} {cp.repo}@{cp.revision} (stages saved: {cp.stages_done:b})")
    lines.append(f"checkpoint: {where}")
    return "\n".join(lines)


def workers_line(records: dict[str, list[WorkerRecord]]) -> str:
    """The workers each stage announces in the DHT, and how many of them are still syncing (trainers skip
    phase 1; phase 1 and 2 average with weight 0): what a stage really has to offer, beyond its member count."""
    parts = []
    for stage, found in records.items():
        syncing = [sum(1 for r in found if r.sync_phase == phase) for phase in (1, 2)]
        detail = ", ".join(f"{n} in sync phase {phase}" for phase, n in zip((1, 2), syncing, strict=True) if n)
        parts.append(f"{stage}={len(found)}" + (f" ({detail})" if detail else ""))
    return "workers in the DHT: " + " ".join(parts)
