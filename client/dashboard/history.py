"""The run's rounds as its DHT still holds them, so a dashboard started (or restarted) mid-run shows the curve
from the start.

Each round's result is read from the trainers' signed commitments for that round: the sample-weighted mean of
their losses, the tokens they processed and the seconds they measured training it. The DHT keeps a record for an
hour (``client.witness.records.RECORD_TTL``), so the history reaches back that far. Commitments are read through
``fetch(epoch, round)``, duck-typed (``start``, ``end``, ``loss``, ``tokens``, ``seconds``), which the dashboard
command wires to the run's record board.

A round is read again until the coordinator has moved past it (its commitments may still arrive), then never
again; an earlier epoch is read round by round up to its first round without commitments, where it ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from coordinator_program.spec.state import CoordinatorState, Phase

MAX_LOSS_POINTS = 500
"""Rounds of loss the page keeps, and reads back when it starts: enough for a long curve, bounded however long
the run or the dashboard runs."""
EMPTY_EPOCHS_BACK = 2
"""Looking back, this many earlier epochs in a row without a commitment end the search: the DHT no longer holds
them."""

Fetch = Callable[[int, int], Sequence[Any]]


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """One round's committed result: the trainers' sample-weighted mean loss, the tokens they processed and the
    longest time one of them measured training its share (0 where none said)."""

    epoch: int
    round: int
    loss: float
    tokens: int
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float | None:
        """The swarm's throughput in the round: its trainers work side by side, so the slowest one's time is the
        round's."""
        return self.tokens / self.seconds if self.seconds > 0 else None


def result_of(epoch: int, round_: int, commitments: Sequence[Any]) -> RoundResult | None:
    """The round's result from its commitments (None without any)."""
    if not commitments:
        return None
    samples = sum(c.end - c.start for c in commitments)
    loss = sum(c.loss * (c.end - c.start) for c in commitments) / max(samples, 1)
    return RoundResult(epoch, round_, loss, sum(c.tokens for c in commitments),
                       max(c.seconds for c in commitments))


def newest_round(state: CoordinatorState) -> int:
    """The newest round of ``state.epoch`` that has begun, or -1 before the epoch's first round (in Warmup, and
    from WaitingForMembers on, where the round the state holds is an earlier epoch's)."""
    return state.round.height if state.phase in (Phase.RoundTrain, Phase.RoundWitness, Phase.Cooldown) else -1


def round_over(state: CoordinatorState, round_: int) -> bool:
    """Whether the coordinator has moved past round ``round_`` of its current epoch."""
    return round_ < newest_round(state) or state.phase == Phase.Cooldown


class History:
    """Reads the rounds the dashboard has not yet read for good."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.settled: set[tuple[int, int]] = set()  # rounds read after they ended: never read again
        self.next_epoch: int | None = None  # the first epoch not yet read to its end; None before the first read

    def read(self, state: CoordinatorState) -> list[RoundResult]:
        """The results found among the rounds not settled: at the first read, the earlier epochs back as far as the
        DHT holds them (``MAX_LOSS_POINTS`` rounds at most); then the epochs that ended since; and the current
        epoch's rounds."""
        results: list[RoundResult] = []
        epoch, rounds_per_epoch = state.epoch, state.config.rounds_per_epoch
        if self.next_epoch is None:
            empty, back = 0, epoch - 1
            while back >= 0 and empty < EMPTY_EPOCHS_BACK and len(results) < MAX_LOSS_POINTS:
                found = self._read_epoch(back, rounds_per_epoch)
                results += found
                empty = 0 if found else empty + 1
                back -= 1
            self.next_epoch = epoch
        while self.next_epoch < epoch:
            results += self._read_epoch(self.next_epoch, rounds_per_epoch)
            self.next_epoch += 1
        for round_ in range(newest_round(state) + 1):
            if (epoch, round_) not in self.settled:
                result = result_of(epoch, round_, self.fetch(epoch, round_))
                if round_over(state, round_):
                    self.settled.add((epoch, round_))
                if result is not None:
                    results.append(result)
        return results

    def _read_epoch(self, epoch: int, rounds_per_epoch: int) -> list[RoundResult]:
        """An ended epoch's rounds not yet settled, up to its first round without commitments."""
        results = []
        for round_ in range(rounds_per_epoch):
            if (epoch, round_) in self.settled:
                continue
            self.settled.add((epoch, round_))
            result = result_of(epoch, round_, self.fetch(epoch, round_))
            if result is None:
                break
            results.append(result)
        return results
