"""Attacks on the auth service's HTTP front, over raw sockets on loopback: malformed framing and bodies get a
4xx naming what is wrong and the service keeps answering; connections held half-sent neither starve a fresh
client nor cost a thread each, and are dropped at their deadline. Every attack is bounded in count and time."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from typing import Any

import pytest

from local_backend.auth.app import AuthHTTPServer
from local_backend.web.limits import WebLimits
from tests.join.test_auth import client, serving

HEAD = "PUT /api/join HTTP/1.1\r\nHost: auth\r\nAuthorization: Bearer tok-alice\r\n"


def exchange(server: AuthHTTPServer, data: bytes) -> tuple[int, dict[str, Any]]:
    """Send raw bytes on a fresh connection; the status and JSON body the service answers with."""
    with socket.create_connection(address(server), timeout=10) as conn:
        conn.sendall(data)
        answer = read_until_closed(conn, time.monotonic() + 10)
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def address(server: AuthHTTPServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_until_closed(conn: socket.socket, deadline: float) -> bytes:
    """Everything the peer sends until it closes, or what came by ``deadline``."""
    chunks = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return b"".join(chunks)


def still_serving(server: AuthHTTPServer) -> bool:
    with urllib.request.urlopen(f"{server.url}/api/occupancy", timeout=5) as answer:
        return answer.status == 200 and json.loads(answer.read())["slots"] == 0


def body(payload: bytes) -> bytes:
    return f"{HEAD}Content-Length: {len(payload)}\r\n\r\n".encode() + payload


def a_request_with(server: AuthHTTPServer, **changes: Any) -> bytes:
    request = client(server, token="tok-alice")._signed("join", role="worker")
    return body(json.dumps({**request, **changes}).encode())


NESTED = b"[" * 5000 + b"]" * 5000

MALFORMED = {
    "content-length-not-a-number": (f"{HEAD}Content-Length: abc\r\n\r\n{{}}".encode(), 400, "Content-Length"),
    "content-length-negative": (f"{HEAD}Content-Length: -1\r\n\r\n{{}}".encode(), 400, "Content-Length"),
    "content-length-twice": (f"{HEAD}Content-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}".encode(), 400,
                             "Content-Length"),
    "content-length-5000-digits": (f"{HEAD}Content-Length: {'9' * 5000}\r\n\r\n".encode(), 400,
                                   "bad Content-Length"),
    "oversize-declared": (f"{HEAD}Content-Length: 1000000\r\n\r\n".encode(), 413, "over 16384 bytes"),
    "oversize-chunked": (f"{HEAD}Transfer-Encoding: chunked\r\n\r\n".encode()
                         + b"".join(b"1000\r\n" + b"x" * 4096 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n", 413,
                         "over 16384 bytes"),
    "headers-too-large": (f"{HEAD}X-Padding: {'a' * 40000}\r\n\r\n".encode(), 431, "malformed HTTP"),
    "not-http": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "malformed HTTP"),
    "nested-array": (body(NESTED), 400, "nests too deeply"),
    "nested-in-a-field": (body(b'{"run_id": ' + NESTED + b"}"), 400, "nests too deeply"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_requests_get_a_4xx_naming_the_fault(fake_hub, case: str) -> None:
    data, status, reason = MALFORMED[case]
    with serving(fake_hub) as server:
        answered, answer = exchange(server, data)
        assert (answered, reason in answer["message"]) == (status, True), answer
        assert still_serving(server)


WRONG_TYPES = {
    "time-beyond-any-float": ({"time": 10 ** 400}, "time must be a finite number"),
    "time-a-string": ({"time": "now"}, "time must be a finite number"),
    "peer-a-number": ({"peer": 12345}, "peer must be a string, not int"),
    "role-a-list": ({"role": ["worker"]}, "role must be a string, not list"),
    "nonce-not-hex": ({"nonce": "z" * 32}, "nonce must be 32 lowercase hex digits"),
    "signature-too-short": ({"signature": "ab"}, "signature must be 128 lowercase hex digits"),
    "missing-nonce": ({"nonce": None}, "nonce must be a string, not NoneType"),
    "extra-field": ({"admin": True}, "unexpected field(s) admin"),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_fields_of_the_wrong_type_get_a_400_naming_the_field(fake_hub, case: str) -> None:
    changes, reason = WRONG_TYPES[case]
    with serving(fake_hub) as server:
        answered, answer = exchange(server, a_request_with(server, **changes))
        assert (answered, answer["error"]) == (400, "bad_request") and reason in answer["message"], answer
        assert still_serving(server)


def test_held_half_sent_requests_neither_starve_a_fresh_client_nor_cost_a_thread_each(fake_hub) -> None:
    with serving(fake_hub, limits=WebLimits(header_timeout=2.0, body_timeout=2.0)) as server:
        threads_before = threading.active_count()
        held: list[socket.socket] = []
        connecting_until = time.monotonic() + 20
        try:
            for i in range(400):  # half the headers, or the headers and half the body, then nothing more
                conn = socket.create_connection(address(server), timeout=max(0.1, connecting_until - time.monotonic()))
                conn.sendall(HEAD.encode()[:40] if i % 2 else f"{HEAD}Content-Length: 300\r\n\r\n{{".encode())
                held.append(conn)
            started = time.monotonic()
            grant = client(server).join("tok-bob")
            served_in = time.monotonic() - started
            threads_while_held = threading.active_count()
            deadline = time.monotonic() + 2.0 + 3.0  # their request timeout, and room to answer 400 of them
            answers = [read_until_closed(conn, deadline) for conn in held]
        finally:
            for conn in held:
                conn.close()
        assert grant.contributor == "bob" and served_in < 1.0, served_in
        assert threads_while_held - threads_before < 30, (threads_before, threads_while_held)
        assert sum(a.startswith(b"HTTP/1.1 408 Request Timeout") for a in answers) == 400
        assert client(server).join("tok-carol").contributor == "carol"  # and it serves on once they are gone


def test_connections_past_the_limit_are_answered_503_at_once(fake_hub) -> None:
    with serving(fake_hub, limits=WebLimits(header_timeout=1.0, body_timeout=1.0, max_connections=20)) as server:
        held = [socket.create_connection(address(server), timeout=5) for _ in range(20)]
        try:
            time.sleep(0.2)  # the service has taken them all
            started = time.monotonic()
            status, answer = exchange(server, b"")
            assert (status, answer["error"]) == (503, "busy") and time.monotonic() - started < 1.0
        finally:
            for conn in held:
                conn.close()
        time.sleep(0.2)
        assert still_serving(server)
