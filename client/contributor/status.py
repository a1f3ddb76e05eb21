"""Where a contributor stands, for people: what ``join-run``'s live line shows, read from the roles."""

from __future__ import annotations

from dataclasses import dataclass

from client.join.sync import SyncPhase
from coordinator_program.spec.state import CoordinatorState, Role


@dataclass(frozen=True)
class ContributorStatus:
    """A snapshot of this client's part in the run, taken together with the coordinator's state it is about."""

    state: CoordinatorState  # the coordinator's state as last seen
    me: bytes  # this client's public key
    role: Role
    asked_stage: int  # the stage this client asked for (``limits.NO_STAGE``: any); the state has the assigned one
    sync_phase: SyncPhase | None  # a worker's; None while it holds no stage, and for a trainer
    batches: int  # microbatches in the current round: receipts a worker issued, or what a trainer trained
