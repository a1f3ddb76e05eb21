"""The TCP backend over real sockets: authentication, requests, bad input of every kind, and broadcasts."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.base import BackendError
from client.backends.tcp import TcpBackend
from coordinator_program.spec import derived, errors, rules
from coordinator_program.spec.bloom import build_filter, participant_key
from coordinator_program.spec.config import RunSpec, parse_run_spec
from coordinator_program.spec.instructions import JoinRun, Tick
from coordinator_program.spec.state import Phase, Role, encode_state
from local_backend import protocol as p
from local_backend.peers import Limits
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore

SPEC = parse_run_spec({
    "run_id": "srv-test",
    "config": {"min_clients": 4, "max_clients": 8, "witness_nodes": 3, "witness_quorum": 2, "warmup_time": 1,
               "max_round_train_time": 30, "round_witness_time": 1, "cooldown_time": 1, "rounds_per_epoch": 3},
    "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
})


def run_with_server(tmp_path: Path, body: Callable[[CoordinatorServer, str], Awaitable[None]], *,
                    spec: RunSpec = SPEC, join_authority: bytes = rules.NO_AUTHORITY,
                    limits: Limits = Limits()) -> None:
    """The real server on a free loopback port, around ``body(server, "host:port")``."""
    async def main() -> None:
        server = CoordinatorServer(spec, RunStore(tmp_path / "run.sqlite"), Keypair(),
                                   join_authority=join_authority, limits=limits)
        port = await server.start(port=0)
        try:
            await body(server, f"127.0.0.1:{port}")
        finally:
            await server.stop()

    asyncio.run(main())


async def raw_connection(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, p.Challenge]:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    challenge = p.decode(await p.read_frame(reader))
    assert isinstance(challenge, p.Challenge) and challenge.run_id == "srv-test"
    return reader, writer, challenge


async def next_message(reader: asyncio.StreamReader) -> p.Message:
    return p.decode(await asyncio.wait_for(p.read_frame(reader), 5))


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        await asyncio.wait_for(reader.read(), 5)
    except ConnectionError:
        pass
    return reader.at_eof()


async def pipeline(address: str, workers: int = 3, trainers: int = 1) -> list[TcpBackend]:
    clients = [TcpBackend(address, Keypair()) for _ in range(workers + trainers)]
    for i, c in enumerate(clients):
        await c.connect()
        await c.join(Role.Worker if i < workers else Role.Trainer)
    return clients


def test_join_admits_and_every_client_follows_the_same_state(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        clients = await pipeline(address)
        for c in clients:  # warmup lasts 1 s: a client that reads its states late may see training begun
            state = await c.wait_for(lambda s: s.phase in (Phase.Warmup, Phase.RoundTrain), 5)
            assert sorted(x.stage for x in state.clients) == [0, 1, 2, 255]
        await clients[0].wait_for(lambda s: s.phase == Phase.RoundTrain, 10)
        for c in clients:  # nothing is due for 30 s: every client converges on the server's exact bytes
            state = await c.wait_for(lambda s: s.nonce == server.state.nonce, 5)
            assert encode_state(state) == server.account
        for c in clients:
            await c.close()

    run_with_server(tmp_path, body)


def test_rejections_carry_the_coordinator_error_and_change_nothing(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        client = TcpBackend(address, Keypair())
        await client.connect()
        before = server.account
        with pytest.raises(errors.WrongRunId):
            await client.submit(JoinRun("other-run", Role.Worker, 255))
        with pytest.raises(errors.InvalidJoin):
            await client.submit(JoinRun("srv-test", Role.Trainer, 0))
        with pytest.raises(errors.NothingToTick):
            await client.submit(Tick())
        assert server.account == before
        await client.close()

    run_with_server(tmp_path, body)


def test_witness_from_a_client_that_was_not_elected(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        clients = await pipeline(address)
        state = await clients[0].wait_for(lambda s: s.phase == Phase.RoundTrain, 10)
        elected = set(derived.witnesses(state))
        outsider = next(c for c in clients if c.identity not in elected)
        bloom = build_filter(state.config, [participant_key(c.identity) for c in clients])
        before = server.account
        with pytest.raises(errors.NotAWitness):
            await outsider.witness(state.round.height, bloom, bloom)
        assert server.account == before
        for insider in [c for c in clients if c.identity in elected][:2]:  # a quorum ends training early
            await insider.witness(state.round.height, bloom, bloom)
        after = await clients[0].wait_for(lambda s: s.phase == Phase.RoundWitness, 5)
        assert after.round.witness_count == 2
        for c in clients:
            await c.close()

    run_with_server(tmp_path, body)


def test_bad_authentication_and_requests_before_it(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        # A signature by another key.
        reader, writer, challenge = await raw_connection(address)
        wrong = Keypair()
        writer.write(p.frame(p.Hello(bytes(Keypair().pubkey()), bytes(wrong.sign_message(
            p.auth_message(challenge.nonce)))).encode()))
        fatal = await next_message(reader)
        assert isinstance(fatal, p.Fatal) and "authentication failed" in fatal.message
        assert await closed(reader)
        # A request before Hello.
        reader, writer, challenge = await raw_connection(address)
        writer.write(p.frame(p.Request(1, Tick().encode(), bytes(64)).encode()))
        fatal = await next_message(reader)
        assert isinstance(fatal, p.Fatal) and "authenticate first" in fatal.message
        # Garbage instead of Hello.
        reader, writer, challenge = await raw_connection(address)
        writer.write(p.frame(b"\x99garbage"))
        fatal = await next_message(reader)
        assert isinstance(fatal, p.Fatal) and "unknown message type" in fatal.message
        assert server.state.pending == []

    run_with_server(tmp_path, body)


async def authenticated(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes, Keypair]:
    reader, writer, challenge = await raw_connection(address)
    me = Keypair()
    writer.write(p.frame(p.Hello(bytes(me.pubkey()), bytes(me.sign_message(p.auth_message(challenge.nonce))))
                         .encode()))
    assert isinstance(await next_message(reader), p.Welcome)
    assert isinstance(await next_message(reader), p.FullState)
    return reader, writer, challenge.nonce, me


def test_replays_bad_signatures_and_garbage_frames(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        watcher = TcpBackend(address, Keypair())
        await watcher.connect()
        reader, writer, challenge, me = await authenticated(address)
        join = JoinRun("srv-test", Role.Worker, 255).encode()
        signed = p.request_message(challenge, 5, join)
        good = p.Request(5, join, bytes(me.sign_message(signed)))
        writer.write(p.frame(good.encode()))
        messages = [await next_message(reader), await next_message(reader)]
        reply = next(m for m in messages if isinstance(m, p.Reply))
        assert reply.code == p.REPLY_OK
        nonce = server.state.nonce
        writer.write(p.frame(good.encode()))  # the same request again
        reply = await next_message(reader)
        assert isinstance(reply, p.Reply) and reply.code == p.REPLY_REPLAY
        forged = p.Request(6, join, bytes(Keypair().sign_message(p.request_message(challenge, 6, join))))
        writer.write(p.frame(forged.encode()))
        reply = await next_message(reader)
        assert isinstance(reply, p.Reply) and reply.code == p.REPLY_BAD_SIGNATURE
        writer.write(p.frame(b"\x82\x00\x01"))  # a truncated request in a valid frame
        reply = await next_message(reader)
        assert isinstance(reply, p.Reply) and reply.code == p.REPLY_MALFORMED and "truncated" in reply.message
        writer.write(p.frame(p.Request(7, b"\x00" * 12, bytes(me.sign_message(
            p.request_message(challenge, 7, b"\x00" * 12)))).encode()))
        reply = await next_message(reader)
        assert isinstance(reply, p.Reply) and reply.code == errors.MalformedInstruction.code
        assert server.state.nonce == nonce
        writer.write(struct.pack(">I", p.MAX_FRAME + 1))  # an oversized frame ends the connection
        fatal = await next_message(reader)
        assert isinstance(fatal, p.Fatal) and "exceeds" in fatal.message
        assert await closed(reader)
        # The other client is untouched and still follows the run.
        state = await watcher.wait_for(lambda s: s.nonce >= nonce, 5)
        assert state.phase == Phase.WaitingForMembers and watcher.connected
        await watcher.close()

    run_with_server(tmp_path, body)


def test_a_joiner_that_disconnects_leaves_the_queue(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        client = TcpBackend(address, Keypair())
        await client.connect()
        await client.join(Role.Trainer)
        assert server.state.pending_index(client.identity) is not None
        await client.close()
        for _ in range(50):
            if server.state.pending_index(client.identity) is None:
                break
            await asyncio.sleep(0.05)
        assert server.state.pending_index(client.identity) is None

    run_with_server(tmp_path, body)


def test_unreachable_server_says_what_to_do() -> None:
    async def body() -> None:
        client = TcpBackend("127.0.0.1:1", Keypair())
        with pytest.raises(BackendError, match="psyswarm serve"):
            await client.connect()

    asyncio.run(body())
    with pytest.raises(BackendError, match="HOST:PORT"):
        TcpBackend("localhost", Keypair())
