"""Choosing a worker per stage: a min-heap of virtual runtime, with short bans for unreachable workers.

Each worker's virtual runtime is the compute time the trainer has sent it so far. The trainer always picks
the smallest, so work flows to whoever finishes soonest: a worker twice as fast accumulates runtime half
as fast and receives twice the microbatches. A task is charged its *expected* duration when it is sent
(so concurrent microbatches spread out at once) and corrected by the measured duration when it returns.
A worker runs one task at a time, so a task's measured duration is the time from when it was sent or the
worker last answered this trainer, whichever is later, to its answer: the time it spent waiting behind the
trainer's own earlier tasks is theirs, already counted. Counting whole latencies instead would charge a
worker that received k tasks at once about (k+1)/2 times their work, and the next round's tasks would all
go to its peer, then all back: replicas taking turns at whole rounds rather than sharing each one.
A newcomer enters at the current maximum, the bottom of the heap: otherwise a fresh worker with zero
runtime would take every request until it caught up, however slow it is. Until its first answer measures it, a
worker has one task at a time (unless no other worker is usable): priced at a default throughput, a slow newcomer
would otherwise take a whole burst of microbatches before its first answer showed what it costs.

A worker's runtime is what it was measured to spend plus its tasks still outstanding, priced at its *latest*
throughput: the estimate of what it still owes moves with each measurement, and a task's answer removes exactly
the cost it was charged, whatever the throughput was when it was sent (subtracting the estimate at answer time
instead, a slow worker's first answer would cancel far more than its first tasks were charged, and drive its
runtime below zero). An attempt that fails releases what it was charged. A backward is not chosen but
claimed from the worker that ran its forward, so choosing a worker for a forward commits it to the backward
too, and the forward is charged both in advance; each is corrected by its own measured duration.

Each round starts the runtimes afresh (``begin_round``): a round's microbatches are dealt by that round's work
alone, priced at each worker's measured throughput. Carried over, the runtimes balance the workers' work over all
rounds, not within each: a replica one microbatch ahead after a round gets one fewer in the next, and equal replicas
of a stage stepped on three and one of four microbatches in about one step in six (the tiny Llama on loopback,
``tests/benchmarks/bench_gradients.py``; afresh, 297 to 300 of 300 steps are even). Such a step is a noisier Adam step
on a smaller share for one of them; in the seeds' arithmetic, dealing so every other step costs SPARTA's replicas
about a point of loss against one process (``tests/benchmarks/bench_seeds.py``, ``+uneven``; README).

A microbatch keeps to one lane where it can (``StageFinder.lane``): where two consecutive stages have as many usable
replicas, the i-th of one (in uid order) hands its microbatches to the i-th of the next. Dealt by runtime alone, each
stage's share is even but independent of the last stage's, so a microbatch crosses from one replica's chain to
another's and each replica steps on a mix of the other replicas' activations; in the seeds' arithmetic crossing
costs SPARTA's replicas about 0.3 of a point of loss against one process (``+crossed`` against halves). The lane's
worker is taken over the least-loaded one while it is usable, has been dealt no more than ``LANE_SLACK`` microbatches
beyond the stage's least-dealt usable worker this round, and is measured at no less than ``LANE_SPEED`` times the
least-loaded one's throughput: the head's even deal then carries through every stage, and a much slower or missing
replica still sheds its work by runtime, as before. Both bounds are loose on purpose: mid-round, with microbatches in
flight, the head's deal runs up to two ahead on one lane, and equal replicas on a loaded machine measure up to twice
apart; tighter, they broke about one lane in ten (``tests/pipeline/test_pipeline.py``, two replicas of each stage
over real gRPC: 41 to 43 of 48 microbatches kept a lane at one and 2/3, against 12 to 19 by runtime alone).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from client.pipeline.discovery import WorkerRecord

log = logging.getLogger(__name__)

DEFAULT_BAN_SECONDS = 30.0
_EMA = 0.3
LANE_SLACK = 2  # microbatches a lane's worker may be dealt beyond the stage's least-dealt usable worker, this round
LANE_SPEED = 0.5  # the least throughput, against the least-loaded worker's, at which a lane's worker is kept


@dataclass
class _WorkerState:
    record: WorkerRecord
    measured: float  # seconds of work measured, from the bottom of the heap when the worker was first seen
    default_throughput: float
    outstanding: float = 0.0  # cost units charged and not yet answered
    throughput: float | None = None  # cost units per second, measured
    banned_until: float = 0.0
    answered: float = float("-inf")  # when the worker last answered (the router's clock)
    dealt: int = 0  # tasks chosen for it this round

    @property
    def vruntime(self) -> float:
        return self.measured + self.outstanding / (self.throughput or self.default_throughput)

    @property
    def probing(self) -> bool:
        """Unmeasured and already sent a task: it gets no other until it answers."""
        return self.throughput is None and self.outstanding > 0


class StageRouter:
    """Load balancing among the replicas of one stage; thread-safe."""

    def __init__(
        self,
        stage: str,
        *,
        ban_seconds: float = DEFAULT_BAN_SECONDS,
        default_throughput: float = 10_000.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``default_throughput`` (cost units/s) prices a worker's first task until it has been measured."""
        self.stage = stage
        self.ban_seconds = ban_seconds
        self.default_throughput = default_throughput
        self.clock = clock
        self._workers: dict[str, _WorkerState] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()
        self._lock = threading.Lock()

    def begin_round(self) -> None:
        """A new round: every worker's runtime starts again from nothing (its throughput, bans and any task still
        charged stay), so that this round's microbatches are shared by this round's work alone."""
        with self._lock:
            for uid, state in self._workers.items():
                state.measured, state.dealt = 0.0, 0
                self._push(uid)

    def update(self, records: Sequence[WorkerRecord]) -> None:
        """Sync with the directory: add newcomers at the bottom, forget workers no longer announced.

        A uid re-announced by a different identity is a new worker: its predecessor's ban and history go.
        """
        with self._lock:
            current = {r.uid: r for r in records}
            for uid in set(self._workers) - set(current):
                del self._workers[uid]
            bottom = max((s.vruntime for s in self._workers.values()), default=0.0)
            for uid, record in current.items():
                state = self._workers.get(uid)
                if state is None or state.record.pubkey != record.pubkey:
                    self._workers[uid] = _WorkerState(record, bottom, self.default_throughput)
                    self._push(uid)
                else:
                    state.record = record

    def choose(self, cost: float, exclude: Collection[str] = (), prefer: str | None = None) -> WorkerRecord | None:
        """The least-loaded usable worker, or ``prefer`` (the microbatch's lane) while it may keep the lane, charged
        ``cost`` in advance; ``None`` if none is usable. An unmeasured worker with a task outstanding is chosen only
        when no other is usable."""
        with self._lock:
            now = self.clock()
            skipped: list[str] = []
            probing: _WorkerState | None = None
            chosen: _WorkerState | None = None
            while self._heap:
                vruntime, _, uid = heapq.heappop(self._heap)
                state = self._workers.get(uid)
                if state is None or state.vruntime != vruntime:
                    continue  # stale entry: the worker left or was re-pushed with a new runtime
                skipped.append(uid)
                if state.banned_until > now or uid in exclude:
                    continue
                if state.probing:
                    probing = probing or state
                    continue
                chosen = state
                break
            if chosen is not None and prefer is not None and self._keeps_lane(prefer, chosen, exclude, now):
                chosen = self._workers[prefer]
            chosen = chosen or probing
            for uid in skipped:
                if chosen is None or uid != chosen.record.uid:
                    self._push(uid)
            if chosen is None:
                return None
            chosen.outstanding += cost
            chosen.dealt += 1
            self._push(chosen.record.uid)
            return chosen.record

    def _keeps_lane(self, uid: str, least: _WorkerState, exclude: Collection[str], now: float) -> bool:
        """Whether the lane's worker ``uid`` is taken over ``least``, the least-loaded one (see the module)."""
        state = self._workers.get(uid)
        if state is None or state.banned_until > now or uid in exclude or state.probing:
            return False
        fewest = min(s.dealt for u, s in self._workers.items() if s.banned_until <= now and u not in exclude)
        if state.dealt > fewest + LANE_SLACK:
            return False
        return state.throughput is None or least.throughput is None or state.throughput >= LANE_SPEED * least.throughput

    def usable(self) -> list[str]:
        """The uids of the workers not banned now, in order: a lane's position among them."""
        with self._lock:
            now = self.clock()
            return sorted(uid for uid, state in self._workers.items() if state.banned_until <= now)

    def claim(self, record: WorkerRecord) -> WorkerRecord | None:
        """This very worker, for the backward of a forward it ran; charged nothing, as the forward's choice
        was charged for both. Report the backward as usual.

        ``None`` if the worker is banned, no longer announced, or its uid now belongs to another identity
        (whose parameters are not those the forward used); the caller then falls back to ``choose``.
        """
        with self._lock:
            state = self._workers.get(record.uid)
            if state is None or state.record.pubkey != record.pubkey or state.banned_until > self.clock():
                return None
            return state.record

    def report(self, uid: str, cost: float, sent: float, answered: float) -> None:
        """A task of ``cost`` sent at ``sent`` was answered at ``answered`` (the router's clock): replace its
        charge by the time the worker spent on it, update the throughput."""
        with self._lock:
            state = self._workers.get(uid)
            if state is None:
                return
            seconds = answered - max(sent, state.answered)
            state.answered = max(state.answered, answered)
            state.outstanding = max(0.0, state.outstanding - cost)
            if seconds > 0:
                state.measured += seconds
                rate = cost / seconds
                state.throughput = rate if state.throughput is None else (1 - _EMA) * state.throughput + _EMA * rate
            self._push(uid)

    def release(self, uid: str, cost: float) -> None:
        """An attempt charged ``cost`` failed or moved elsewhere unanswered: the worker no longer owes it."""
        with self._lock:
            state = self._workers.get(uid)
            if state is not None and cost > 0:
                state.outstanding = max(0.0, state.outstanding - cost)
                self._push(uid)

    def ban(self, uid: str) -> None:
        """Keep an unreachable worker out of the rotation for ``ban_seconds``; its outstanding tasks are lost."""
        with self._lock:
            state = self._workers.get(uid)
            if state is not None:
                state.banned_until = self.clock() + self.ban_seconds
                if state.outstanding:
                    state.outstanding = 0.0
                    self._push(uid)

    def exclude(self, uid: str) -> None:
        """Keep a worker found wrong out of the rotation for good (while it keeps its identity: a uid re-announced
        by another key is a new worker)."""
        with self._lock:
            state = self._workers.get(uid)
            if state is not None:
                state.banned_until = math.inf
                state.outstanding = 0.0
                self._push(uid)

    def counts(self) -> tuple[int, int]:
        """(known workers, currently banned workers), for the stall log."""
        with self._lock:
            now = self.clock()
            return len(self._workers), sum(s.banned_until > now for s in self._workers.values())

    def _push(self, uid: str) -> None:
        heapq.heappush(self._heap, (self._workers[uid].vruntime, next(self._tiebreak), uid))
        if len(self._heap) > 4 * len(self._workers) + 16:
            # Updates leave stale entries behind (lazy deletion); rebuild before they pile up.
            self._heap = [(s.vruntime, next(self._tiebreak), u) for u, s in self._workers.items()]
            heapq.heapify(self._heap)


class PipelineError(RuntimeError):
    """A microbatch could not be completed."""


class StageUnavailable(PipelineError):
    """A stage had no usable worker for longer than the trainer's ``stall_timeout``."""


class Directory(Protocol):
    """Where the trainer learns which workers serve a stage (``discovery.WorkerDirectory``)."""

    def workers(self, stage: str) -> list[WorkerRecord]: ...


class StageFinder:
    """A trainer's routers, one per stage, kept current from the directory: a worker for each attempt, the
    forward's own worker for a backward while it is usable, and a stall (logged once per stage and period) while a
    stage has none."""

    def __init__(self, directory: Directory, stages: Sequence[str], *, ban_seconds: float = DEFAULT_BAN_SECONDS,
                 stall_timeout: float | None = None, refresh_period: float = 2.0,
                 stall_log_period: float = 10.0) -> None:
        self.directory = directory
        self.routers = {s: StageRouter(s, ban_seconds=ban_seconds) for s in stages}
        self.stall_timeout = stall_timeout
        self.refresh_period = refresh_period
        self.stall_log_period = stall_log_period
        self._refreshed: dict[str, float] = {}
        self._stall_logged: dict[str, float] = {}
        self._refresh_locks = {s: threading.Lock() for s in stages}
        self._lock = threading.Lock()

    def claim(self, stage: str, forward: WorkerRecord, microbatch_id: str) -> WorkerRecord | None:
        """The forward's worker for the backward, if it is still announced and not banned."""
        self.refresh(stage, force=False)
        record = self.routers[stage].claim(forward)
        if record is None:
            log.info(
                "backward of %s for stage %s moves off %s, which ran its forward but is banned or gone",
                microbatch_id,
                stage,
                forward.uid,
            )
        return record

    def lane(self, stage: str, after: WorkerRecord | None) -> str | None:
        """The worker of ``stage`` in the lane of ``after``, the worker that ran the stage before it: the one at
        its position among its stage's usable workers, where both stages have as many (else no lane)."""
        stages = list(self.routers)
        position = stages.index(stage)
        if after is None or position == 0:
            return None
        before, here = self.routers[stages[position - 1]].usable(), self.routers[stage].usable()
        if len(before) != len(here) or after.uid not in before:
            return None
        return here[before.index(after.uid)]

    def pick(self, stage: str, charge: float, tried: set[str], after: WorkerRecord | None = None) -> WorkerRecord:
        """A worker for the next attempt, charged ``charge`` in advance: preferably one not tried yet, and the
        lane of ``after`` (the previous stage's worker of this microbatch) while it may keep it; stalls while the
        stage is empty."""
        router = self.routers[stage]
        stalled_since: float | None = None
        while True:
            self.refresh(stage, force=stalled_since is not None)
            prefer = self.lane(stage, after)
            record = router.choose(charge, exclude=tried, prefer=prefer) or router.choose(charge)
            if record is not None:
                with self._lock:  # one line per stage, however many microbatches were waiting
                    was_logged = self._stall_logged.pop(stage, None) is not None
                if was_logged:
                    log.info("stage %s has a worker again (%s); training resumes", stage, record.uid)
                return record
            now = time.monotonic()
            stalled_since = stalled_since if stalled_since is not None else now
            with self._lock:
                due = now - self._stall_logged.get(stage, -1e9) >= self.stall_log_period
                if due:
                    self._stall_logged[stage] = now
            if due:
                known, banned = router.counts()
                log.warning(
                    "STALLED: stage %s has no reachable worker (%d known, %d banned as unreachable); "
                    "waiting for one to appear",
                    stage,
                    known,
                    banned,
                )
            if self.stall_timeout is not None and now - stalled_since > self.stall_timeout:
                raise StageUnavailable(f"stage {stage} had no reachable worker for {self.stall_timeout:.0f} s")
            time.sleep(0.5)

    def refresh(self, stage: str, *, force: bool) -> None:
        # Concurrent microbatches wait for one lookup rather than each querying the DHT, and none of them
        # sees an empty router merely because another thread's first lookup is still in flight.
        with self._refresh_locks[stage]:
            if not force and time.monotonic() - self._refreshed.get(stage, -1e9) < self.refresh_period:
                return
            self.routers[stage].update(self.directory.workers(stage))
            self._refreshed[stage] = time.monotonic()
