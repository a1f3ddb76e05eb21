"""The server's broadcast (issue 22), on the real server over real sockets: a follower that applies the patches it
is sent holds the server's account byte for byte after any sequence of changes, and one that stops reading costs
the server a bounded backlog, gets no patch it could not apply, and holds the current state once it reads again."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from coordinator_program.spec import rules
from coordinator_program.spec.errors import CoordinatorError
from coordinator_program.spec.instructions import JoinRun, Tick, Withdraw
from coordinator_program.spec.state import CoordinatorState, Role, encode_state
from local_backend import peers
from local_backend import protocol as p
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore
from tests.adversarial.test_server_limits import SPEC
from tests.adversarial.test_server_storage import Clock

SMALL_BUFFER = 4096


class Follower:
    """A follower on a raw socket with a small receive buffer, that reads only when told to: it checks that each
    patch starts from the state it holds, as the client does."""

    def __init__(self) -> None:
        self.key = Keypair()
        self.account = b""
        self.resyncs = 0

    async def connect(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)  # before connect: the window offered
        self.sock.setblocking(False)
        self.unread = bytearray()
        await asyncio.get_running_loop().sock_connect(self.sock, ("127.0.0.1", port))
        challenge = p.decode(await self.frame())
        assert isinstance(challenge, p.Challenge)
        signature = bytes(self.key.sign_message(p.auth_message(challenge.nonce)))
        await asyncio.get_running_loop().sock_sendall(
            self.sock, p.frame(p.Hello(bytes(self.key.pubkey()), signature).encode()))
        assert isinstance(p.decode(await self.frame()), p.Welcome)
        full = p.decode(await self.frame())
        assert isinstance(full, p.FullState)
        self.account = full.account()

    async def frame(self) -> bytes:
        """The next frame's payload, read from the socket only now (nothing reads it in the background)."""
        length = p.frame_length(await self.take(4), p.MAX_FRAME)
        return await self.take(length)

    async def take(self, n: int) -> bytes:
        while len(self.unread) < n:
            chunk = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(self.sock, 1 << 16), 10)
            assert chunk, "the server closed the connection"
            self.unread += chunk
        data = bytes(self.unread[:n])
        del self.unread[:n]
        return data

    async def catch_up(self, nonce: int) -> None:
        """Read until holding ``nonce``, applying what comes as the client does."""
        while p.account_nonce(self.account) != nonce:
            message = p.decode(await self.frame())
            if isinstance(message, p.StatePatch):
                assert message.base == p.account_nonce(self.account), "a patch from a state this follower never held"
                self.account = message.apply(self.account)
            elif isinstance(message, p.FullState):
                self.account = message.account()
                self.resyncs += 1


async def serving(tmp_path: Path, clock: Clock) -> tuple[CoordinatorServer, int]:
    """A server of the small run on a free port, its database in ``tmp_path``, open to any joiner."""
    server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), Keypair(), clock,
                               join_authority=rules.NO_AUTHORITY)
    return server, await server.start(port=0)


async def change_at_random(server: CoordinatorServer, clock: Clock, rng: random.Random, keys: list[bytes]) -> None:
    """One request the way a client sends it: a join, a withdrawal or a tick, with time moving on; the
    coordinator's refusals are part of the sequence."""
    who = rng.choice(keys)
    instruction = rng.choice([JoinRun(SPEC.run_id, rng.choice(list(Role))).encode(), Withdraw().encode(),
                              Tick().encode()])
    clock.now += rng.choice([0, 1, SPEC.config.warmup_time])
    try:
        await server.submit(who, instruction)
    except CoordinatorError:
        pass


def test_a_follower_holds_the_servers_account_after_random_changes(tmp_path: Path) -> None:
    async def main() -> None:
        clock = Clock()
        server, port = await serving(tmp_path, clock)
        client, raw = TcpBackend(f"127.0.0.1:{port}", Keypair()), Follower()
        try:
            await client.connect()
            await raw.connect(port)
            rng = random.Random(22)
            keys = [bytes(Keypair().pubkey()) for _ in range(10)]
            for _ in range(150):
                await change_at_random(server, clock, rng, keys)
            await raw.catch_up(server.state.nonce)
            await client.wait_for(lambda s: s.nonce == server.state.nonce, 10)
            assert server.state.nonce > 40, "the sequence changed the state many times"
            assert raw.account == server.account == client._account
            assert client.state == server.state
        finally:
            await client.close()
            raw.sock.close()
            await server.stop()

    asyncio.run(main())


def test_a_follower_that_stops_reading_is_held_to_a_bounded_backlog_and_resynchronises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every patch was queued for it until 256 KiB of them had piled up, then it was cut off."""
    monkeypatch.setattr(peers, "FALLEN_BEHIND", SMALL_BUFFER // 4)

    async def main() -> None:
        clock = Clock()
        server, port = await serving(tmp_path, clock)
        lagging = Follower()
        try:
            await lagging.connect(port)
            held = next(peer for peer in server.peers if peer.identity == bytes(lagging.key.pubkey()))
            held._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
            largest_backlog = 0
            rng = random.Random(7)
            keys = [bytes(Keypair().pubkey()) for _ in range(10)]
            for _ in range(300):
                await change_at_random(server, clock, rng, keys)
                largest_backlog = max(largest_backlog, held._transport.get_write_buffer_size())
            assert not held.closed, "a follower that reads slowly stays connected"
            assert largest_backlog <= SMALL_BUFFER // 4 + len(server._full_state_frame()), largest_backlog
            await lagging.catch_up(server.state.nonce)
            assert lagging.resyncs >= 1, "it was sent the whole state in place of the patches it missed"
            assert lagging.account == server.account
            await change_at_random(server, clock, rng, keys)  # and it follows by patches again
            await change_at_random(server, clock, rng, keys)
            await lagging.catch_up(server.state.nonce)
            assert lagging.account == server.account
        finally:
            lagging.sock.close()
            await server.stop()

    asyncio.run(main())


def test_a_follower_that_stops_reading_holds_up_no_other(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one follower reads nothing, another that reads gets every change as a patch from the state it holds,
    in order, as each is made: the fan-out neither waits for the stalled one nor resynchronises the others."""
    monkeypatch.setattr(peers, "FALLEN_BEHIND", SMALL_BUFFER // 4)

    async def main() -> None:
        clock = Clock()
        server, port = await serving(tmp_path, clock)
        lagging, steady = Follower(), Follower()
        try:
            await lagging.connect(port)
            await steady.connect(port)
            held = next(peer for peer in server.peers if peer.identity == bytes(lagging.key.pubkey()))
            held._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
            rng = random.Random(11)
            keys = [bytes(Keypair().pubkey()) for _ in range(10)]
            changes = 0
            for _ in range(300):
                before = server.state.nonce
                await change_at_random(server, clock, rng, keys)
                await steady.catch_up(server.state.nonce)  # within catch_up's 10 s a read, or the test fails
                changes += server.state.nonce - before
                assert steady.account == server.account
            assert held.behind and held.resync is not None, "the stalled follower fell behind and was skipped"
            assert changes > 40 and steady.resyncs == 0, "the reader got every change as a patch"
            await lagging.catch_up(server.state.nonce)
            assert lagging.account == server.account
        finally:
            lagging.sock.close()
            steady.sock.close()
            await server.stop()

    asyncio.run(main())


@pytest.mark.parametrize("failure", [CoordinatorError("refused after writing"), ValueError("a bug")])
def test_a_change_that_writes_then_fails_is_never_kept_nor_sent(tmp_path: Path, failure: Exception) -> None:
    """A change is applied to a spare copy of the state taken after the last one: one that wrote to it before it
    failed leaves the state as stored, followers get nothing of it, and the changes after it start from the stored
    state (the written-to copy is never the next change's spare)."""
    async def main() -> None:
        clock = Clock()
        server, port = await serving(tmp_path, clock)
        raw = Follower()
        try:
            await raw.connect(port)
            joiner, other = bytes(Keypair().pubkey()), bytes(Keypair().pubkey())
            await server.submit(joiner, JoinRun(SPEC.run_id, Role.Worker).encode())  # a real change first
            stored = server.account

            def write_then_fail(state: CoordinatorState) -> None:
                rules.join(state, other, SPEC.run_id, Role.Worker, 255, other)
                state.nonce += 1
                raise failure

            with pytest.raises(type(failure)):
                await server._serialised(lambda: server._change(other, Tick().encode(), write_then_fail))
            assert server.account == stored == encode_state(server.state), "nothing of it kept, nothing sent"
            assert server.state.pending_index(other) is None and server.state.pending_index(joiner) is not None
            await raw.catch_up(server.state.nonce)
            assert raw.account == server.account
            await asyncio.sleep(0)  # the spare is taken
            await server.submit(joiner, Withdraw().encode())
            await raw.catch_up(server.state.nonce)
            assert server.state.pending_index(joiner) is None and server.state.pending_index(other) is None
            assert raw.account == server.account == encode_state(server.state)
            assert server.state.nonce == p.account_nonce(stored) + 1, "the next change starts from the stored state"
        finally:
            raw.sock.close()
            await server.stop()

    asyncio.run(main())
