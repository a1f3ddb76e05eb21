"""Helpers for tests that average with real hivemind averagers: fast timeouts and a round run by every peer.

Timeouts are short (1 s matchmaking) so that a round takes about a second.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from client.averaging.gradients import GradAveraging, GradientSettings
from client.averaging.sparta import AveragingResult, SpartaAverager, SpartaSettings

FAST = SpartaSettings(min_matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=4.0,
                      allreduce_timeout=8.0, chunk_timeout=1.5)
GRADIENTS = GradientSettings(GradAveraging.FULL, timeouts=FAST)


def average_together(averagers: Sequence[SpartaAverager], index: int, weights: Sequence[float],
                     peers: int | None = None) -> list[AveragingResult]:
    """Run one averaging round on every averager at once (as the peers of a stage would)."""
    results: list[AveragingResult | None] = [None] * len(averagers)

    def run(i: int) -> None:
        results[i] = averagers[i].average(index, weights[i], peers=peers)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(r is not None for r in results), "an averaging round did not return"
    return results  # type: ignore[return-value]
