"""One interface to the coordinator, whichever backend runs it (the TCP server or the Solana program).

A client sends instructions and follows the state; everything else (the phases, the witnessing, the
training) is written once against this interface.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncIterator

from coordinator_program.spec import limits
from coordinator_program.spec.beacon import NO_COMMITMENT
from coordinator_program.spec.config import CheckpointKind
from coordinator_program.spec.errors import DuplicateWitness
from coordinator_program.spec.instructions import (
    CheckpointReport,
    CommitSeed,
    HealthCheck,
    Instruction,
    JoinRun,
    RevealSeed,
    SetPaused,
    Tick,
    WarmupWitness,
    Withdraw,
    Witness,
)
from coordinator_program.spec.state import CoordinatorState, Role

JOIN_VALIDITY = 60
"""Seconds a countersigned join stays valid for the coordinator: long enough to reach it, short enough that an
ended slot is freed soon (the auth service waits out every deadline it countersigned)."""


class BackendError(RuntimeError):
    """The backend could not be reached or refused a request for a reason outside the coordinator's rules
    (authentication, replay, transport); the message says what to do.

    Most such failures pass (a restarted server, a network cut), and a client reconnects. ``permanent`` marks
    those that trying again cannot cure (an identity with nothing to pay fees with, a run that does not exist or
    was closed): the client stops and prints the message instead.
    """

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class Backend(abc.ABC):
    """A connection to one run's coordinator."""

    ticks_itself: bool = False
    """Whether the coordinator's host ticks it (the TCP server does); if not, clients tick it."""

    def __init__(self) -> None:
        self._state: CoordinatorState | None = None
        self._changed = asyncio.Condition()
        self.closed_reason: str | None = None
        self.closed_permanently = False

    @property
    @abc.abstractmethod
    def identity(self) -> bytes:
        """This client's public key, the identity the coordinator knows it by."""

    @abc.abstractmethod
    async def connect(self) -> None:
        """Connect and receive the current state."""

    @abc.abstractmethod
    async def submit(self, ix: Instruction) -> None:
        """Send one instruction; raise the coordinator's ``CoordinatorError`` if it is rejected."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave the connection (not the run)."""

    @property
    def state(self) -> CoordinatorState:
        if self._state is None:
            raise BackendError("not connected: no coordinator state yet")
        return self._state

    async def _mark_closed(self, reason: str, *, permanent: bool = False) -> None:
        """The connection is gone: wake every follower so it raises instead of waiting forever (``permanent``: a
        new connection cannot help, see ``BackendError``)."""
        async with self._changed:
            if self.closed_reason is None:
                self.closed_reason, self.closed_permanently = reason, permanent
            self._changed.notify_all()

    def _check_open(self) -> None:
        if self.closed_reason is not None:
            raise BackendError(self.closed_reason, permanent=self.closed_permanently)

    async def _publish(self, state: CoordinatorState) -> None:
        """Adopt a newer state and wake the followers; older or equal nonces are ignored."""
        if self._state is not None and state.nonce <= self._state.nonce:
            return
        async with self._changed:
            self._state = state
            self._changed.notify_all()

    async def updates(self) -> AsyncIterator[CoordinatorState]:
        """The latest state each time it changes; states that arrive together are seen as the newest one,
        so a follower must compare phases and rounds rather than count updates."""
        seen = -1

        def newer() -> bool:
            return self.closed_reason is not None or (self._state is not None and self._state.nonce > seen)

        while True:
            async with self._changed:
                await self._changed.wait_for(newer)
                self._check_open()
                state = self.state
            seen = state.nonce
            yield state

    async def wait_for(self, predicate, timeout: float | None = None) -> CoordinatorState:
        """Wait until the state satisfies ``predicate``; returns that state."""
        async def waiter() -> CoordinatorState:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self.closed_reason is not None or (self._state is not None and predicate(self._state)))
                self._check_open()
                return self.state
        return await asyncio.wait_for(waiter(), timeout)

    # --- the coordinator's operations -----------------------------------------------------------------

    async def join(self, role: Role, stage: int = limits.NO_STAGE, slot: int = limits.NO_SLOT,
                   commitment: bytes = NO_COMMITMENT) -> None:
        """Join as ``role``; ``slot`` is the join authority's slot this process holds on a permissioned run, whose
        countersignature then also covers a deadline ``JOIN_VALIDITY`` seconds ahead; ``commitment`` is to the secret
        this client reveals in its warmup (``beacon.join_commitment``)."""
        valid_until = limits.NO_DEADLINE if slot == limits.NO_SLOT else int(time.time() + JOIN_VALIDITY)
        await self.submit(JoinRun(self.state.run_id, role, stage, slot, valid_until, commitment))

    async def tick(self) -> None:
        await self.submit(Tick())

    async def witness(self, round_height: int, participant_bloom: bytes, batch_bloom: bytes, part: int = 0) -> None:
        await self.submit(Witness(round_height, participant_bloom, batch_bloom, part))

    async def warmup_witness(self, participant_bloom: bytes, batch_bloom: bytes, part: int = 0) -> None:
        await self.submit(WarmupWitness(participant_bloom, batch_bloom, part))

    async def prove(self, round_height: int | None, parts: list[tuple[bytes, bytes]]) -> None:
        """Send a whole proof, part by part (``bloom.proof_parts``): of round ``round_height``, or of the warmup when
        it is None. Each part is its own instruction (on chain, its own transaction); the coordinator counts the
        proof once its last part is in. A part the coordinator already holds (a proof resent after a lost reply) is
        skipped, so a resent proof completes rather than stops at its first part."""
        for part, (participants, batches) in enumerate(parts):
            try:
                if round_height is None:
                    await self.warmup_witness(participants, batches, part)
                else:
                    await self.witness(round_height, participants, batches, part)
            except DuplicateWitness:
                continue

    async def commit_seed(self, round_height: int, commitment: bytes) -> None:
        """As an elected witness of round ``round_height``, commit to a secret for the next round's seed."""
        await self.submit(CommitSeed(round_height, commitment))

    async def reveal_seed(self, round_height: int, secret: bytes) -> None:
        """Reveal the secret this witness committed to in round ``round_height``."""
        await self.submit(RevealSeed(round_height, secret))

    async def health_check(self, target: bytes) -> None:
        await self.submit(HealthCheck(target))

    async def checkpoint(self, kind: CheckpointKind, repo: str, revision: str) -> None:
        await self.submit(CheckpointReport(kind, repo, revision))

    async def withdraw(self) -> None:
        await self.submit(Withdraw())

    async def set_paused(self, paused: bool) -> None:
        await self.submit(SetPaused(paused))
