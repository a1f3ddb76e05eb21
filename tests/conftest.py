"""Fixtures every suite that talks over hivemind shares: one loopback DHT node per session, a run id per test,
more DHT nodes and SPARTA averagers joined to it, and a fake Hugging Face Hub."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence

import hivemind
import pytest
import torch

from client.averaging.sparta import SpartaAverager
from client.pipeline.discovery import start_dht
from tests.averagers import FAST
from tests.fake_hub import FakeHub


@pytest.fixture(scope="session")
def dht() -> Iterator[hivemind.DHT]:
    """One DHT node on loopback: workers and trainers share it, and other nodes bootstrap from it."""
    node = start_dht()
    yield node
    node.shutdown()


@pytest.fixture
def run_id() -> str:
    """A fresh run id: records of one test never reach another through the shared DHT."""
    return f"test-{uuid.uuid4().hex[:8]}"


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


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub().start()
    yield hub
    hub.shutdown()
    hub.server_close()
