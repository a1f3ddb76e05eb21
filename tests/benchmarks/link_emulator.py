"""A link emulator for benchmarks: TCP relays on loopback that shape traffic to a bandwidth and a latency.

This kernel has no ``netem`` (``tc``'s ``tbf``/``htb`` shape bandwidth but add no delay), so the link lives in
user space: a relay listens on a loopback port and forwards every connection to one upstream address. Each
direction of the relay is one link, shared by all its connections, as a machine's uplink is: a chunk waits its
turn on the transmitter (``size / bandwidth`` after the previous one finished), then travels ``rtt / 2``.
Chunks are read 16 KiB at a time and at most ``MAX_QUEUED`` wait per connection, so a sender faster than the
link is held back by TCP's own flow control, as it would be on a real link.

Nothing leaves loopback, and ``stop`` (or leaving the ``with`` block) closes every socket and thread. It stays
out of the client package: only benchmarks and their tests use it.

``RelayedDirectory`` puts a relay in front of every worker a trainer's directory lists, so a trainer on this
machine talks to its workers as if over the internet while the workers announce their real addresses.
``dht_behind_relay`` starts a DHT behind a "router" on ``ROUTER``, a relay that forwards its port, and announces that
address (``start_dht(public_host=...)``, as a contributor's ``--public-host``), so that its peers, and its
averagers' groupmates, reach it only through its link.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Protocol

import hivemind

from client.pipeline.addresses import free_port
from client.pipeline.discovery import WorkerRecord, start_dht

CHUNK = 16 * 1024
MAX_QUEUED = 64  # chunks per connection and direction: 1 MiB, above 100 Mbit/s × 50 ms
ROUTER = "127.0.0.2"  # where relays stand for the routers of workers behind a link: loopback, but not 127.0.0.1


@dataclasses.dataclass(frozen=True)
class Link:
    """A symmetric link: ``bandwidth`` bits per second each way, ``rtt`` seconds of round-trip delay."""

    bandwidth: float
    rtt: float

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.rtt < 0:
            raise ValueError("a link needs a positive bandwidth and a non-negative round-trip time")

    def __str__(self) -> str:
        return f"{self.bandwidth / 1e6:g} Mbit/s, {self.rtt * 1000:g} ms RTT"


def parse_link(text: str) -> Link:
    """A benchmark's ``--link MBIT/MS``: MBIT megabits per second each way, MS milliseconds of round trip."""
    mbit, _, ms = text.partition("/")
    try:
        return Link(float(mbit) * 1e6, float(ms) / 1e3)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MBIT/MS such as 100/50, both positive") from None


class _Transmitter:
    """One direction of a link: when a chunk handed over now arrives at the far end."""

    def __init__(self, link: Link) -> None:
        self.seconds_per_byte = 8 / link.bandwidth
        self.delay = link.rtt / 2
        self.free_at = 0.0
        self.bytes = 0

    def arrival(self, size: int, now: float) -> float:
        self.bytes += size
        start = max(now, self.free_at)
        self.free_at = start + size * self.seconds_per_byte
        return self.free_at + self.delay


class Relay:
    """Forwards connections made to ``address`` (``listen``, a free loopback port by default) to ``upstream``
    (``host:port``) through ``link``; ``forward`` adds more ports over the same link, as a router forwards a
    machine's ports over its one line."""

    def __init__(self, upstream: str, link: Link, listen: str = "127.0.0.1:0") -> None:
        self.upstream = upstream
        self.listen = listen
        self.link = link
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{upstream}", daemon=True)
        self._up, self._down = _Transmitter(link), _Transmitter(link)
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def bytes_each_way(self) -> tuple[int, int]:
        """Bytes carried so far toward the upstream, and back."""
        return self._up.bytes, self._down.bytes

    @property
    def busiest_direction_bytes(self) -> int:
        """Bytes carried so far in the direction that carried more."""
        return max(self._up.bytes, self._down.bytes)

    def start(self) -> Relay:
        self._thread.start()
        self.address = self.forward(self.listen, self.upstream)
        return self

    def forward(self, listen: str, upstream: str) -> str:
        """Also forward connections made to ``listen`` to ``upstream``, over this relay's link; the address it
        listens on."""
        host, _, port = listen.rpartition(":")
        server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(functools.partial(self._serve, upstream), host, int(port)), self._loop
        ).result()
        self._servers.append(server)
        return f"{host}:{server.sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()

    async def _serve(self, upstream: str, client_reader: asyncio.StreamReader,
                     client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            host, _, port = upstream.rpartition(":")
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
            try:
                async with asyncio.TaskGroup() as group:  # one direction failing ends the other
                    group.create_task(self._pump(client_reader, upstream_writer, self._up))
                    group.create_task(self._pump(upstream_reader, client_writer, self._down))
            finally:
                upstream_writer.close()
        except (OSError, ExceptionGroup, asyncio.CancelledError):
            pass  # a reset or refused connection, or the relay stopping: the connection ends, nothing else
        finally:
            client_writer.close()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: _Transmitter) -> None:
        """Carry one direction of a connection: read, stamp each chunk with its arrival time, deliver then."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_QUEUED)

        async def receive() -> None:
            while chunk := await reader.read(CHUNK):
                await queue.put((line.arrival(len(chunk), self._loop.time()), chunk))
            await queue.put(None)

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                arrival, chunk = item
                await asyncio.sleep(max(0.0, arrival - self._loop.time()))
                writer.write(chunk)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        async with asyncio.TaskGroup() as group:
            group.create_task(receive())
            group.create_task(deliver())


class Directory(Protocol):
    def workers(self, stage: str) -> list[WorkerRecord]: ...


class RelayedDirectory:
    """A trainer's directory whose every worker is reached through its own relay on ``link``."""

    def __init__(self, inner: Directory, link: Link) -> None:
        self.inner = inner
        self.link = link
        self._relays: dict[str, Relay] = {}
        self._lock = threading.Lock()

    def workers(self, stage: str) -> list[WorkerRecord]:
        return [dataclasses.replace(r, address=self._relay(r.address)) for r in self.inner.workers(stage)]

    def _relay(self, address: str) -> str:
        with self._lock:
            if address not in self._relays:
                self._relays[address] = Relay(address, self.link).start()
            return self._relays[address].address

    def busiest_link_bytes(self) -> int:
        """Bytes carried so far by the busiest direction of any worker's link."""
        with self._lock:
            return max((relay.busiest_direction_bytes for relay in self._relays.values()), default=0)

    def close(self) -> None:
        with self._lock:
            for relay in self._relays.values():
                relay.stop()
            self._relays.clear()


def dht_behind_relay(initial_peers: Sequence[str], link: Link, relays: list[Relay]) -> hivemind.DHT:
    """A DHT on a free port of 127.0.0.1 that announces ``ROUTER``, where a relay on ``link`` forwards that port to
    it (appended to ``relays``, for the caller to stop after the DHT): whoever connects to it, its averagers'
    groupmates included, comes in through the link and is answered the same way."""
    port = free_port()
    relays.append(Relay(f"127.0.0.1:{port}", link, listen=f"{ROUTER}:{port}").start())
    return start_dht(initial_peers, port=port, public_host=ROUTER)
