"""The sync-phase tracker: when a worker syncs, how long each phase lasts, the seed's lines, what each implies."""

from __future__ import annotations

import pytest

from client.join.sync import ACTIVE_LINE, PHASE1_LINE, PHASE2_LINE, SyncPhase, SyncPolicy, SyncTracker
from coordinator_program.spec.config import Model


def tracker(phase1: int = 400, phase2: int = 100, stale: int = 5) -> tuple[SyncTracker, list[str]]:
    lines: list[str] = []
    return SyncTracker(SyncPolicy(stale, phase1, phase2), say=lines.append), lines


def test_policy_comes_from_the_run_config() -> None:
    assert SyncPolicy.from_model(Model()) == SyncPolicy(max_allowed_stale=5, phase1_steps=400, phase2_steps=100)
    with pytest.raises(ValueError):
        SyncPolicy(-1, 1, 1)


def test_a_fresh_worker_starts_active_and_a_stale_one_walks_both_phases() -> None:
    sync, lines = tracker()
    assert sync.begin(swarm_step=100, local_step=95) == SyncPhase.ACTIVE and lines == []  # 5 behind: fine

    sync, lines = tracker()
    assert sync.begin(swarm_step=100, local_step=94) == SyncPhase.WEIGHTS
    assert lines == [PHASE1_LINE, "[SYNC] This phase will last 400 steps (until local epoch 500)."]
    assert sync.advance(499) == SyncPhase.WEIGHTS and len(lines) == 2
    assert sync.advance(500) == SyncPhase.OPTIMIZER
    assert lines[2:] == [PHASE2_LINE, "[SYNC] This phase will last 100 steps (until local epoch 600)."]
    assert sync.advance(599) == SyncPhase.OPTIMIZER
    assert sync.advance(600) == SyncPhase.ACTIVE
    assert lines[4:] == [ACTIVE_LINE]
    assert sync.advance(700) == SyncPhase.ACTIVE and len(lines) == 5


def test_the_seed_lines_are_exact() -> None:
    assert PHASE1_LINE == "[SYNC] Synchronising weights with peers. Node won't process batches in this phase."
    assert PHASE2_LINE == ("[SYNC] Synchronising optimizer state. Node is now processing batches, but doesn't "
                           "contribute to weight averaging yet.")
    assert ACTIVE_LINE == "[SYNC] Sync complete. Node is now fully contributing to training."


def test_unknown_checkpoint_age_means_sync() -> None:
    sync, _ = tracker()
    assert sync.begin(swarm_step=3, local_step=None) == SyncPhase.WEIGHTS


def test_a_late_advance_still_gives_phase_two_its_full_length() -> None:
    sync, lines = tracker(phase1=10, phase2=5)
    sync.begin(swarm_step=0, local_step=None)
    assert sync.advance(37) == SyncPhase.OPTIMIZER  # phase 1 ended at 10; we only hear of it at 37
    assert lines[-1] == "[SYNC] This phase will last 5 steps (until local epoch 42)."
    assert sync.advance(41) == SyncPhase.OPTIMIZER and sync.advance(42) == SyncPhase.ACTIVE


def test_phases_of_zero_steps_are_skipped() -> None:
    sync, lines = tracker(phase1=0, phase2=3)
    assert sync.begin(swarm_step=50, local_step=0) == SyncPhase.OPTIMIZER
    assert lines == [PHASE2_LINE, "[SYNC] This phase will last 3 steps (until local epoch 53)."]
    sync, lines = tracker(phase1=0, phase2=0)
    assert sync.begin(swarm_step=50, local_step=0) == SyncPhase.ACTIVE and lines == [ACTIVE_LINE]


def test_what_each_phase_implies() -> None:
    sync, _ = tracker(phase1=1, phase2=1)
    sync.begin(swarm_step=0, local_step=None)
    seen = {}
    for step in (0, 1, 2):
        sync.advance(step)
        seen[sync.phase] = (sync.averaging_weight(2.5), sync.shares_state)
    assert seen == {
        SyncPhase.WEIGHTS: (0.0, False),
        SyncPhase.OPTIMIZER: (0.0, False),
        SyncPhase.ACTIVE: (2.5, True),
    }
