"""Sync phases: how a worker that is behind its stage re-enters training without biasing the live model.

A worker more than ``max_allowed_stale`` steps behind the swarm — a joiner whose checkpoint lags, one whose
download outlasted rounds, one restored from an old checkpoint, one that lagged while training — goes through:

- phase 1, weight synchronisation (``sync_phase1_steps``): DHT record ``sync_phase=1``, trainers skip it, it
  averages with weight 0 (receives the stage's average, contributes nothing);
- phase 2, optimizer warm-up (``sync_phase2_steps``): ``sync_phase=2``, trainers route batches to it and its
  optimizer steps, still weight 0, and its samples do not count toward progress;
- active: ``sync_phase=0``, full averaging weight, samples count.

Steps are the swarm's optimizer steps (the coordinator's ``state.step``); the "local epoch" the CLI names is
that counter as this node follows it. Each phase lasts its number of steps from the step it actually starts,
so a node that missed steps still spends the full phase 2 warming its optimizer. The tracker prints the
seed's ``[SYNC]`` lines with the real step count and end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

PHASE1_LINE = "[SYNC] Synchronising weights with peers. Node won't process batches in this phase."
PHASE2_LINE = ("[SYNC] Synchronising optimizer state. Node is now processing batches, but doesn't contribute to "
               "weight averaging yet.")
DURATION_LINE = "[SYNC] This phase will last {steps} steps (until local epoch {epoch})."
ACTIVE_LINE = "[SYNC] Sync complete. Node is now fully contributing to training."


class SyncPhase(IntEnum):
    """The value a worker announces as ``sync_phase`` in its DHT record."""

    ACTIVE = 0
    WEIGHTS = 1
    OPTIMIZER = 2


class _ModelSettings(Protocol):
    max_allowed_stale: int
    sync_phase1_steps: int
    sync_phase2_steps: int


@dataclass(frozen=True)
class SyncPolicy:
    max_allowed_stale: int
    phase1_steps: int
    phase2_steps: int

    def __post_init__(self) -> None:
        if min(self.max_allowed_stale, self.phase1_steps, self.phase2_steps) < 0:
            raise ValueError(f"sync settings must be non-negative: {self}")

    @classmethod
    def from_model(cls, model: _ModelSettings) -> SyncPolicy:
        """The policy a run's ``coordinator_program.spec.config.Model`` sets."""
        return cls(model.max_allowed_stale, model.sync_phase1_steps, model.sync_phase2_steps)

    def is_stale(self, local_step: int | None, swarm_step: int) -> bool:
        """Whether a worker whose state is from ``local_step`` (None: unknown) must go through sync."""
        return local_step is None or swarm_step - local_step > self.max_allowed_stale


class SyncTracker:
    """One worker's sync phase, advanced by the swarm's step; says what the phase implies."""

    def __init__(self, policy: SyncPolicy, *, say: Callable[[str], None] = print) -> None:
        """``say`` receives each ``[SYNC]`` line (the CLI prints them)."""
        self.policy = policy
        self.say = say
        self.phase = SyncPhase.ACTIVE
        self.phase_end: int | None = None  # the swarm step at which the current sync phase ends

    def begin(self, swarm_step: int, local_step: int | None) -> SyncPhase:
        """Decide, once the state is loaded, whether this worker starts active or in sync."""
        if self.policy.is_stale(local_step, swarm_step):
            self.enter(swarm_step)
        return self.phase

    def enter(self, swarm_step: int) -> None:
        """Start sync at phase 1 (or the first phase that lasts any steps)."""
        self._start(SyncPhase.WEIGHTS, swarm_step)

    def advance(self, swarm_step: int) -> SyncPhase:
        """Move on when the swarm reaches the current phase's end; call whenever the swarm's step changes."""
        while self.phase_end is not None and swarm_step >= self.phase_end:
            following = SyncPhase.OPTIMIZER if self.phase == SyncPhase.WEIGHTS else SyncPhase.ACTIVE
            # A late advance starts the next phase now: it must last its full length from here.
            self._start(following, swarm_step)
        return self.phase

    def _start(self, phase: SyncPhase, swarm_step: int) -> None:
        steps = {SyncPhase.WEIGHTS: self.policy.phase1_steps, SyncPhase.OPTIMIZER: self.policy.phase2_steps}
        if phase != SyncPhase.ACTIVE and steps[phase] == 0:
            self._start(SyncPhase.OPTIMIZER if phase == SyncPhase.WEIGHTS else SyncPhase.ACTIVE, swarm_step)
            return
        self.phase = phase
        if phase == SyncPhase.ACTIVE:
            self.phase_end = None
            self.say(ACTIVE_LINE)
            return
        self.phase_end = swarm_step + steps[phase]
        self.say(PHASE1_LINE if phase == SyncPhase.WEIGHTS else PHASE2_LINE)
        self.say(DURATION_LINE.format(steps=steps[phase], epoch=self.phase_end))

    # ----- what the phase implies -----

    def averaging_weight(self, active_weight: float = 1.0) -> float:
        """The weight to average with: 0 in both sync phases (receive only), ``active_weight`` once active."""
        return active_weight if self.phase == SyncPhase.ACTIVE else 0.0

    @property
    def shares_state(self) -> bool:
        """Serve state to joiners only when synchronised: a syncing worker's state is what they must avoid."""
        return self.phase == SyncPhase.ACTIVE
