"""Helpers for tests that average with real hivemind averagers: fast timeouts and a round run by every peer.

Timeouts are short (1 s matchmaking) so that a round takes about a second. ``signed_backwards`` stands for the
Backwards a worker accumulated: the headers a trainer signs for them, as ``StageCompute.work`` keeps them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from solders.keypair import Keypair

from client.averaging.gradients import GradAveraging, GradientSettings
from client.averaging.sparta import AveragingResult, SpartaAverager, SpartaSettings
from client.pipeline.admission import RequestHeader, now_ms

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


def signed_backwards(trainer: Keypair, run_id: str, stage: str, start: int, end: int, *, per: int = 1,
                     kind: str = "backward") -> list[tuple[RequestHeader, str]]:
    """The signed headers of Backwards of samples ``[start, end)``, ``per`` samples each, signed by ``trainer``."""
    work = []
    for first in range(start, end, per):
        header = RequestHeader(run_id=run_id, stage=stage, kind=kind, trainer=bytes(trainer.pubkey()).hex(),
                               microbatch_id=f"mb-{first}", sample_start=first, sample_end=min(first + per, end),
                               dtype="float32", issued_at=now_ms(), digests={"input": f"{first:064x}"})
        work.append((header, bytes(trainer.sign_message(header.message())).hex()))
    return work
