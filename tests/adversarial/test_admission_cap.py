"""A contributor's cap, attacked on the TCP backend through the real auth service (HTTP on loopback, SQLite) and the
real coordinator server (issue 21, attack 1): with ``max_slots_per_token = 1``, one Hub token takes a slot, joins,
leaves (or lets its lease lapse) and takes another with a fresh key, again and again, in any order, and also hoards
countersignatures to use after its slot ended. The service tells the coordinator of every slot that ends through the
real release path of ``psyswarm auth-service`` (``coordinator_release``: a TCP connection signed by the join
authority), and the coordinator keeps one live key per slot and refuses a join past its deadline; after every step,
never more than one of the token's keys may be queued or admitted. The old service freed a slot at once and the
coordinator never learnt of it: six keys of one contributor were queued while the service showed none.

Both the service and the server read one clock the test moves, so leases lapse and deadlines pass in a moment."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from client.backends.base import BackendError
from client.backends.tcp import TcpBackend
from client.commands.auth import coordinator_release
from client.join import auth as auth_client
from client.join.auth import AuthError, AuthSession
from coordinator_program.spec.errors import CoordinatorError
from coordinator_program.spec.instructions import JoinRun
from coordinator_program.spec.state import CoordinatorState, Health, Role
from local_backend import protocol as p
from local_backend.auth.app import AuthHTTPServer
from local_backend.auth.release import release_ended
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore
from tests.adversarial.test_admission_tcp import SPEC, authority_of
from tests.join.test_auth import RUN, serving

LEASE = 20.0
STEPS = 120


class Clock:
    """Real time, moved on by the test; ``time()`` is what the contributor's auth client signs its requests with."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def time(self) -> float:
        return self()


class Cached:
    """A co-signer that hands out a countersignature obtained earlier."""

    def __init__(self, authority: Pubkey, signature: Signature) -> None:
        self.authority, self.signature = authority, signature

    def pubkey(self) -> Pubkey:
        return self.authority

    def sign_message(self, message: bytes) -> Signature:
        return self.signature


@dataclass
class Process:
    """One of the contributor's processes: its own key, its slot if it got one, a hoarded countersigned join."""

    keypair: Keypair = field(default_factory=Keypair)
    session: AuthSession | None = None
    hoard: tuple[TcpBackend, JoinRun, Signature] | None = None
    connections: list[TcpBackend] = field(default_factory=list)  # kept open: the server withdraws a key that hangs up


class Contributor:
    """Alice, who holds one token and tries every order of grants, joins, leaves, lapses and hoarded joins."""

    def __init__(self, service: AuthHTTPServer, address: str, clock: Clock, rng: random.Random) -> None:
        self.service, self.address, self.clock, self.rng = service, address, clock, rng
        self.processes: list[Process] = []
        self.tried: dict[str, int] = {}

    def keys(self) -> set[bytes]:
        return {bytes(process.keypair.pubkey()) for process in self.processes}

    def holding(self) -> list[Process]:
        """The processes whose slot's lease has not lapsed (by their grant)."""
        return [process for process in self.processes
                if process.session is not None and process.session.grant.expires > self.clock()]

    def join_of(self, process: Process) -> JoinRun:
        grant = process.session.grant  # type: ignore[union-attr]
        return JoinRun(RUN, Role.Worker, grant.stage, grant.slot, int(self.clock()) + 10)

    async def step(self) -> None:
        action = self.rng.choice(["grant", "grant", "grant", "join", "join", "hoard", "use-hoard", "leave", "leave",
                                  "renew", "lapse", "wait", "wait", "wait"])
        self.tried[action] = self.tried.get(action, 0) + 1
        try:
            await getattr(self, action.replace("-", "_"))()
        except (AuthError, CoordinatorError, BackendError):
            pass  # refused: what the cap is for

    async def grant(self) -> None:
        """A new process takes a slot and joins with it at once."""
        process = Process()
        self.processes.append(process)
        process.session = await asyncio.to_thread(AuthSession.open, self.service.url, process.keypair, RUN,
                                                  "tok-alice", "worker")
        await self.join(process)

    async def join(self, process: Process | None = None) -> None:
        if process is not None or self.holding():
            process = process or self.rng.choice(self.holding())
            backend = TcpBackend(self.address, process.keypair, authorizer=ThreadedCosigner(process.session))
            await backend.connect()
            process.connections.append(backend)
            await backend.submit(self.join_of(process))

    async def hoard(self) -> None:
        """Have the service countersign a join, and keep it (and its connection) for later."""
        if self.holding():
            process = self.rng.choice(self.holding())
            backend = TcpBackend(self.address, process.keypair)
            await backend.connect()
            process.connections.append(backend)
            join = self.join_of(process)
            signed = p.request_message(backend._challenge, backend._sequence + 1, join.encode())
            message = p.join_authorization(bytes(process.keypair.pubkey()), signed)
            signature = await asyncio.to_thread(process.session.sign_message, message)  # type: ignore[union-attr]
            process.hoard = (backend, join, signature)

    async def use_hoard(self) -> None:
        hoarders = [process for process in self.processes if process.hoard is not None]
        if hoarders:
            process = self.rng.choice(hoarders)
            backend, join, signature = process.hoard  # type: ignore[misc]
            process.hoard = None
            backend.authorizer = Cached(Pubkey.from_bytes(authority_of(self.service)), signature)
            await backend.submit(join)

    async def leave(self) -> None:
        if self.holding():
            process = self.rng.choice(self.holding())
            session, process.session = process.session, None
            await asyncio.to_thread(session.client.leave)  # type: ignore[union-attr]

    async def renew(self) -> None:
        if self.holding():
            await asyncio.to_thread(self.rng.choice(self.holding()).session.renew)  # type: ignore[union-attr]

    async def lapse(self) -> None:
        self.clock.advance(LEASE + 1)

    async def wait(self) -> None:
        self.clock.advance(self.rng.choice([1.0, 5.0, 12.0]))

    async def close(self) -> None:
        for process in self.processes:
            for backend in process.connections:
                await backend.close()


class ThreadedCosigner:
    """An ``AuthSession`` as the backend's co-signer, asked off the event loop (the server shares the loop)."""

    def __init__(self, session: AuthSession | None) -> None:
        assert session is not None
        self.session = session

    def pubkey(self) -> Pubkey:
        return self.session.pubkey()

    def sign_message(self, message: bytes) -> Signature:
        return self.session.sign_message(message)


def live_keys(state: CoordinatorState) -> set[bytes]:
    """Keys queued, or admitted and healthy: the ones the coordinator counts on."""
    return {j.id for j in state.pending} | {c.id for c in state.clients if c.health == Health.Healthy}


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_one_token_never_has_more_keys_in_the_run_than_its_cap(fake_hub, tmp_path: Path, seed: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(auth_client, "time", clock)
    with serving(fake_hub, capacity=6, max_slots_per_token=1, lease_seconds=LEASE, clock=clock, clock_margin=2.0,
                 tells_coordinator=True) as service:

        async def main() -> None:
            server = CoordinatorServer(SPEC, RunStore(tmp_path / f"run-{seed}.sqlite"), Keypair(), clock,
                                       join_authority=authority_of(service))
            address = f"127.0.0.1:{await server.start(port=0)}"
            release = coordinator_release(address, None, RUN, None, service.service.keypair)
            alice = Contributor(service, address, clock, random.Random(seed))
            ever: set[bytes] = set()
            try:
                for _ in range(STEPS):
                    await alice.step()
                    await asyncio.to_thread(release_ended, service.service, release)
                    admitted = live_keys(server.state) & alice.keys()
                    ever |= admitted
                    assert len(admitted) <= 1, f"{len(admitted)} of one token's keys are in the run ({alice.tried})"
                assert len(ever) >= 3, (ever, alice.tried)  # she got key after key in, one at a time
                # Once her slots have ended and their keys left, she joins again as an honest contributor does.
                while alice.holding():
                    await alice.leave()
                clock.advance(LEASE + 15)
                await asyncio.to_thread(release_ended, service.service, release)
                await alice.grant()
                assert live_keys(server.state) & alice.keys() == {bytes(alice.processes[-1].keypair.pubkey())}
            finally:
                await alice.close()
                await server.stop()

        asyncio.run(main())


def test_slots_that_ended_together_are_released_over_one_connection(fake_hub, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of the releaser opened a connection per ended slot, each downloading the run's whole state (at 1,024
    clients, on every pass while the coordinator refused): the keys of one pass share one connection now, and every
    one of them leaves the coordinator and frees its slot."""
    clock = Clock()
    monkeypatch.setattr(auth_client, "time", clock)
    with serving(fake_hub, capacity=6, max_slots_per_token=4, lease_seconds=LEASE, clock=clock, clock_margin=2.0,
                 tells_coordinator=True) as service:

        async def main() -> None:
            server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), Keypair(), clock,
                                       join_authority=authority_of(service))
            address = f"127.0.0.1:{await server.start(port=0)}"
            alice = Contributor(service, address, clock, random.Random(0))
            try:
                for _ in range(3):
                    await alice.grant()
                assert live_keys(server.state) & alice.keys() == alice.keys() and len(alice.keys()) == 3
                connected: list[bytes] = []
                connect = TcpBackend.connect

                async def counted(backend: TcpBackend, *args, **kwargs) -> None:
                    connected.append(backend.identity)
                    await connect(backend, *args, **kwargs)

                monkeypatch.setattr(TcpBackend, "connect", counted)
                clock.advance(LEASE + 15)  # every lease lapses, and every countersigned deadline passes
                release = coordinator_release(address, None, RUN, None, service.service.keypair)
                assert await asyncio.to_thread(release_ended, service.service, release) == 3
                assert connected == [bytes(service.service.keypair.pubkey())]
                assert live_keys(server.state) & alice.keys() == set()
                assert await asyncio.to_thread(release_ended, service.service, release) == 0 and len(connected) == 1
            finally:
                await alice.close()
                await server.stop()

        asyncio.run(main())
