"""Microbatches in flight: chosen from the trainer's own measurements (the pipeline's bandwidth-delay product),
bounded whatever the workers do, and without effect on what a step accumulates."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from client.pipeline.discovery import WorkerDirectory, WorkerRecord
from client.pipeline.inflight import (
    MAX_INFLIGHT,
    InflightMeter,
    bandwidth_delay_product,
    chain,
    memory_cap,
    windowed_map,
)
from client.pipeline.trainer import PipelineTrainer
from tests.benchmarks.link_emulator import Link, RelayedDirectory

from .conftest import TINY, wait_until

STAGES = ["head", "body1", "tail"]


# ----- the choice, from measurements ----------------------------------------------------------------------------


def test_a_microbatch_calls_every_stage_forward_then_back() -> None:
    assert chain(STAGES) == [("head", False), ("body1", False), ("tail", True), ("body1", True), ("head", True)]


def test_the_choice_is_the_chains_latency_over_the_busiest_stages_service() -> None:
    calls = chain(STAGES)
    latency = dict.fromkeys(calls, 0.1)  # 0.5 s per microbatch
    service = {**dict.fromkeys(calls, 0.01), ("body1", True): 0.04}  # body1: 0.05 s per microbatch
    assert bandwidth_delay_product(latency, service, {}, calls) == pytest.approx(10.0)
    # Two replicas of body1 halve its time per microbatch; head and tail (0.02 s) are not the bottleneck yet.
    assert bandwidth_delay_product(latency, service, {"body1": 2}, calls) == pytest.approx(20.0)


def feed(meter: InflightMeter, rtt: float, service: float, microbatches: int = 8) -> None:
    """Microbatches sent all at once through ``STAGES``, each call ``rtt`` + ``service`` when its worker is idle
    and answered ``service`` after its predecessor when queued: what the trainer's clock sees."""
    now = 0.0
    for call in chain(STAGES):
        for k in range(microbatches):
            meter.record(call[0], call[1], call[0], now, now + rtt + (k + 1) * service)
        now += rtt + microbatches * service + 1.0


def test_a_longer_round_trip_puts_more_in_flight() -> None:
    loopback, internet = InflightMeter(STAGES), InflightMeter(STAGES)
    assert loopback.choose({}) == internet.choose({}) == len(STAGES)  # nothing measured: the pipeline's depth
    feed(loopback, rtt=0.0005, service=0.02)
    feed(internet, rtt=0.05, service=0.02)
    # Loopback: 5 calls of ~20 ms over the busiest stage's 40 ms; behind 50 ms more per call, (5 × 70) / 40.
    assert loopback.choose({}) == 3
    assert internet.choose({}) == 9


def test_no_worker_can_push_the_choice_past_the_cap() -> None:
    """A worker that holds its answers back and releases them together (gaps of zero), or one behind an endless
    link, makes the estimate infinite or huge; the choice stays at the cap."""
    held = InflightMeter(STAGES)
    for call in chain(STAGES):
        for _ in range(4):
            held.record(call[0], call[1], call[0], 0.0, 1.0)
    assert held.choose({}) == MAX_INFLIGHT
    slow = InflightMeter(STAGES, cap=12)
    feed(slow, rtt=3600.0, service=0.01)
    assert slow.choose({}) == 12


def test_old_gaps_leave_the_window() -> None:
    """Gaps measured long ago (when more were in flight) do not pin the choice after calls that found their worker
    idle: those calls' latencies take over."""
    meter = InflightMeter(STAGES, window=4)
    feed(meter, rtt=0.05, service=0.02)
    assert meter.choose({}) > len(STAGES)
    now = 1e4
    for _ in range(4):
        for call in chain(STAGES):
            meter.record(call[0], call[1], call[0], now, now + 0.09)
            now += 1.0
    assert meter.choose({}) == 3  # every call priced at its latency: 5 × 0.09 / (2 × 0.09)


def test_the_inputs_kept_in_flight_stay_within_the_memory_budget() -> None:
    # A 4096-wide model, 8 × 2048 tokens per microbatch, 3 stages: 805 MB of fp32 inputs per microbatch.
    assert memory_cap(3, 8 * 2048, 4096) == 1
    assert memory_cap(3, 4 * 128, 128, budget=4 << 20) == 5  # 768 KiB per microbatch
    assert memory_cap(3, 4 * 16, 32) == MAX_INFLIGHT


# ----- real workers, real gRPC, real (emulated) links -------------------------------------------------------------


class Narrowed:
    """A directory showing only the workers of one replica index: two independent pipelines in one run."""

    def __init__(self, inner: WorkerDirectory, index: int) -> None:
        self.inner, self.suffix = inner, f".{index}"

    def workers(self, stage: str) -> list[WorkerRecord]:
        return [r for r in self.inner.workers(stage) if r.uid.endswith(self.suffix)]


class Concurrency:
    """Counts the trainer's microbatches under way at once (wrapping its real per-microbatch method)."""

    def __init__(self, trainer: PipelineTrainer) -> None:
        self.now = self.peak = 0
        self._lock = threading.Lock()
        inner = trainer._microbatch

        def counted(indices: list[int], *rest: object):
            with self._lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            try:
                return inner(indices, *rest)
            finally:
                with self._lock:
                    self.now -= 1

        trainer._microbatch = counted  # type: ignore[method-assign]


@pytest.fixture
def relayed(directory: WorkerDirectory) -> Iterator[callable]:
    made: list[RelayedDirectory] = []

    def make(inner, link: Link) -> RelayedDirectory:
        made.append(RelayedDirectory(inner, link))
        return made[-1]

    yield make
    for relayed_directory in made:
        relayed_directory.close()


def test_a_step_accumulates_the_same_gradients_with_one_and_with_many_in_flight(
    start_worker, directory, dataset, run_id, relayed
) -> None:
    """Two identical pipelines (same seed), one trained one microbatch at a time on loopback, the other behind a
    40 ms link with the number in flight chosen by the trainer: each stage's accumulated gradient, sample count
    and receipts are those of the same samples; only the order of summation may differ."""
    pipelines = {index: [start_worker(stage, index=index) for stage in STAGES] for index in (1, 2)}
    wait_until(lambda: all(len(directory.workers(s)) == 2 for s in STAGES), what="two workers per stage")
    one = PipelineTrainer(TINY, dataset, Narrowed(directory, 1), run_id=run_id, max_inflight=1)
    many = PipelineTrainer(TINY, dataset, relayed(Narrowed(directory, 2), Link(100e6, 0.04)), run_id=run_id)
    counted = Concurrency(many)
    try:
        for trainer in (one, many):  # a first step, both alike: the trainer behind the link measures it
            trainer.train(range(1000, 1012), microbatch_size=2)
        for worker in (*pipelines[1], *pipelines[2]):
            worker.step()
            worker.drain_receipts()
        indices = range(0, 32)
        expected = one.train(indices, microbatch_size=2)
        counted.peak = 0
        got = many.train(indices, microbatch_size=2)
    finally:
        one.close()
        many.close()
    assert many.inflight(2) > len(STAGES) and counted.peak > len(STAGES), (many.inflight(2), counted.peak)
    assert [m.indices for m in got.microbatches] == [m.indices for m in expected.microbatches]
    assert got.losses == pytest.approx(expected.losses, rel=1e-6)
    for reference, worker in zip(pipelines[1], pipelines[2], strict=True):
        assert worker.compute.samples_accumulated == reference.compute.samples_accumulated == len(indices)
        spans = sorted((r.sample_start, r.sample_end) for r in worker.drain_receipts())
        assert spans == sorted((r.sample_start, r.sample_end) for r in reference.drain_receipts())
        for a, b in zip(worker.compute.module.parameters(), reference.compute.module.parameters(), strict=True):
            assert a.grad is not None and bool(a.grad.abs().sum() > 0)
            # Float sums in another order differ in their last bits: 1e-5 of the tensor's largest value, where one
            # microbatch more or less would move it by about 1/24 of the whole.
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5 * float(b.grad.abs().max()))


def test_workers_behind_a_slow_link_get_at_most_the_cap_in_flight(start_worker, directory, dataset, run_id,
                                                                  relayed) -> None:
    """Workers behind a 0.4 s round trip (or lying about it by holding their answers): the trainer widens to its cap
    and never past it."""
    for stage in STAGES:
        start_worker(stage)
    wait_until(lambda: all(directory.workers(s) for s in STAGES), what="a worker per stage")
    trainer = PipelineTrainer(TINY, dataset, relayed(directory, Link(100e6, 0.4)), run_id=run_id)
    trainer.meter.cap = 6
    counted = Concurrency(trainer)
    try:
        trainer.train(range(0, 3), microbatch_size=1)
        assert trainer.inflight(1) == 6
        counted.peak = 0
        trainer.train(range(3, 15), microbatch_size=1)
    finally:
        trainer.close()
    assert counted.peak == 6


def test_results_come_in_order_with_at_most_the_window_running() -> None:
    running, peak, lock = 0, 0, threading.Lock()
    limits = iter([1, 1, 4, 4, 4, 4, 2, 2, 2, 2])

    def work(item: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.01 * (item % 3))  # finish out of order
        with lock:
            running -= 1
        return item * item

    seen: list[int] = []
    windowed_map(work, list(range(10)), lambda: next(limits, 2), threads=3, on_result=seen.append)
    assert seen == [i * i for i in range(10)]
    assert peak == 3  # the window asked for 4, but there are 3 threads


def test_a_failure_is_raised_after_the_results_before_it_and_stops_new_items() -> None:
    started: list[int] = []

    def work(item: int) -> int:
        started.append(item)
        if item == 2:
            raise RuntimeError("item 2 failed")
        return item

    seen: list[int] = []
    with pytest.raises(RuntimeError, match="item 2 failed"):
        windowed_map(work, list(range(50)), lambda: 1, threads=1, on_result=seen.append)
    assert seen == [0, 1] and max(started) < 4
