"""Fixtures every suite that talks over hivemind shares: one loopback DHT node per session, a run id per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import hivemind
import pytest

from client.pipeline.discovery import start_dht


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
