"""Fixtures for SPARTA, sync and join tests: real hivemind DHT nodes and averagers on loopback.

Each averager takes its DHT node's peer id, so every simulated peer gets its own node, all joined to the
session's node (``dht`` in tests/conftest.py). Timeouts are short (1 s matchmaking) so that a round takes
about a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import hivemind
import pytest
import torch

from client.pipeline.discovery import start_dht
from client.sparta import AveragingResult, SpartaAverager, SpartaSettings
from tests.fake_hub import FakeHub

FAST = SpartaSettings(min_matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=4.0,
                      allreduce_timeout=8.0, chunk_timeout=1.5)


@pytest.fixture
def new_dht(dht: hivemind.DHT) -> Iterator[Callable[[], hivemind.DHT]]:
    """Start DHT nodes joined to the session's node; all are shut down at the end of the test."""
    started: list[hivemind.DHT] = []

    def new() -> hivemind.DHT:
        node = start_dht([str(a) for a in dht.get_visible_maddrs()])
        started.append(node)
        return node

    yield new
    for node in started:
        node.shutdown()


@pytest.fixture
def make_averager(new_dht, run_id: str) -> Iterator[Callable[..., SpartaAverager]]:
    """``make_averager(named_parameters, **options)``: a SpartaAverager on a fresh DHT node of this test's run."""
    started: list[SpartaAverager] = []

    def make(named_parameters: Sequence[tuple[str, torch.Tensor]], **options: object) -> SpartaAverager:
        options.setdefault("stage", "body1")
        options.setdefault("partitions", 1)
        options.setdefault("seed", 0)
        options.setdefault("settings", FAST)
        averager = SpartaAverager(named_parameters, new_dht(), run_id=run_id, **options)  # type: ignore[arg-type]
        started.append(averager)
        return averager

    yield make
    for averager in started:
        averager.shutdown()


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


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub().start()
    yield hub
    hub.shutdown()
    hub.server_close()
