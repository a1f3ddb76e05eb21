"""How many microbatches a trainer keeps in flight: the pipeline's bandwidth-delay product, measured.

A microbatch's calls run one after another (head → … → tail, then back to the head), so a microbatch takes the
sum of its calls' latencies, ``L``: round trips, transfers, queueing and compute. Meanwhile the busiest stage
needs ``T`` seconds per microbatch (its calls' service times, shared among its replicas). By Little's law that
stage stays busy only with ``L / T`` microbatches in flight: about the number of stages on loopback, many more
when every call also pays 50 ms of round trip. It is BBR's estimate of a TCP path's bandwidth-delay product
(round-trip propagation time × bottleneck bandwidth), taken over the pipeline rather than over one link.

Both figures come from the trainer's own requests, end to end, so round trips, bandwidth, and compute overlapping
with transfers need no model:

- a call's latency is the time from sending it to its checked answer; ``L`` adds, over the chain of calls, each
  kind's minimum over recent calls (queueing only adds to a latency, so the minimum is the unqueued one);
- a worker's service time for a call is the gap between its answer and that worker's previous answer to this
  trainer, counted only when the call was sent before that previous answer (the worker had work of ours
  queued, so the gap is what one more task costs it, whichever of its CPU or its link limits it); ``T`` takes,
  per stage, each kind's minimum over the gaps among its recent calls. A kind with no such gap among them is
  priced at its latency, which can only make the choice smaller, never unbounded; so a trainer that chose one
  in flight, and so queues nothing, returns to about the pipeline's depth once its old gaps have left the window.

Whatever a worker does, the choice stays within ``1..cap``: a worker that answers slowly, sits behind a slow
link or holds answers back to release them together inflates ``L`` or shrinks ``T``, and gets at most ``cap``
microbatches in flight; ``memory_cap`` keeps the trainer's own copies of the stages' inputs in flight within a
memory budget, and ``MAX_INFLIGHT`` stays within the tickets a worker keeps per trainer
(``admission.MicrobatchLedger``).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_INFLIGHT = 32  # within a worker's 64 forward tickets per trainer, whatever the stages' replicas
MEMORY_BUDGET = 1 << 30  # bytes of the stages' inputs (fp32) that a trainer keeps for microbatches in flight
WINDOW = 64  # recent samples per kind of call from which the minimum is taken

Call = tuple[str, bool]  # (stage, backward)


def chain(stages: Sequence[str]) -> list[Call]:
    """The calls of one microbatch, in order: forwards to all but the tail, the tail's backward, backwards to the
    head."""
    return [(s, False) for s in stages[:-1]] + [(stages[-1], True)] + [(s, True) for s in reversed(stages[:-1])]


def memory_cap(num_stages: int, microbatch_tokens: int, d_model: int, budget: int = MEMORY_BUDGET) -> int:
    """Microbatches whose inputs to every stage (float32 hidden states, the widest form) fit in ``budget``."""
    per_microbatch = max(1, num_stages * microbatch_tokens * d_model * 4)
    return max(1, min(MAX_INFLIGHT, budget // per_microbatch))


def bandwidth_delay_product(
    latency: Mapping[Call, float], service: Mapping[Call, float], replicas: Mapping[str, int], calls: Sequence[Call]
) -> float:
    """``L / T`` in microbatches: ``latency`` and ``service`` (seconds) per call of ``calls``; a stage's service
    is shared among its ``replicas``."""
    total = sum(latency[call] for call in calls)
    per_stage: dict[str, float] = collections.defaultdict(float)
    for call in calls:
        per_stage[call[0]] += service.get(call, latency[call])
    busiest = max(seconds / max(1, replicas.get(stage, 1)) for stage, seconds in per_stage.items())
    return total / busiest if busiest > 0 else math.inf


class InflightMeter:
    """Measures a trainer's calls and chooses its number of microbatches in flight; thread-safe."""

    def __init__(self, stages: Sequence[str], *, cap: int = MAX_INFLIGHT, window: int = WINDOW) -> None:
        """Until every call of a microbatch has been measured, the choice is the number of stages (a pipeline's
        depth: what keeps each stage busy when round trips cost nothing)."""
        if cap < 1:
            raise ValueError("the cap on microbatches in flight must be at least 1")
        self.calls = chain(stages)
        self.cap = cap
        self.initial = min(cap, len(stages))
        self._latency: dict[Call, collections.deque[float]] = {c: collections.deque(maxlen=window) for c in self.calls}
        self._service: dict[Call, collections.deque[float | None]] = {
            c: collections.deque(maxlen=window) for c in self.calls
        }
        self._answered: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, stage: str, backward: bool, worker: str, sent: float, answered: float) -> None:
        """A call to ``worker``, sent at ``sent``, was answered (and its answer checked) at ``answered``."""
        call = (stage, backward)
        if call not in self._latency or answered < sent:
            return
        with self._lock:
            self._latency[call].append(answered - sent)
            previous = self._answered.get(worker)
            queued = previous is not None and sent < previous <= answered
            # A call that found the worker idle adds no gap, but still pushes old gaps out of the window: else a
            # trainer that chose one in flight (so never queues a call) would keep the gaps of long ago forever.
            self._service[call].append(answered - previous if queued else None)  # type: ignore[operator]
            self._answered[worker] = answered if previous is None else max(previous, answered)

    def choose(self, replicas: Mapping[str, int] | Callable[[str], int]) -> int:
        """Microbatches to keep in flight now: ``ceil(L / T)`` within ``1..cap``; ``replicas`` gives each stage's
        usable workers."""
        with self._lock:
            if not all(self._latency[c] for c in self.calls):
                return self.initial
            latency = {c: min(self._latency[c]) for c in self.calls}
            gaps = {c: [g for g in self._service[c] if g is not None] for c in self.calls}
            service = {c: min(g) for c, g in gaps.items() if g}
        stages = {stage for stage, _ in self.calls}
        counts = {s: replicas(s) for s in stages} if callable(replicas) else dict(replicas)
        product = bandwidth_delay_product(latency, service, counts, self.calls)
        return max(1, min(self.cap, math.ceil(product) if math.isfinite(product) else self.cap))


def windowed_map(
    function: Callable[[Item], Result],
    items: Sequence[Item],
    limit: Callable[[], int],
    *,
    threads: int,
    on_result: Callable[[Result], None],
) -> None:
    """Run ``function`` on every item, at most ``limit()`` at once (asked again before each item starts, so the
    window follows the measurements made meanwhile; at most ``threads``), and hand each result to ``on_result``
    in the order of ``items`` as soon as it and all before it are done. The first failure, in that order, is
    raised once the items before it are handed over; items not yet started are then cancelled."""
    pending: list[Future[Result]] = []
    delivered = 0

    def deliver() -> None:
        nonlocal delivered
        while delivered < len(pending) and pending[delivered].done():
            delivered += 1
            on_result(pending[delivered - 1].result())

    with ThreadPoolExecutor(threads, thread_name_prefix="microbatch") as pool:
        try:
            running: set[Future[Result]] = set()
            for item in items:
                while len(running) >= min(threads, max(1, limit())):
                    _, running = wait(running, return_when=FIRST_COMPLETED)
                    deliver()
                pending.append(pool.submit(function, item))
                running.add(pending[-1])
            for future in pending[delivered:]:
                future.result()
                deliver()
        except BaseException:
            for future in pending:
                future.cancel()
            raise
