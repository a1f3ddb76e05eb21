"""Helpers for tests that average with real hivemind averagers: fast timeouts and a round run by every peer.

Timeouts are short (1 s matchmaking) so that a round takes about a second. ``signed_backwards`` stands for the
Backwards a worker accumulated: the headers a trainer signs for them, as ``StageCompute.work`` keeps them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from solders.keypair import Keypair

from client.averaging.gradients import GradAveraging, GradientSettings
from client.averaging.sparta import AveragingResult, SpartaAverager, SpartaSettings
from client.pipeline.admission import RequestHeader, now_ms

FAST = SpartaSettings(min_matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=4.0,
                      allreduce_timeout=8.0, chunk_timeout=1.5)
GRADIENTS = GradientSettings(GradAveraging.FULL, timeouts=FAST)
STEADY = dataclasses.replace(FAST, chunk_timeout=3.5, allreduce_timeout=10.0)
"""``make_averager``'s timeouts: a loaded machine's stall of over ``FAST``'s 1.5 s would drop a peer as a sender and
leave its part local (a partial round, as designed), which a test of exact averages or anchors reads as a fault."""
PATIENT = dataclasses.replace(FAST, min_matchmaking_time=6.0, request_timeout=3.0, matchmaking_timeout=12.0)
"""Matchmaking that would wait 6 s for more peers: a round that begins sooner did not wait."""
T = TypeVar("T")


def at_once(calls: Sequence[Callable[[], T]], *, timeout: float, what: str) -> list[T]:
    """Run every call in its own thread at the same time (as a stage's peers act); their results in order."""
    results: list[T | None] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert all(r is not None for r in results), f"{what} did not return"
    return results  # type: ignore[return-value]


def average_together(averagers: Sequence[SpartaAverager], index: int, weights: Sequence[float],
                     peers: int | None = None) -> list[AveragingResult]:
    """Run one averaging round on every averager at once (as the peers of a stage would)."""
    return at_once([lambda a=a, w=w: a.average(index, w, peers=peers) for a, w in zip(averagers, weights, strict=True)],
                   timeout=60, what="an averaging round")


def signed_backwards(trainer: Keypair, run_id: str, stage: str, start: int, end: int, *, worker: Keypair,
                     per: int = 1, kind: str = "backward") -> list[tuple[RequestHeader, str]]:
    """The signed headers of Backwards of samples ``[start, end)``, ``per`` samples each, signed by ``trainer`` for
    ``worker``."""
    work = []
    for first in range(start, end, per):
        header = RequestHeader(run_id=run_id, stage=stage, kind=kind, trainer=bytes(trainer.pubkey()).hex(),
                               worker=bytes(worker.pubkey()).hex(), microbatch_id=f"mb-{first}", sample_start=first,
                               sample_end=min(first + per, end), dtype="float32", issued_at=now_ms(),
                               digests={"input": f"{first:064x}"})
        work.append((header, bytes(trainer.sign_message(header.message())).hex()))
    return work
