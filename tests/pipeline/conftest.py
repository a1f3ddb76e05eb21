"""Shared fixtures: a tiny model, the stdlib dataset, one real loopback DHT, workers that clean up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from client.pipeline.data import ByteDataset, open_dataset
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.model import ModelConfig
from client.pipeline.worker import StageWorker

TINY = ModelConfig(n_layers=3, d_model=32, n_heads=2, seq_len=16, num_stages=3, seed=7)


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def dataset() -> ByteDataset:
    return open_dataset(["stdlib"], TINY.seq_len)


@pytest.fixture
def directory(dht, run_id: str) -> WorkerDirectory:
    return WorkerDirectory(dht, run_id, TINY.fingerprint())


@pytest.fixture
def start_worker(dht, run_id: str) -> Iterator[Callable[..., StageWorker]]:
    """Start in-process workers announced under this test's run id; all are stopped at the end."""
    started: list[StageWorker] = []

    def start(stage: str, **options: object) -> StageWorker:
        options.setdefault("config", TINY)
        worker = StageWorker(stage=stage, dht=dht, run_id=run_id, **options)  # type: ignore[arg-type]
        started.append(worker.start())
        return worker

    yield start
    for worker in started:
        worker.stop(grace=0)


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
