"""A worker's runtime: two task queues and the one thread that drains them.

gRPC handler threads queue tasks and wait for their results; the single runtime thread runs them, backward first
(a backward completes a microbatch and frees the trainer's memory), so computation never competes with itself
for the CPU and parameters change only between tasks. While ``held``, queued tasks wait (an averaging round is
updating the parameters).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc

from client.pipeline.compute import StageRequest
from client.pipeline.rpc import RequestRejected

log = logging.getLogger(__name__)

_THROUGHPUT_EMA = 0.2


@dataclass
class Task:
    backward: bool
    request: StageRequest
    future: Future


class Runtime:
    """Queues of at most ``max_queue`` tasks, run one at a time by ``execute`` on a thread of their own."""

    def __init__(self, execute: Callable[[Task], bytes], *, name: str, uid: str, max_queue: int = 64,
                 request_timeout: float = 120.0, compute_delay: float = 0.0) -> None:
        """``compute_delay`` adds seconds to every task, standing in for slower hardware in experiments."""
        self.execute = execute
        self.uid = uid
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.compute_delay = compute_delay
        self.throughput = 0.0  # tokens per second of compute, EMA
        self._queues: dict[bool, collections.deque[Task]] = {False: collections.deque(), True: collections.deque()}
        self.cv = threading.Condition()
        self._holds = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel what is queued and wait for the task under way, if any."""
        with self.cv:
            self._stopping = True
            pending = [*self._queues[True], *self._queues[False]]
            for queue in self._queues.values():
                queue.clear()
            self.cv.notify_all()
        for task in pending:
            task.future.cancel()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def load(self) -> int:
        with self.cv:
            return len(self._queues[True]) + len(self._queues[False])

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Queue tasks without running them for the duration (requests keep queuing, within their timeouts)."""
        with self.cv:
            self._holds += 1
        try:
            yield
        finally:
            with self.cv:
                self._holds -= 1
                self.cv.notify_all()

    def run(self, task: Task) -> bytes:
        """Queue the task and wait for its result; raises what it raised, or a rejection if it could not run.
        A task that timed out but is already running is left to finish (its effect stands)."""
        with self.cv:
            if self._stopping:
                raise RequestRejected("worker is shutting down", grpc.StatusCode.UNAVAILABLE)
            if len(self._queues[True]) + len(self._queues[False]) >= self.max_queue:
                raise RequestRejected(
                    f"worker {self.uid} is overloaded ({self.max_queue} tasks queued)",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
            self._queues[task.backward].append(task)
            self.cv.notify()
        try:
            return task.future.result(timeout=self.request_timeout)
        except FutureTimeout:
            if not task.future.cancel():
                return task.future.result()
            raise RequestRejected("timed out in the worker's queue", grpc.StatusCode.DEADLINE_EXCEEDED) from None

    def _next(self) -> Task | None:
        with self.cv:
            while not self._stopping and (self._holds or not (self._queues[True] or self._queues[False])):
                self.cv.wait()
            if self._stopping:
                return None
            return (self._queues[True] or self._queues[False]).popleft()

    def _run(self) -> None:
        while (task := self._next()) is not None:
            if not task.future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            if self.compute_delay:
                time.sleep(self.compute_delay)
            try:
                result = self.execute(task)
            except RequestRejected as exc:
                log.warning("%s refused for trainer %s: %s", self.uid, task.request.trainer[:16], exc)
                task.future.set_exception(exc)
                continue
            except Exception as exc:
                log.exception("%s of %s failed", "backward" if task.backward else "forward", self.uid)
                task.future.set_exception(exc)
                continue
            task.future.set_result(result)
            rate = task.request.tokens / max(time.perf_counter() - started, 1e-9)
            self.throughput = (
                rate if not self.throughput else ((1 - _THROUGHPUT_EMA) * self.throughput + _THROUGHPUT_EMA * rate)
            )
