"""Conformance of the per-stage checkpoint record (issue 20, 5): the compiled C program in LiteSVM against the
specification. A checkpoint report used to replace the run's one record and keep only the reporter's stage, so one
worker could erase or repoint every other stage's checkpoint and send their next joiners to their peers; now a report
sets only the place of the reporter's own stage, and a stage keeps the first place reported in an epoch. Every
operation is replayed on both (``Replay``), which demands the same outcome and byte-identical accounts."""

from __future__ import annotations

import dataclasses

from coordinator_chain import Swarm, training_swarm
from solders.keypair import Keypair

from coordinator_program.spec import errors
from coordinator_program.spec.config import Checkpoint, CheckpointKind
from coordinator_program.spec.instructions import CheckpointReport, Tick
from coordinator_program.spec.state import Phase, Role
from tests.spec.scenario import MODEL, SMALL

CONFIG = dataclasses.replace(SMALL, rounds_per_epoch=1, total_steps=10, cooldown_time=30)
HONEST = Checkpoint(CheckpointKind.Hub, "org/model", "epoch-0")
ELSEWHERE = Checkpoint(CheckpointKind.Local, "/attacker/run", "elsewhere")


def report(swarm: Swarm, worker: bytes, place: Checkpoint) -> int | None:
    return swarm.replay.apply(CheckpointReport(place.kind, place.repo, place.revision), swarm.of(worker))


def to_cooldown(swarm: Swarm, authority: Keypair) -> None:
    """End the epoch's one round with every client proved."""
    assert swarm.prove(swarm.clients()).count(None) >= CONFIG.witness_quorum
    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    assert swarm.state.phase == Phase.Cooldown


def workers_of(swarm: Swarm, stage: int) -> list[bytes]:
    return [c.id for c in swarm.state.clients if c.role == Role.Worker and c.stage == stage]


def test_a_worker_cannot_erase_or_repoint_another_stages_checkpoint() -> None:
    """Stages 0 and 2 report the run's checkpoint, then stage 1's worker reports another place: on the old rule the
    record became the attacker's place with only stage 1 saved, so stages 0 and 2 had no checkpoint. Now the report
    sets stage 1's place alone, and stages 0 and 2 keep theirs into the next epoch, where their joiners read it."""
    swarm, authority = training_swarm(CONFIG, MODEL)
    to_cooldown(swarm, authority)
    assert [cp.kind for cp in swarm.state.checkpoints[:3]] == [CheckpointKind.P2P] * 3
    for stage in (0, 2):
        assert report(swarm, workers_of(swarm, stage)[0], HONEST) is None
    assert swarm.state.phase == Phase.Cooldown  # stage 1 is not saved yet
    assert report(swarm, workers_of(swarm, 1)[0], ELSEWHERE) is None  # its own stage: accepted
    assert swarm.state.checkpoints[:3] == [HONEST, ELSEWHERE, HONEST]
    assert swarm.state.phase == Phase.WaitingForMembers  # every stage saved: Cooldown ended early
    assert swarm.state.checkpoints[:3] == [HONEST, ELSEWHERE, HONEST]


def test_a_stage_keeps_its_first_place_of_the_epoch() -> None:
    """Of two workers of a stage, the first report sets its place; the other confirms it or is refused
    (``CheckpointTaken``) and changes nothing. The next epoch starts every stage over from P2P, its last repo and
    revision kept, and takes a new first report."""
    swarm, authority = training_swarm(CONFIG, MODEL, workers=6)
    to_cooldown(swarm, authority)
    first, second = workers_of(swarm, 0)
    assert report(swarm, first, HONEST) is None
    assert report(swarm, second, ELSEWHERE) == errors.CheckpointTaken.code
    assert report(swarm, first, ELSEWHERE) == errors.CheckpointTaken.code  # nor may the first reporter move it
    assert report(swarm, second, HONEST) is None  # the same place: a confirmation
    assert swarm.state.checkpoints[0] == HONEST

    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.cooldown_time) is None  # stages 1 and 2 unsaved
    assert swarm.state.phase == Phase.WaitingForMembers and swarm.state.checkpoints[0] == HONEST
    assert swarm.replay.apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.warmup_time) is None
    to_cooldown(swarm, authority)
    assert swarm.state.checkpoints[0] == Checkpoint(CheckpointKind.P2P, HONEST.repo, HONEST.revision)
    next_epoch = Checkpoint(CheckpointKind.Hub, "org/model", "epoch-1")
    assert report(swarm, workers_of(swarm, 0)[1], next_epoch) is None
    assert swarm.state.checkpoints[0] == next_epoch
