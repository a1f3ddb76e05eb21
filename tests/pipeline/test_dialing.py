"""What a trainer dials: only the workers its run can have (``client.pipeline.addresses.Dialing``).

A worker's record is signed by a member, and the member chooses the address in it. In a run across the internet
an honest worker names an internet address (``--public-host``), so a record naming the trainer's own machine, its
private network, or a gRPC target that is no host at all (``unix:/path``) is a member pointing trainers at services
of theirs. Here the "internal service" is a socket on 127.0.0.1 that counts who connects."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace

import pytest
from hivemind.utils import get_dht_time
from hypothesis import given
from hypothesis import strategies as st
from solders.keypair import Keypair

from client.pipeline.addresses import (
    GLOBAL,
    LOOPBACK,
    PRIVATE,
    RESOLVE_WAIT,
    RESOLVED_FOR,
    RETRY_AFTER,
    Dialing,
    Resolving,
    endpoint,
    reach_of,
    split_endpoint,
)
from client.pipeline.discovery import STATE_UP, WorkerDirectory, WorkerRecord, stage_key
from client.pipeline.router import StageUnavailable
from client.pipeline.trainer import PipelineTrainer
from client.sealed import store_sealed
from client.stages import default_index
from tests.pipeline.test_pipeline import STAGES

from .conftest import TINY, wait_until

ACROSS_THE_INTERNET = Dialing(frozenset({GLOBAL}))  # the reach of a trainer whose DHT node is on the internet


@pytest.fixture
def internal_service() -> Iterator[tuple[int, list[str]]]:
    """A TCP service on 127.0.0.1 that accepts and closes connections; yields its port and who connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    callers: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, peer = server.accept()
            except TimeoutError:
                continue
            callers.append(f"{peer[0]}:{peer[1]}")
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], callers
    stop.set()
    thread.join()
    server.close()


def announce(dht, run_id: str, stage: str, address: str) -> WorkerRecord:
    """A member's worker record for ``stage`` naming ``address``, signed and stored as a worker stores its own."""
    keypair = Keypair()
    record = WorkerRecord(run_id=run_id, stage=stage, uid=f"{stage}.0.{default_index(bytes(keypair.pubkey()))}",
                          address=address, sync_phase=0, load=0, throughput=0.0, model=TINY.fingerprint(), pubkey="",
                          expires=get_dht_time() + 30, state=STATE_UP).signed_by(keypair)
    assert store_sealed(dht, keypair, stage_key(run_id, stage), asdict(record), record.expires)
    return record


def train(directory: WorkerDirectory, dataset, run_id: str, stall_timeout: float) -> None:
    trainer = PipelineTrainer(TINY, dataset, directory, run_id=run_id, refresh_period=0.5, stall_timeout=stall_timeout)
    try:
        trainer.train([0, 1], 2)
    finally:
        trainer.close()


def test_a_member_cannot_point_trainers_at_the_trainers_machine(dht, run_id, dataset, internal_service,
                                                                caplog) -> None:
    port, callers = internal_service
    for stage, host in zip(STAGES, ("127.0.0.1", "localhost", "127.0.0.1"), strict=True):
        announce(dht, run_id, stage, f"{host}:{port}")

    # A run on this machine alone dials loopback workers: the records are listed, and a trainer calls the service.
    on_this_machine = WorkerDirectory(dht, run_id, TINY.fingerprint())
    assert on_this_machine.dialing.reach == {LOOPBACK, PRIVATE, GLOBAL}
    wait_until(lambda: all(on_this_machine.workers(s) for s in STAGES), what="the member's records")
    with pytest.raises(Exception):  # noqa: B017 - whatever the call fails with, it reached the service
        train(on_this_machine, dataset, run_id, stall_timeout=2.0)
    assert callers, "the attack's control: a loopback run's trainer dials the record's address"

    # A trainer of a run across the internet lists none of them, so it dials nothing, and says why.
    callers.clear()
    across = WorkerDirectory(dht, run_id, TINY.fingerprint(), ACROSS_THE_INTERNET)
    with caplog.at_level(logging.WARNING, logger="client.pipeline.discovery"):
        assert [across.records(s) for s in STAGES] == [[], [], []]
    assert f"its address localhost:{port} (127.0.0.1) is on this machine, and this client dials workers only on " \
           "the internet" in caplog.text
    with pytest.raises(StageUnavailable):
        train(across, dataset, run_id, stall_timeout=1.0)
    assert callers == []


@pytest.mark.parametrize("target", ["unix:/var/run/docker.sock", "unix-abstract:psyswarm", "dns:///example.org:443",
                                    "ipv4:127.0.0.1:80", "127.0.0.1", "[::1]", "0.0.0.0:7000", "224.0.0.1:7000",
                                    "[fe80::1%eth0]:7000", "127.0.0.1:0", "127.0.0.1:65536", "my host:7000"])
def test_a_record_naming_no_host_and_port_is_malformed(dht, run_id, target: str) -> None:
    good = announce(dht, run_id, "tail", "127.0.0.1:7000")
    announce(dht, run_id, "tail", target)
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint())
    assert [r.uid for r in directory.records("tail")] == [good.uid]
    with pytest.raises(ValueError, match="not a worker record|malformed"):
        WorkerRecord.from_value({**asdict(good), "address": target})


@pytest.mark.parametrize(("own", "dials"), [
    (["127.0.0.1"], {LOOPBACK, PRIVATE, GLOBAL}),  # a run on this machine alone
    (["127.0.0.1", "192.168.1.20"], {PRIVATE, GLOBAL}),  # listening on every interface of a LAN machine
    (["10.0.0.7"], {PRIVATE, GLOBAL}),
    (["203.0.113.7", "127.0.0.1"], {PRIVATE, GLOBAL}),  # documentation addresses are no internet ones
    (["8.8.8.8", "127.0.0.1"], {GLOBAL}),
    (["2606:4700::1"], {GLOBAL}),
    (["node.example.org"], {GLOBAL}),  # announced by name (--public-host): reached across the internet
    ([], {GLOBAL}),
    (["127.0.0.1", "0.0.0.0"], {GLOBAL}),  # an address it cannot be reached at says nothing of its network
    (["127.0.0.1", "not an address"], {GLOBAL}),
])
def test_a_client_dials_the_scopes_its_own_node_is_reached_in(own: list[str], dials: set[str]) -> None:
    assert reach_of(own) == dials


def test_a_name_is_dialled_at_the_address_it_resolved_to_until_it_is_looked_up_again() -> None:
    answers, now = ["8.8.8.8"], [0.0]
    dialing = Dialing(frozenset({GLOBAL}), resolve=lambda name, port, type: [(0, type, 0, "", (answers[0], 0))],
                      clock=lambda: now[0])
    assert dialing.target("worker.example.org:7000") == "8.8.8.8:7000"
    answers[0] = "127.0.0.1"  # the name now resolves to the trainer's own machine (DNS rebinding)
    assert dialing.target("worker.example.org:7000") == "8.8.8.8:7000"  # dialled where it was checked
    now[0] = RESOLVED_FOR + 1
    with pytest.raises(ValueError, match=r"worker.example.org:7000 \(127.0.0.1\) is on this machine"):
        dialing.target("worker.example.org:7000")

    def fails(*_: object, **__: object) -> list:
        raise socket.gaierror("Name or service not known")

    with pytest.raises(ValueError, match="its address's name gone.example.org does not resolve"):
        Dialing(frozenset({GLOBAL}), resolve=fails).target("gone.example.org:7000")


@given(st.one_of(st.text(max_size=40), st.from_regex(r"\[?[0-9a-fA-F:.%a-z\[\]-]{0,30}\]?:[0-9]{0,6}",
                                                       fullmatch=True)))
def test_any_address_splits_into_a_host_and_port_that_name_it_or_is_refused(text: str) -> None:
    try:
        host, port = split_endpoint(text)
    except ValueError as exc:
        assert repr(text) in str(exc)
        return
    assert endpoint(host, port) == text and 0 < port < 65536


def test_records_keep_their_signature_unless_a_name_was_resolved(dht, run_id) -> None:
    record = announce(dht, run_id, "head", "127.0.0.1:7000")
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint())
    [listed] = wait_until(lambda: directory.records("head"), what="the record")
    assert listed == record and listed.verifies()
    named = announce(dht, run_id, "body1", "localhost:7000")
    [resolved] = wait_until(lambda: directory.records("body1"), what="the named record")
    assert resolved.address == "127.0.0.1:7000" and resolved == replace(named, address="127.0.0.1:7000")


class SlowResolver:
    """A resolver that answers only when told to (``answer``), counting its lookups."""

    def __init__(self, ip: str = "8.8.8.8") -> None:
        self.ip, self.go, self.lookups = ip, threading.Event(), 0

    def __call__(self, name: str, port: object, type: int) -> list:
        self.lookups += 1
        assert self.go.wait(30)
        return [(0, type, 0, "", (self.ip, 0))]


def test_a_slow_resolver_holds_a_caller_up_no_longer_than_the_wait_and_its_name_is_dialled_once_it_answers() -> None:
    """A member names its worker by a DNS name whose resolver it controls and answers slowly: the lookup runs on a
    thread of its own, the caller waits ``RESOLVE_WAIT`` at most, and the record waits (``Resolving``) until the
    answer, which is then checked and dialled as any other."""
    now, resolver = [0.0], SlowResolver()
    dialing = Dialing(frozenset({GLOBAL}), resolve=resolver, clock=lambda: now[0])
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(Resolving):
            dialing.target("slow.example.org:7000")
    assert time.monotonic() - started < RESOLVE_WAIT + 1.0  # one wait, by the call that started the lookup
    resolver.go.set()
    assert wait_until(lambda: _dialled(dialing, "slow.example.org:7000"), what="the answer") == "8.8.8.8:7000"
    resolver.go.clear()  # its next lookup is slow again: meanwhile the name is dialled where it was checked
    now[0] = RESOLVED_FOR + 1
    assert dialing.target("slow.example.org:7000") == "8.8.8.8:7000"
    assert resolver.lookups == 2
    resolver.go.set()


def _dialled(dialing: Dialing, address: str) -> str | None:
    try:
        return dialing.target(address)
    except Resolving:
        return None


def test_a_name_that_does_not_resolve_is_looked_up_again_only_after_a_while() -> None:
    now, calls = [0.0], []

    def fails(*_: object, **__: object) -> list:
        calls.append(1)
        raise socket.gaierror("Name or service not known")

    dialing = Dialing(frozenset({GLOBAL}), resolve=fails, clock=lambda: now[0])
    for _ in range(3):
        with pytest.raises(ValueError, match="does not resolve"):
            dialing.target("gone.example.org:7000")
    assert len(calls) == 1
    now[0] = RETRY_AFTER + 1
    with pytest.raises(ValueError, match="does not resolve"):
        dialing.target("gone.example.org:7000")
    assert len(calls) == 2


def test_a_directory_lists_a_named_worker_once_its_slow_lookup_answers_without_waiting_for_it(dht, run_id) -> None:
    resolver = SlowResolver("127.0.0.1")
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint(), dialing=Dialing(frozenset({LOOPBACK}),
                                                                                 resolve=resolver))
    announce(dht, run_id, "head", "127.0.0.1:7000")
    announce(dht, run_id, "head", "slow.example.org:7001")
    wait_until(lambda: directory.records("head"), what="the record named by its address")
    started = time.monotonic()
    listed = directory.records("head")
    assert time.monotonic() - started < 1.0 and [r.address for r in listed] == ["127.0.0.1:7000"]
    resolver.go.set()
    wait_until(lambda: len(directory.records("head")) == 2, what="the named record")
    assert sorted(r.address for r in directory.records("head")) == ["127.0.0.1:7000", "127.0.0.1:7001"]
