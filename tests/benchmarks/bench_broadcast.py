"""How fast and how cheaply the TCP backend tells 1,024 clients about each change.

Run: python tests/benchmarks/bench_broadcast.py [--clients 1024] [--processes 2]

Starts `psyswarm serve` in a subprocess and connects N lightweight simulated followers (no training: each
authenticates, then applies the state patches it receives to its copy of the account bytes, checking that each
patch starts from the state it holds). The followers live in ``--processes`` processes of their own, apart from
the meter, so that the followers' own decoding does not queue behind the meter's bookkeeping: on a real run each
follower is a machine of its own. Each follower in turn joins the run; for each join the benchmark prints the
latency from the moment the request is written to the socket to the moment the last follower has applied the new
state (p50, p99), and to the first. Both ends are read from CLOCK_MONOTONIC, one clock for every process on the
machine. It prints the bytes each follower received per change, compared with sending the whole state to every
client every tick as Psyche's centralised server does, and checks that every follower ends holding the server's
account byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from multiprocessing.connection import Connection, wait
from pathlib import Path

from solders.keypair import Keypair

from coordinator_program.spec.instructions import JoinRun
from coordinator_program.spec.state import ACCOUNT_SIZE, Role
from local_backend import protocol as p

STATE_TOML = """
run_id = "bench"
[config]
min_clients = 1024
max_clients = 1024           # the most a run holds (limits.MAX_CLIENTS)
witness_nodes = 32
witness_quorum = 22
num_stages = 4
[model]
n_layers = 4
"""


def now() -> float:
    """The one clock every process of the benchmark reads: system-wide, so a send in one process and a receipt in
    another are comparable."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Follower(asyncio.Protocol):
    """A client that only follows the state bytes and can send one join: frames parsed as they arrive, no task of
    its own, so that a process holds hundreds of them cheaply."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.key = Keypair()
        self.buffer = bytearray()
        self.account = bytearray()
        self.nonce = -1
        self.bytes = 0
        self.welcomed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.reply: asyncio.Future[p.Reply] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 4:
            length = int.from_bytes(self.buffer[:4], "big")
            if len(self.buffer) < 4 + length:
                return
            payload = bytes(self.buffer[4:4 + length])
            del self.buffer[:4 + length]
            self.on_message(payload)

    def on_message(self, payload: bytes) -> None:
        message = p.decode(payload)
        if isinstance(message, p.StatePatch):
            if message.base != self.nonce:
                self.group.inconsistent += 1  # a patch from another state than this follower's
            self.bytes += len(payload) + 4
            for offset, data in message.patches:  # in place: a follower's copy is 120 KB at 1,024 clients
                self.account[offset:offset + len(data)] = data
            self.arrived(message.nonce)
        elif isinstance(message, p.FullState):
            self.account = bytearray(message.account())
            if self.welcomed.done():
                self.bytes += len(payload) + 4  # a resynchronisation is a change's cost too
                self.arrived(message.nonce)
            else:
                self.nonce = message.nonce
                self.welcomed.set_result(None)
        elif isinstance(message, p.Challenge):
            sig = bytes(self.key.sign_message(p.auth_message(message.nonce)))
            self.challenge = message.nonce
            self.send(p.Hello(bytes(self.key.pubkey()), sig))
        elif isinstance(message, p.Reply) and self.reply is not None:
            self.reply.set_result(message)
        elif isinstance(message, p.Ping):  # the server closes a connection quiet for its idle timeout
            self.send(p.Pong())
        elif isinstance(message, p.Fatal):
            raise SystemExit(f"the server closed a follower: {message.message}")

    def arrived(self, nonce: int) -> None:
        self.nonce = nonce
        self.group.arrived(nonce)

    def send(self, message: p.Message) -> None:
        self.transport.write(p.frame(message.encode()))

    async def join(self) -> tuple[float, int]:
        """Join the run: when the request was written, and the nonce this follower holds once it is applied (the
        server sends a change's patch before its reply)."""
        data = JoinRun("bench", Role.Worker, 255).encode()
        sig = bytes(self.key.sign_message(p.request_message(self.challenge, 1, data)))
        self.reply = asyncio.get_running_loop().create_future()
        sent = now()
        self.send(p.Request(1, data, sig))
        reply = await self.reply
        assert reply.code == p.REPLY_OK, reply.message
        return sent, self.nonce


class Group:
    """One process's followers, and what it tells the meter: when its first and last follower held each nonce."""

    def __init__(self, meter: Connection) -> None:
        self.meter = meter
        self.followers: list[Follower] = []
        self.counts: dict[int, int] = defaultdict(int)
        self.first: dict[int, float] = {}
        self.inconsistent = 0

    def arrived(self, nonce: int) -> None:
        at = now()
        self.first.setdefault(nonce, at)
        self.counts[nonce] += 1
        if self.counts[nonce] == len(self.followers):
            self.meter.send(("arrived", nonce, self.first.pop(nonce), at))
            del self.counts[nonce]

    async def connect(self, port: int, n: int) -> None:
        loop = asyncio.get_running_loop()
        for first in range(0, n, 32):  # 32 logins at a time: well within the server's login slots
            batch = [Follower(self) for _ in range(min(32, n - first))]
            await asyncio.gather(*(loop.create_connection(lambda f=f: f, "127.0.0.1", port) for f in batch))
            await asyncio.gather(*(f.welcomed for f in batch))
            self.followers += batch

    def summary(self) -> tuple[list[str], int, list[int]]:
        return ([hashlib.sha256(f.account).hexdigest() for f in self.followers], self.inconsistent,
                [f.bytes for f in self.followers])


def follower_process(meter: Connection, port: int, n: int) -> None:
    """Hold ``n`` followers and do what the meter asks: join with one of them, or sum up."""
    async def main() -> None:
        group = Group(meter)
        await group.connect(port, n)
        meter.send(("ready",))
        loop = asyncio.get_running_loop()
        commands: asyncio.Queue[tuple] = asyncio.Queue()
        loop.add_reader(meter.fileno(), lambda: commands.put_nowait(meter.recv()))
        while True:
            command = await commands.get()
            if command[0] == "join":
                meter.send(("joined", *await group.followers[command[1]].join()))
            elif command[0] == "summary":
                meter.send(("summary", *group.summary()))
                return

    asyncio.run(main())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def server_account(port: int) -> bytes:
    """The account the server holds now, as a fresh follower receives it."""
    async def fetch() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=p.MAX_FRAME + 8)
        challenge = p.decode(await p.read_frame(reader))
        assert isinstance(challenge, p.Challenge)
        key = Keypair()
        writer.write(p.frame(p.Hello(bytes(key.pubkey()), bytes(key.sign_message(p.auth_message(challenge.nonce))))
                             .encode()))
        assert isinstance(p.decode(await p.read_frame(reader)), p.Welcome)
        full = p.decode(await p.read_frame(reader))
        assert isinstance(full, p.FullState)
        writer.close()
        return full.account()

    return asyncio.run(fetch())


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used (Linux's /proc): unlike a latency, it does not grow with the load other
    jobs put on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, n: int, processes: int, server: int) -> None:
    """Connect ``n`` followers in ``processes`` processes, let each join in turn, and print the figures; ``server``
    is the server's process id."""
    context = multiprocessing.get_context("spawn")
    sizes = [n // processes + (i < n % processes) for i in range(processes)]
    pipes, workers = [], []
    for size in sizes:
        mine, theirs = context.Pipe()
        worker = context.Process(target=follower_process, args=(theirs, port, size), daemon=True)
        worker.start()
        pipes.append(mine)
        workers.append(worker)
    for pipe in pipes:
        assert pipe.recv() == ("ready",)
    arrivals: dict[int, list[tuple[float, float]]] = defaultdict(list)

    def on(pipe: Connection) -> tuple:
        """The next message from ``pipe`` that is not an arrival, filing the arrivals that come before it."""
        while True:
            message = pipe.recv()
            if message[0] != "arrived":
                return message
            arrivals[message[1]].append(message[2:])

    latencies, firsts = [], []
    load = os.getloadavg()[0]
    server_cpu = cpu_seconds(server)
    for worker, size in enumerate(sizes):
        for i in range(size):
            pipes[worker].send(("join", i))
            _, sent, target = on(pipes[worker])
            while len(arrivals[target]) < processes:
                for ready in wait(pipes):
                    message = ready.recv()
                    assert message[0] == "arrived", message
                    arrivals[message[1]].append(message[2:])
            latencies.append(max(last for _, last in arrivals[target]) - sent)
            firsts.append(min(first for first, _ in arrivals[target]) - sent)
    server_cpu = cpu_seconds(server) - server_cpu
    account = server_account(port)
    digests, inconsistent, received = [], 0, []
    for pipe in pipes:
        pipe.send(("summary",))
        _, d, bad, got = on(pipe)
        digests += d
        inconsistent += bad
        received += got
    for worker in workers:
        worker.join(10)
    expected = hashlib.sha256(account).hexdigest()
    per_client = statistics.mean(received) / n
    compressed = len(p.frame(p.FullState.of(0, account).encode()))
    print(f"{n} followers in {processes} processes, {n} state changes (one join each), the machine's load "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f} (1-minute average, as the joins began and ended)")
    print(f"latency request written -> every follower has applied the new state: p50 "
          f"{statistics.median(latencies) * 1e3:.1f} ms, p99 {percentile(latencies, 0.99) * 1e3:.1f} ms, "
          f"max {max(latencies) * 1e3:.1f} ms")
    print(f"latency request written -> the first follower has it (the server's own work): p50 "
          f"{statistics.median(firsts) * 1e3:.1f} ms, p99 {percentile(firsts, 0.99) * 1e3:.1f} ms")
    print(f"the server's CPU time per change: {server_cpu / n * 1e3:.1f} ms (applying, storing and sending it to "
          f"{n} followers)")
    print(f"bytes per follower per change: {per_client:.0f} (state patches)")
    print(f"full state every tick (Psyche's way): {ACCOUNT_SIZE + 4:,} bytes per follower per tick -> patches send "
          f"{per_client / (ACCOUNT_SIZE + 4):.2%} of that; zlib full state would be {compressed:,}")
    agree = sum(d == expected for d in digests)
    print(f"followers holding the server's account byte for byte: {agree}/{n}; patches from another state than the "
          f"follower's: {inconsistent}")
    if agree != n or inconsistent:
        raise SystemExit("a follower's state differs from the server's")


STOP_WITHIN = 30
"""Seconds the server may take to stop on SIGTERM (it closes 1,024 connections and its store)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(clients: int, processes: int = 2) -> None:
    """Serve a run with ``psyswarm serve`` in a subprocess and measure its broadcast to ``clients`` followers."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "state.toml"
        config.write_text(STATE_TOML)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db",
                                   str(Path(tmp) / "run.sqlite"), "--port", str(port), "--permissionless"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.1)
            measure(port, clients, processes, server.pid)
        finally:
            server.terminate()
            try:
                server.wait(STOP_WITHIN)
            except subprocess.TimeoutExpired:
                server.kill()
                print(f"the server did not stop within {STOP_WITHIN} s of SIGTERM: killed", file=sys.stderr)
                raise SystemExit(1) from None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1024)
    parser.add_argument("--processes", type=int, default=2, help="processes the followers share (the cores)")
    args = parser.parse_args()
    run(args.clients, args.processes)


if __name__ == "__main__":
    main()
