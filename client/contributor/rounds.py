"""The name of a round, as every role keys its bookkeeping by it."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator_program.spec.state import CoordinatorState


@dataclass(frozen=True, slots=True)
class RoundKey:
    """A round of the run: its epoch and its height within that epoch. The coordinator's state only says which
    round runs now; the roles remember which rounds they opened, trained, proved or health-checked."""

    epoch: int
    height: int

    @classmethod
    def of(cls, state: CoordinatorState) -> RoundKey:
        """The round ``state`` is in (between epochs: the last one's)."""
        return cls(state.epoch, state.round.height)

    def __str__(self) -> str:
        return f"{self.epoch}.{self.height}"
