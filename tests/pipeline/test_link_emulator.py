"""The benchmarks' link emulator delays and paces what it relays as the link it stands for (loopback only)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from client.pipeline.discovery import start_dht
from tests.benchmarks.link_emulator import ROUTER, Link, Relay, dht_behind_relay


class _Echo(socketserver.BaseRequestHandler):
    """Answers each byte received with one byte, and the whole transfer with b"done" once the sender is done."""

    def handle(self) -> None:
        received = 0
        while chunk := self.request.recv(1 << 16):
            received += len(chunk)
            if received == 1:
                self.request.sendall(b"!")
        self.request.sendall(b"done")


@pytest.fixture
def upstream() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_a_round_trip_takes_the_links_rtt(upstream: str) -> None:
    with Relay(upstream, Link(bandwidth=100e6, rtt=0.2)) as relay, _connect(relay.address) as conn:
        started = time.perf_counter()
        conn.sendall(b"x")
        assert conn.recv(1) == b"!"
        elapsed = time.perf_counter() - started
    assert 0.2 <= elapsed < 0.3, elapsed


def test_a_transfer_takes_its_size_over_the_bandwidth(upstream: str) -> None:
    link = Link(bandwidth=16e6, rtt=0.05)
    size = 2_000_000  # 1 s at 16 Mbit/s
    with Relay(upstream, link) as relay, _connect(relay.address) as conn:
        started = time.perf_counter()
        conn.sendall(b"x")
        assert conn.recv(1) == b"!"
        conn.sendall(bytes(size - 1))
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(16):
            answer += chunk
        elapsed = time.perf_counter() - started
    assert answer == b"done"
    expected = size * 8 / link.bandwidth + 2 * link.rtt  # the first byte's round trip, then the rest and b"done"
    assert 0.9 * expected <= elapsed <= 1.25 * expected, (elapsed, expected)


def test_stop_closes_open_connections(upstream: str) -> None:
    relay = Relay(upstream, Link(bandwidth=1e6, rtt=0.01)).start()
    conn = _connect(relay.address)
    conn.sendall(b"x")
    assert conn.recv(1) == b"!"
    relay.stop()
    conn.settimeout(5)
    assert conn.recv(16) == b""  # the relay's side closed, not left hanging
    conn.close()
    assert not relay._thread.is_alive()


def test_ports_forwarded_over_one_relay_share_its_bandwidth(upstream: str) -> None:
    """A machine's ports share its one line: two transfers at once, one per forwarded port, take twice as long
    as one."""
    link = Link(bandwidth=16e6, rtt=0.0)
    size = 1_000_000  # 0.5 s at 16 Mbit/s
    with Relay(upstream, link) as relay:
        other = relay.forward("127.0.0.1:0", upstream)
        assert other != relay.address

        def send(address: str, done: list[bytes]) -> None:
            with _connect(address) as conn:
                conn.sendall(bytes(size))
                conn.shutdown(socket.SHUT_WR)
                answer = b""
                while chunk := conn.recv(16):
                    answer += chunk
                done.append(answer)

        done: list[bytes] = []
        started = time.perf_counter()
        threads = [threading.Thread(target=send, args=(a, done)) for a in (relay.address, other)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        elapsed = time.perf_counter() - started
    assert done == [b"done", b"done"]
    expected = 2 * size * 8 / link.bandwidth
    assert 0.9 * expected <= elapsed <= 1.25 * expected, (elapsed, expected)


def test_a_dht_behind_a_relay_announces_the_relay_and_its_peers_come_in_through_it() -> None:
    bootstrap = start_dht()
    relays: list[Relay] = []
    dhts = [bootstrap]
    try:
        hidden = dht_behind_relay([str(a) for a in bootstrap.get_visible_maddrs()], Link(1e9, 0.0), relays)
        dhts.append(hidden)
        announced = [str(a) for a in hidden.get_visible_maddrs()]
        router, _, port = relays[0].address.rpartition(":")
        assert router == ROUTER
        assert announced and all(a.startswith(f"/ip4/{ROUTER}/tcp/{port}/") for a in announced), announced
        carried = relays[0].busiest_direction_bytes
        dhts.append(start_dht(announced))  # a peer that knows only the announced address
        assert relays[0].busiest_direction_bytes > carried
    finally:
        for dht in reversed(dhts):
            dht.shutdown()
        for relay in relays:
            relay.stop()
