"""Fixtures every suite that talks over hivemind shares: one loopback DHT node per session, a run id per test,
more DHT nodes and SPARTA averagers joined to it, and a fake Hugging Face Hub."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack

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


def _nodes_joined_to(bootstrap: hivemind.DHT, started: ExitStack) -> Callable[[], hivemind.DHT]:
    def new() -> hivemind.DHT:
        node = start_dht([str(a) for a in bootstrap.get_visible_maddrs()])
        started.callback(node.shutdown)
        return node

    return new


@pytest.fixture
def new_dht(dht: hivemind.DHT) -> Iterator[Callable[[], hivemind.DHT]]:
    """Start DHT nodes joined to the session's node; all are shut down at the end of the test."""
    with ExitStack() as started:
        yield _nodes_joined_to(dht, started)


@pytest.fixture
def own_dht() -> Iterator[Callable[[], hivemind.DHT]]:
    """Start DHT nodes on a network of this test's own, for peers that need only find each other (averagers,
    donors and joiners). The session's node has met every earlier test's nodes, which are gone by then: a
    donor's declaration or a matchmaking request routed towards them can go unseen."""
    with ExitStack() as started:
        bootstrap = start_dht()
        started.callback(bootstrap.shutdown)
        yield _nodes_joined_to(bootstrap, started)


@pytest.fixture
def make_averager(own_dht, run_id: str) -> Iterator[Callable[..., SpartaAverager]]:
    """``make_averager(named_parameters, **options)``: a SpartaAverager on a fresh DHT node of this test's run."""
    defaults = {"stage": "body1", "partitions": 1, "seed": 0, "settings": FAST}
    with ExitStack() as started:
        def make(named_parameters: Sequence[tuple[str, torch.Tensor]], **options: object) -> SpartaAverager:
            averager = SpartaAverager(named_parameters, own_dht(), run_id=run_id,
                                      **{**defaults, **options})  # type: ignore[arg-type]
            started.callback(averager.shutdown)
            return averager

        yield make


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub().start()
    yield hub
    hub.shutdown()
    hub.server_close()
