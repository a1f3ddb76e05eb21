"""Fixtures every suite that talks over hivemind shares: one loopback DHT node per session, a run id per test,
more DHT nodes and SPARTA averagers joined to it, and a fake Hugging Face Hub."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack

import hivemind
import pytest
import torch
from hypothesis import settings
from solders.keypair import Keypair

from client.averaging.gradients import GradientAverager, GradientSettings
from client.averaging.membership import Membership, Roster
from client.averaging.sparta import SpartaAverager
from client.pipeline.discovery import start_dht
from tests.averagers import GRADIENTS, STEADY
from tests.fake_hub import FakeHub

# Property tests draw the same examples on every run, so that a run's verdict is the code's and not the draw's;
# HYPOTHESIS_PROFILE=explore draws afresh (and keeps what it finds in .hypothesis/) when hunting for new cases.
settings.register_profile("reproducible", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "reproducible"))


@pytest.fixture(autouse=True)
def signals_as_found() -> Iterator[None]:
    """A command run in-process installs the handlers its own process keeps to its end (``join-run``'s Stopper);
    the test process gets its own back, or a later SIGTERM (CI's time limit among them) would reach a finished
    command's Stopper instead of pytest."""
    found = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in found.items():
        signal.signal(sig, handler)


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
    """``make_averager(named_parameters, **options)``: a SpartaAverager on a fresh DHT node of this test's run,
    with a key of its own put on the test's roster (``make_averager.members``), which every averager made
    here reads unless ``roster`` says otherwise; ``enrol=False`` leaves the key off it (a stranger); ``cls``
    a subclass (an attacker). Its timeouts are ``STEADY``'s, which a loaded machine's stalls do not cut short;
    a test of what a timeout does gives its own."""
    defaults = {"stage": "body1", "partitions": 1, "seed": 0, "settings": STEADY}
    members: set[bytes] = set()

    def test_roster() -> Roster:
        return Roster(0, frozenset(members))

    with ExitStack() as started:
        def make(named_parameters: Sequence[tuple[str, torch.Tensor]], *, keypair: Keypair | None = None,
                 roster: Callable[[], Roster] = test_roster, enrol: bool = True,
                 cls: type[SpartaAverager] = SpartaAverager, **options: object) -> SpartaAverager:
            keypair = keypair or Keypair()
            if enrol:
                members.add(bytes(keypair.pubkey()))
            averager = cls(named_parameters, own_dht(), run_id=run_id,
                                      membership=Membership(keypair, roster),
                                      **{**defaults, **options})  # type: ignore[arg-type]
            started.callback(averager.shutdown)
            return averager

        make.members = members  # type: ignore[attr-defined]
        yield make


@pytest.fixture
def make_grad_averager(own_dht, run_id: str) -> Iterator[Callable[..., GradientAverager]]:
    """``make_grad_averager(pairs, settings)``: a GradientAverager (full mode by default) on a fresh DHT node,
    with a key of its own on the test's roster (``keypair``, or a fresh one; ``enrol=False``: a stranger, whose own
    roster lists it). The roster's one trainer is ``make_grad_averager.trainer``, whose signed Backwards credit
    work."""
    members: set[bytes] = set()
    trainer = Keypair()
    trainers = frozenset({bytes(trainer.pubkey())})
    with ExitStack() as started:
        def make(pairs: list[tuple[str, torch.Tensor]], settings: GradientSettings | None = None,
                 cls: type[GradientAverager] = GradientAverager, stage: str = "body1",
                 enrol: bool = True, keypair: Keypair | None = None) -> GradientAverager:
            keypair = keypair or Keypair()
            if enrol:
                members.add(bytes(keypair.pubkey()))
            roster = (lambda: Roster(0, frozenset(members), trainers)) if enrol else (
                lambda: Roster(0, frozenset({*members, bytes(keypair.pubkey())}), trainers))
            averager = cls(pairs, own_dht(), run_id=run_id, stage=stage, seed=7, settings=settings or GRADIENTS,
                           membership=Membership(keypair, roster))
            started.callback(averager.shutdown)
            return averager

        make.trainer = trainer  # type: ignore[attr-defined]
        yield make


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub().start()
    yield hub
    hub.shutdown()
    hub.server_close()
