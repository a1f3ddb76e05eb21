"""Attacks on psyswarm's two web services, each started as it runs in production (``psyswarm dashboard``,
``psyswarm auth-service``: a process of its own on a real socket, its stdout and stderr pipes nobody reads) with a
soft open-file limit below the attack's connection count, as many machines give a service.

The slow-header attack (slowloris): a few hundred connections each send a request's first line, then a byte of
a header every second, never ending the headers. A fresh client must be served within seconds all along, and
each attacking connection must be answered 408 and closed at the header deadline, however it keeps trickling.
A flood of malformed requests must not make a service that logs each one block on a pipe nobody reads.

Before the shared web stack these failed: the dashboard on uvicorn's defaults and the auth service on its own
asyncio server served no fresh client during the slow-header attack (neither raised the open-file limit nor
refused in time, so accept failed), and the dashboard stopped answering the flood after some 1,600 requests,
its event loop blocked writing uvicorn's line for each to a full stderr pipe.
"""

from __future__ import annotations

import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.join.auth import AuthClient, AuthError
from client.swarm.launcher import free_port
from local_backend.web.limits import WebLimits
from tests.fake_hub import FakeHub
from tests.join.test_auth import RUN, TOKENS

ATTACKERS = 400
OPEN_FILES = 256
"""The service's soft open-file limit: below ``ATTACKERS``, so a service that neither raises it nor refuses in
time stops accepting anyone."""
SERVED_WITHIN = 3.0
ATTACKER = ("127.0.0.2", 0)
"""Where attacks come from: another loopback address than the fresh client's, as another machine's would be."""
HEADER_DEADLINE = WebLimits().header_timeout


def low_open_file_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


@contextmanager
def started(args: list[str], says_where: str) -> Iterator[str]:
    """``psyswarm <args>`` in a process of its own; its URL, from the first line it prints (``says_where`` finds
    it). Neither its stdout nor its stderr is read after that line."""
    process = subprocess.Popen([sys.executable, "-m", "client.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_TOKEN": ""},
                               preexec_fn=low_open_file_limit, start_new_session=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        found = re.search(says_where, line)
        if found is None:
            process.kill()
            pytest.fail(f"psyswarm {args[0]} did not start: {line}{process.communicate(timeout=30)[1]}")
        yield found.group(1).rstrip("/")
    finally:
        process.kill()
        process.wait()


@contextmanager
def dashboard(hub: FakeHub, tmp_path: Path) -> Iterator[tuple[str, list[Callable[[str], None]]]]:
    """The dashboard, following a coordinator that is not there (it serves its page all the same); a fresh
    client loads its page and its view."""
    args = ["dashboard", "--server", f"127.0.0.1:{free_port()}", "--run-id", RUN, "--port", "0"]
    with started(args, r"dashboard: (http://\S+) ") as url:
        yield url, [lambda url: fetch(f"{url}/"), lambda url: fetch(f"{url}/api/view")]


@contextmanager
def auth_service(hub: FakeHub, tmp_path: Path) -> Iterator[tuple[str, list[Callable[[str], None]]]]:
    """The auth service, against the stand-in Hub; a fresh client asks for the occupancy and joins."""
    hub.users.update(TOKENS)
    args = ["auth-service", "--run-id", RUN, "--stages", "3", "--capacity", "4", "--hf-endpoint", hub.url, "--db",
            str(tmp_path / "auth.sqlite"), "--server", "127.0.0.1:9"]  # no slot ends here: no coordinator is asked
    with started(args, r" listening on (http://\S+) ") as url:
        yield url, [lambda url: fetch(f"{url}/api/occupancy"), join]


SERVICES = {"dashboard": dashboard, "auth-service": auth_service}


def fetch(url: str) -> None:
    with urllib.request.urlopen(url, timeout=SERVED_WITHIN) as answer:
        assert answer.status == 200
        answer.read()


def join(url: str) -> None:
    AuthClient(url, Keypair(), RUN, timeout=SERVED_WITHIN).join("tok-alice")


def served_in(ask: Callable[[str], None], url: str) -> float:
    """Seconds a fresh client's request took; infinity when it was not served."""
    started_at = time.monotonic()
    try:
        ask(url)
    except (OSError, AssertionError, AuthError) as exc:
        print(f"a fresh client was not served: {exc!r}")
        return float("inf")
    return time.monotonic() - started_at


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


class SlowHeaders:
    """``count`` connections that each send a request's first line, then one byte of a header a second, never
    ending the headers; it notes what each is answered and when the service closes it."""

    def __init__(self, target: tuple[str, int], count: int) -> None:
        self.selector = selectors.DefaultSelector()
        self.opened: dict[socket.socket, float] = {}
        self.answers: dict[socket.socket, bytes] = {}
        self.closed: dict[socket.socket, float] = {}
        for _ in range(count):
            conn = socket.create_connection(target, timeout=5, source_address=ATTACKER)
            conn.sendall(b"GET / HTTP/1.1\r\nHost: attacked\r\nX-Slow: ")
            conn.setblocking(False)
            self.opened[conn], self.answers[conn] = time.monotonic(), b""
            self.selector.register(conn, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._trickling = threading.Thread(target=self._trickle, daemon=True)
        self._trickling.start()

    def wait_until_closed(self, timeout: float) -> None:
        self._trickling.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._trickling.join()
        for conn in self.opened:
            conn.close()
        self.selector.close()

    def _trickle(self) -> None:
        next_byte = time.monotonic() + 1.0
        while self.selector.get_map() and not self._stop.is_set():
            for key, _ in self.selector.select(timeout=0.1):
                conn = key.fileobj
                try:
                    data = conn.recv(4096)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                self.answers[conn] += data  # type: ignore[index]
                if not data:
                    self.selector.unregister(conn)
                    self.closed[conn] = time.monotonic()  # type: ignore[index]
            if time.monotonic() >= next_byte:
                next_byte += 1.0
                for key in list(self.selector.get_map().values()):
                    try:
                        key.fileobj.send(b"a")  # type: ignore[union-attr]
                    except OSError:
                        pass  # closed by the service: the next read says so


@pytest.mark.slow
@pytest.mark.parametrize("service", list(SERVICES))
def test_slow_headers_neither_starve_a_fresh_client_nor_outlive_their_deadline(fake_hub, tmp_path: Path,
                                                                              service: str) -> None:
    with SERVICES[service](fake_hub, tmp_path) as (url, fresh_requests):
        attack = SlowHeaders(address(url), ATTACKERS)
        try:
            time.sleep(2.0)  # the attack is under way: every connection has trickled a byte or two
            during = [served_in(ask, url) for ask in fresh_requests]
            attack.wait_until_closed(timeout=HEADER_DEADLINE + 5.0)
        finally:
            attack.stop()
        assert all(seconds < SERVED_WITHIN for seconds in during), during
        held_for = [attack.closed[conn] - opened if conn in attack.closed else float("inf")
                    for conn, opened in attack.opened.items()]
        assert max(held_for) < HEADER_DEADLINE + 3.0, sorted(held_for)[-5:]
        answered = [answer.split(b"\r\n", 1)[0] for answer in attack.answers.values()]
        assert answered == [b"HTTP/1.1 408 Request Timeout"] * ATTACKERS, set(answered)
        assert all(seconds < SERVED_WITHIN for seconds in [served_in(ask, url) for ask in fresh_requests])


MALFORMED = 3000
"""Malformed requests in the flood: a log line of some 40 bytes each, if a service writes one per request, is
twice what a pipe holds."""


@pytest.mark.parametrize("service", list(SERVICES))
def test_a_flood_of_malformed_requests_cannot_block_a_service_on_a_log_nobody_reads(fake_hub, tmp_path: Path,
                                                                                   service: str) -> None:
    with SERVICES[service](fake_hub, tmp_path) as (url, fresh_requests):
        answered = 0
        try:
            for _ in range(MALFORMED):
                with socket.create_connection(address(url), timeout=SERVED_WITHIN, source_address=ATTACKER) as conn:
                    conn.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")  # a TLS hello
                    answered += conn.recv(64).startswith(b"HTTP/1.1 400 ")
        except OSError as exc:  # the service stopped answering
            print(f"the flood stopped after {answered} answers: {exc!r}")
        assert answered == MALFORMED
        assert all(seconds < SERVED_WITHIN for seconds in [served_in(ask, url) for ask in fresh_requests])
