"""How fast and how cheaply the TCP backend tells 1,024 clients about each change.

Run: python tests/benchmarks/bench_broadcast.py [--clients 1024]

Starts `psyswarm serve` in a subprocess and connects N lightweight simulated clients (no training: each
authenticates, then applies the state patches it receives to its copy of the account bytes). Each client
in turn joins the run; for each join it prints the latency from sending the request to the moment every
client holds the new state (p50, p99), and the bytes each client received per change, compared with
sending the whole state to every client every tick as Psyche's centralised server does.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
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


class Tally:
    """How many followers hold each nonce, so the measurement waits for the last one without polling them all."""

    def __init__(self, followers: int) -> None:
        self.followers, self.counts, self.done = followers, defaultdict(int), defaultdict(asyncio.Event)

    def arrived(self, nonce: int) -> None:
        self.counts[nonce] += 1
        if self.counts[nonce] == self.followers:
            self.done[nonce].set()


class SimClient:
    """A client that only follows the state bytes and can send one join."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.key = Keypair()
        self.account = b""
        self.nonce = 0
        self.bytes = 0
        self.arrivals: dict[int, float] = {}
        self.replies: asyncio.Queue[p.Reply] = asyncio.Queue()

    async def connect(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port, limit=p.MAX_FRAME + 8)
        challenge = p.decode(await p.read_frame(self.reader))
        assert isinstance(challenge, p.Challenge)
        self.challenge = challenge.nonce
        sig = bytes(self.key.sign_message(p.auth_message(challenge.nonce)))
        self.writer.write(p.frame(p.Hello(bytes(self.key.pubkey()), sig).encode()))
        assert isinstance(p.decode(await p.read_frame(self.reader)), p.Welcome)
        full = p.decode(await p.read_frame(self.reader))
        assert isinstance(full, p.FullState)
        self.account, self.nonce = bytearray(full.account()), full.nonce
        self.task = asyncio.create_task(self.listen())

    async def listen(self) -> None:
        while True:
            payload = await p.read_frame(self.reader)
            message = p.decode(payload)
            if isinstance(message, p.StatePatch):
                self.bytes += len(payload) + 4
                for offset, data in message.patches:  # in place: a follower's copy is 120 KB at 1,024 clients
                    self.account[offset:offset + len(data)] = data
                self.nonce = message.nonce
                self.arrivals[message.nonce] = time.perf_counter()
                self.tally.arrived(message.nonce)
            elif isinstance(message, p.Reply):
                await self.replies.put(message)
            elif isinstance(message, p.Ping):  # the server closes a connection quiet for its idle timeout
                self.writer.write(p.frame(p.Pong().encode()))

    async def join(self) -> None:
        data = JoinRun("bench", Role.Worker, 255).encode()
        sig = bytes(self.key.sign_message(p.request_message(self.challenge, 1, data)))
        self.writer.write(p.frame(p.Request(1, data, sig).encode()))
        reply = await self.replies.get()
        assert reply.code == p.REPLY_OK, reply.message


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def measure(port: int, n: int) -> None:
    tally = Tally(n)
    clients = [SimClient(tally) for _ in range(n)]
    for first in range(0, n, 32):  # 32 logins at a time: well within the server's login slots
        await asyncio.gather(*(c.connect(port) for c in clients[first:first + 32]))
    latencies, firsts = [], []
    for c in clients:
        sent = time.perf_counter()
        await c.join()
        target = c.nonce
        await tally.done[target].wait()
        latencies.append(max(x.arrivals[target] for x in clients) - sent)
        firsts.append(min(x.arrivals[target] for x in clients) - sent)
    changes = n
    per_client = statistics.mean(x.bytes for x in clients) / changes
    full_every_tick = ACCOUNT_SIZE + 4
    compressed = len(p.frame(p.FullState.of(clients[0].nonce, bytes(clients[0].account)).encode()))
    latencies.sort()
    firsts.sort()
    print(f"{n} clients, {changes} state changes (one join each)")
    print(f"latency request -> every client has the new state: p50 {statistics.median(latencies) * 1e3:.1f} ms, "
          f"p99 {latencies[int(0.99 * (len(latencies) - 1))] * 1e3:.1f} ms")
    print(f"latency request -> the first client has it (the server's own work): p50 "
          f"{statistics.median(firsts) * 1e3:.1f} ms, p99 {firsts[int(0.99 * (len(firsts) - 1))] * 1e3:.1f} ms "
          f"(the rest is the fan-out, and {n} simulated followers sharing one Python process)")
    print(f"bytes per client per change: {per_client:.0f} (state patches)")
    print(f"full state every tick (Psyche's way): {full_every_tick:,} bytes per client per tick "
          f"-> patches send {per_client / full_every_tick:.2%} of that; zlib full state would be {compressed:,}")
    for c in clients:
        c.task.cancel()
        c.writer.close()


def run(clients: int) -> None:
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
            asyncio.run(measure(port, clients))
        finally:
            server.terminate()
            server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1024)
    run(parser.parse_args().clients)


if __name__ == "__main__":
    main()
