"""The web stack both web services share, over real sockets on loopback with a small app: what it adds to uvicorn
holds on kept-alive connections, per client address, and for a client that keeps sending after its refusal."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from local_backend.web.limits import RESERVED_FILES, WebLimits
from local_backend.web.server import WebServer


async def echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"{len(await request.body())} bytes")


APP = Starlette(routes=[Route("/", echo, methods=["GET", "POST"])])


@contextmanager
def serving(limits: WebLimits) -> Iterator[tuple[str, int]]:
    server = WebServer(APP, limits=limits).start()
    try:
        host, port = server.url.removeprefix("http://").split(":")
        yield host, int(port)
    finally:
        server.shutdown()
        server.server_close()


def read_answer(conn: socket.socket) -> bytes:
    """One answer of the app's (``N bytes``), or a refusal and the connection's end."""
    data = b""
    while b" bytes" not in data and (chunk := conn.recv(65536)):
        data += chunk
    return data


def test_the_next_requests_headers_on_a_kept_alive_connection_have_their_deadline_too() -> None:
    with serving(WebLimits(header_timeout=1.0, keep_alive=30.0)) as address:
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_answer(conn).startswith(b"HTTP/1.1 200 OK")
            answered = time.monotonic()
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
            conn.settimeout(0.2)
            answer = b""
            while time.monotonic() - answered < 5:  # a byte of a header every 0.2 s, never ending the headers
                try:
                    if not (chunk := conn.recv(4096)):
                        break
                    answer += chunk
                except TimeoutError:
                    conn.sendall(b"X")
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout") and time.monotonic() - answered < 2.5


def test_one_address_holds_at_most_its_share_of_connections() -> None:
    with serving(WebLimits(max_connections_per_client=5)) as address:
        held = [socket.create_connection(address, timeout=5, source_address=("127.0.0.2", 0)) for _ in range(5)]
        try:
            with socket.create_connection(address, timeout=5, source_address=("127.0.0.2", 0)) as one_more:
                refused = read_answer(one_more)
            with urllib.request.urlopen(f"http://{address[0]}:{address[1]}/", timeout=5) as answer:
                assert answer.read() == b"0 bytes"  # another address is served
        finally:
            for conn in held:
                conn.close()
        assert refused.startswith(b"HTTP/1.1 503 Service Unavailable") and b'"error": "busy"' in refused


def test_a_client_still_sending_reads_its_refusal() -> None:
    """The body is refused as soon as its declared size is seen; the client goes on sending it, and still reads
    the answer, since the service reads and drops the rest rather than resetting the connection."""
    with serving(WebLimits(max_body_bytes=1024)) as address:
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4000000\r\n\r\n")
            sending = threading.Thread(target=send_quietly, args=(conn, b"x" * 4_000_000), daemon=True)
            sending.start()
            answer = read_answer(conn)
            sending.join()
    assert answer.startswith(b"HTTP/1.1 413 Request Entity Too Large") and b"over 1024 bytes" in answer, answer


def send_quietly(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
    except OSError:  # the service closed once it had lingered
        pass


def test_headers_over_the_cap_are_refused_even_when_they_arrive_in_one_read() -> None:
    with serving(WebLimits(max_header_bytes=1024)) as address:
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 2000 + b"\r\n\r\n")
            answer = read_answer(conn)
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large") and b"over 1024 bytes" in answer, answer


def test_a_body_trickled_past_its_deadline_is_refused() -> None:
    with serving(WebLimits(body_timeout=1.0)) as address:
        with socket.create_connection(address, timeout=10) as conn:
            conn.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nx")
            started = time.monotonic()
            answer = read_answer(conn)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout") and b"body did not arrive" in answer, answer
    assert time.monotonic() - started < 3.0


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_connections_per_client must be positive, not 0"):
        WebLimits(max_connections_per_client=0)


FITTED = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
from local_backend.web.limits import WebLimits
fitted = WebLimits().fitted_to_open_files()
print(fitted.max_connections, fitted.max_connections_per_client)
"""


def test_the_connection_caps_fit_under_an_open_file_limit_that_cannot_be_raised() -> None:
    """Past the open-file limit accept fails and the service serves no one: the caps shrink to fit, the one per
    address in proportion."""
    ran = subprocess.run([sys.executable, "-c", FITTED], capture_output=True, text=True, timeout=60)
    assert ran.stdout.split() == [str(200 - RESERVED_FILES), str(512 * (200 - RESERVED_FILES) // 1024)], ran.stderr
