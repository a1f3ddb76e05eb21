"""The TCP server bounds what its peers hold (issue 12, item 5): each test abuses the real server over real
loopback sockets.

Before the fix, any fresh keypair could log in and hold a connection for ever, as many as the process's file
descriptors allowed: under a low open-file limit idle connections locked every newcomer out while asyncio's
accept retries filled the log, and logged-in connections each holding an unfinished 1 MiB frame grew the
server by 1 MiB apiece. The load tests run ``psyswarm serve`` in its own process, its open-file limit lowered
with ``setrlimit`` before it starts, and read its memory from /proc; the others run a ``CoordinatorServer`` in
the test's event loop with small limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from coordinator_program.spec.config import parse_run_spec
from coordinator_program.spec.state import Role
from local_backend import protocol as p
from local_backend.logs import LogThrottle
from local_backend.peers import Limits
from local_backend.server import CoordinatorServer
from tests.local_backend.test_server import run_with_server

SPEC = parse_run_spec({
    "run_id": "limits",
    "config": {"min_clients": 4, "max_clients": 8, "warmup_time": 5},
    "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
})
STATE_TOML = """
run_id = "limits"
[config]
min_clients = 4
max_clients = 8
warmup_time = 5
[model]
n_layers = 3
d_model = 16
n_heads = 2
seq_len = 8
"""
MiB = 1 << 20


# --- talking to the server ------------------------------------------------------------------------------

Raw = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_raw(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, p.Challenge]:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    challenge = p.decode(await asyncio.wait_for(p.read_frame(reader), 5))
    assert isinstance(challenge, p.Challenge)
    return reader, writer, challenge


async def say_hello(address: str, key: Keypair) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, p.Message]:
    """Log in as ``key``; the server's first answer (Welcome, or Fatal when it refuses)."""
    reader, writer, challenge = await open_raw(address)
    signature = bytes(key.sign_message(p.auth_message(challenge.nonce)))
    writer.write(p.frame(p.Hello(bytes(key.pubkey()), signature).encode()))
    return reader, writer, p.decode(await asyncio.wait_for(p.read_frame(reader), 5))


async def log_in(address: str, key: Keypair | None = None) -> Raw:
    """A logged-in connection that then does nothing at all: it answers no Ping."""
    reader, writer, answer = await say_hello(address, key or Keypair())
    assert isinstance(answer, p.Welcome), answer
    assert isinstance(p.decode(await asyncio.wait_for(p.read_frame(reader), 5)), p.FullState)
    return reader, writer


async def received(reader: asyncio.StreamReader, within: float) -> tuple[list[p.Message], bool]:
    """The messages that arrive within ``within`` seconds, and whether the server closed the connection."""
    messages: list[p.Message] = []
    try:
        async with asyncio.timeout(within):
            while True:
                messages.append(p.decode(await p.read_frame(reader)))
    except TimeoutError:
        return messages, False
    except (asyncio.IncompleteReadError, ConnectionError):
        return messages, True


def farewell(messages: list[p.Message]) -> str:
    """The reason the server gave for closing."""
    assert messages and isinstance(messages[-1], p.Fatal), messages
    return messages[-1].message


def serve_in_process(tmp_path: Path, body: Callable[[CoordinatorServer, str], Awaitable[None]], *,
                     limits: Limits = Limits()) -> None:
    run_with_server(tmp_path, body, spec=SPEC, limits=limits)


# --- the server in its own process ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(tmp_path: Path, *, open_files: int) -> Iterator[tuple[int, str, Path]]:
    """``psyswarm serve`` with its open-file limit (soft and hard) at ``open_files``: (pid, address, log)."""
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML)
    port, log = free_port(), tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db", str(tmp_path / "run.sqlite"),
             "--port", str(port), "--permissionless"], stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files)))
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            time.sleep(0.1)
        yield proc.pid, f"127.0.0.1:{port}", log
    finally:
        proc.terminate()
        proc.wait(10)


def rss(pid: int) -> int:
    """The resident memory of process ``pid``, in bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) * 1024


# --- the load tests ----------------------------------------------------------------------------------------

OPEN_FILES = 160
FLOOD = 500
RSS_GROWTH_UNDER_FLOOD = 24 * MiB


def test_500_idle_logins_past_the_open_file_limit_leave_room_for_a_fresh_client(tmp_path: Path) -> None:
    """500 fresh keys log in and then do nothing, more than the server's 160 descriptors could hold. The server
    keeps within its cap (the oldest outsiders give way, each told why), its run member keeps its connection, a
    fresh client is served within 1 s, memory grows by under 24 MiB, and the log stays small."""
    async def flood(pid: int, address: str) -> None:
        member = TcpBackend(address, Keypair())
        await member.connect()
        await member.join(Role.Trainer)
        before = rss(pid)
        gate = asyncio.Semaphore(20)

        async def one() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, p.Message]:
            async with gate:
                return await say_hello(address, Keypair())

        attempts = await asyncio.gather(*(one() for _ in range(FLOOD)))
        try:
            outcomes = await asyncio.gather(*(received(reader, 1.0) for reader, _, _ in attempts))
            still_open = [messages for messages, closed in outcomes if not closed]
            assert 50 <= len(still_open) < OPEN_FILES, "the server holds what its descriptors allow, no more"
            for (_, _, first), (messages, closed) in zip(attempts, outcomes, strict=True):
                if closed:  # refused cleanly: each was told why
                    reason = farewell([first, *messages])
                    assert "the server is full" in reason or "too many logins in progress" in reason, reason

            fresh = TcpBackend(address, Keypair())
            started = time.monotonic()
            await asyncio.wait_for(fresh.connect(), 1.0)
            assert time.monotonic() - started < 1.0
            assert fresh.state.pending_index(member.identity) is not None, "the member was pushed out of the run"
            assert member.connected
            assert rss(pid) - before < RSS_GROWTH_UNDER_FLOOD, f"grew from {before} to {rss(pid)} bytes"
            await fresh.close()
        finally:
            for _, writer, _ in attempts:
                writer.close()
            await member.close()

    with serve_process(tmp_path, open_files=OPEN_FILES) as (pid, address, log):
        asyncio.run(flood(pid, address))
        text = log.read_text()
    assert "cannot accept" not in text and "out of system resource" not in text, text[-2000:]
    assert f"the open-file limit ({OPEN_FILES}) allows" in text
    assert len(text) < 64 << 10, f"{len(text)} bytes of log"


RSS_GROWTH_UNDER_BIG_FRAMES = 8 * MiB


def test_100_unfinished_1mib_frames_do_not_grow_the_server(tmp_path: Path) -> None:
    """100 logged-in connections each announce a 1 MiB frame and send all but its last byte: each is refused at
    its header, and the server grows by under 8 MiB (it grew by about 100 MiB)."""
    async def big_frames(pid: int, address: str) -> None:
        connections = [await log_in(address) for _ in range(100)]
        before = rss(pid)
        for _, writer in connections:
            writer.write(struct.pack(">I", MiB) + bytes(MiB - 1))
        outcomes = await asyncio.gather(*(received(reader, 3.0) for reader, _ in connections))
        for messages, closed in outcomes:
            assert closed and f"frame of {MiB} bytes exceeds the {p.MAX_REQUEST_FRAME}-byte limit" in farewell(messages)
        assert rss(pid) - before < RSS_GROWTH_UNDER_BIG_FRAMES, f"grew from {before} to {rss(pid)} bytes"
        for _, writer in connections:
            writer.close()

    with serve_process(tmp_path, open_files=1024) as (pid, address, _):
        asyncio.run(big_frames(pid, address))


# --- the limits, one by one ----------------------------------------------------------------------------------

def test_idle_connections_are_closed_and_a_follower_that_answers_pings_stays(tmp_path: Path) -> None:
    """A connection that never logs in is closed after the login timeout; a logged-in one that never answers
    is pinged, then closed after the idle timeout; a client that only follows the state answers and stays."""
    async def body(server: CoordinatorServer, address: str) -> None:
        follower = TcpBackend(address, Keypair())
        await follower.connect()
        mute, mute_writer, _ = await open_raw(address)
        idle, idle_writer = await log_in(address)

        messages, closed = await received(mute, 1.5)
        assert closed and "no Hello within 0.5 s" in farewell(messages)
        messages, closed = await received(idle, 2.0)
        assert closed and isinstance(messages[0], p.Ping)
        assert "nothing came from this connection for 1 s" in farewell(messages)

        await asyncio.sleep(1.0)  # the follower has been quiet for over three idle timeouts
        assert follower.connected
        joiner = TcpBackend(address, Keypair())
        await joiner.connect()
        await joiner.join(Role.Trainer)
        await follower.wait_for(lambda s: s.pending_index(joiner.identity) is not None, 2)
        for writer in (mute_writer, idle_writer):
            writer.close()
        for client in (follower, joiner):
            await client.close()

    serve_in_process(tmp_path, body, limits=Limits(idle_timeout=1.0, login_timeout=0.5))


def test_a_key_holds_its_share_outsiders_give_way_and_members_never_do(tmp_path: Path) -> None:
    """One key's third connection pushes out its first; a flood of outsiders pushes out only outsiders, oldest
    first; once every connection is a run member's, a newcomer is refused."""
    async def body(server: CoordinatorServer, address: str) -> None:
        key = Keypair()
        first, second = await log_in(address, key), await log_in(address, key)
        await log_in(address, key)
        messages, closed = await received(first[0], 1.0)
        assert closed and "a newer connection of this key took its place" in farewell(messages)
        assert not (await received(second[0], 0.2))[1]

        members = [TcpBackend(address, Keypair()) for _ in range(2)]
        for member in members:
            await member.connect()
            await member.join(Role.Trainer)
        outsiders = [await log_in(address) for _ in range(5)]
        outcomes = [await received(reader, 0.3) for reader, _ in outsiders]
        assert [closed for _, closed in outcomes] == [True, True, True, False, False], "the oldest give way"
        assert "a newer one" in farewell(outcomes[0][0])
        assert all(member.connected for member in members)

        for _ in range(2):  # two more members fill the server
            member = TcpBackend(address, Keypair())
            await member.connect()
            await member.join(Role.Trainer)
            members.append(member)
        _, _, answer = await say_hello(address, Keypair())
        assert isinstance(answer, p.Fatal) and "the server is full" in answer.message
        assert all(member.connected for member in members)
        assert len({j.id for j in server.state.pending}) == 4
        for member in members:
            await member.close()

    serve_in_process(tmp_path, body, limits=Limits(max_connections=4, max_per_identity=2))


def test_unprocessed_bytes_in_all_stay_under_the_cap(tmp_path: Path) -> None:
    """40 connections each hold an unfinished frame just under the frame limit: past 64 KiB in all, the server
    closes the connections holding the most, and what it holds stays under the cap."""
    cap = 64 << 10

    async def body(server: CoordinatorServer, address: str) -> None:
        connections = [await log_in(address) for _ in range(40)]
        for _, writer in connections:
            writer.write(struct.pack(">I", 4000) + bytes(3999))
        outcomes = await asyncio.gather(*(received(reader, 1.0) for reader, _ in connections))
        dropped = [messages for messages, closed in outcomes if closed]
        assert len(dropped) >= 40 - cap // 4003
        assert all(f"holds over {cap} bytes" in farewell(messages) for messages in dropped)
        assert 0 < server.peers.buffered <= cap
        for _, writer in connections:
            writer.close()

    serve_in_process(tmp_path, body, limits=Limits(max_buffered=cap))


def test_accept_out_of_descriptors_backs_off_and_logs_a_few_lines(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """With no descriptor left, accept fails: the server waits longer each time and writes a few lines (asyncio
    wrote a hundred per retry), then serves the clients that waited once descriptors are free again."""
    async def body(server: CoordinatorServer, address: str) -> None:
        host, port = address.rsplit(":", 1)
        clients = [socket.socket() for _ in range(10)]
        lowest_free = os.open(os.devnull, os.O_RDONLY)
        os.close(lowest_free)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        caplog.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor in this process
        try:
            for client in clients:
                client.setblocking(False)
                client.connect_ex((host, int(port)))  # the kernel completes it; the server cannot accept it
            await asyncio.sleep(1.5)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        lines = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
        assert 1 <= len(lines) <= 6, lines[:5]
        assert all("cannot accept connections" in line for line in lines), lines[:5]

        loop = asyncio.get_running_loop()
        for client in clients:
            data = await asyncio.wait_for(loop.sock_recv(client, 4096), 3)
            assert isinstance(p.decode(data[4:]), p.Challenge)
            client.close()

    serve_in_process(tmp_path, body)


def test_the_log_counts_what_it_leaves_out(caplog: pytest.LogCaptureFixture) -> None:
    """A peer chooses how often the server has something to say about it, not how much the server writes: past
    a few lines of a kind per period, one line counts the rest."""
    now = 0.0
    throttle = LogThrottle(logging.getLogger("psyswarm.server"), period=10.0, burst=3, clock=lambda: now)
    with caplog.at_level(logging.INFO, logger="psyswarm.server"):
        for i in range(1000):
            throttle(logging.INFO, "login", "login %d", i)
        throttle(logging.WARNING, "accept-failure", "out of descriptors")
        now = 10.0
        throttle.flush()
    assert [record.getMessage() for record in caplog.records] == [
        "login 0", "login 1", "login 2", "out of descriptors",
        "997 more login messages in the last 10 s were left out"]
