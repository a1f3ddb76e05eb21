"""The dashboard's feed and web server against the real TCP server, and the command's bad options."""

from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from solders.keypair import Keypair
from starlette.testclient import TestClient
from typer.testing import CliRunner

from client.backends.tcp import TcpBackend
from client.cli import app
from client.commands.dashboard import MAX_CONTRIBUTORS_BYTES, contributors_reader
from client.dashboard.app import create_app
from client.dashboard.feed import Feed
from client.swarm.launcher import free_port
from coordinator_program.spec.config import parse_run_spec
from coordinator_program.spec.rules import NO_AUTHORITY
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore

SPEC = parse_run_spec({"run_id": "feed-test", "config": {"min_clients": 4, "max_clients": 8},
                       "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8}})


async def wait_until(condition, timeout: float = 10.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.05)
    await asyncio.wait_for(poll(), timeout)


def test_an_unreachable_coordinator_is_shown_and_retried_until_it_answers(tmp_path: Path) -> None:
    port = free_port()

    async def main() -> None:
        feed = Feed(lambda: TcpBackend(f"127.0.0.1:{port}", Keypair()), "feed-test", retry_seconds=0.1)
        following = asyncio.create_task(feed.run())
        await wait_until(lambda: feed.view["error"] is not None and "unreachable" in feed.view["error"])
        reached = f"coordinator unreachable: cannot reach the coordinator at 127.0.0.1:{port}"
        assert feed.view["error"].startswith(reached)
        server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), Keypair(), join_authority=NO_AUTHORITY)
        await server.start(port=port)
        try:
            await wait_until(lambda: feed.view["error"] is None)
            assert feed.view["progress"]["run_id"] == "feed-test"
        finally:
            await server.stop()
        await wait_until(lambda: feed.view["error"] is not None)  # the server went away: said, and retried
        assert feed.view["error"].startswith("coordinator unreachable: ")
        assert feed.view["progress"]["run_id"] == "feed-test"  # the last view stays on the page
        following.cancel()

    asyncio.run(main())


def test_a_coordinator_serving_another_run_is_not_shown_as_this_one(tmp_path: Path) -> None:
    async def main() -> None:
        server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), Keypair(), join_authority=NO_AUTHORITY)
        port = await server.start(port=0)
        feed = Feed(lambda: TcpBackend(f"127.0.0.1:{port}", Keypair()), "other-run", retry_seconds=0.1)
        following = asyncio.create_task(feed.run())
        try:
            await wait_until(lambda: feed.view["error"] is not None and "serves run" in feed.view["error"])
            assert feed.view["error"] == ("coordinator unreachable: it serves run 'feed-test', not 'other-run' "
                                          "(check --run-id)")
            assert "progress" not in feed.view
        finally:
            following.cancel()
            await server.stop()

    asyncio.run(main())


def test_every_response_forbids_scripts_from_elsewhere() -> None:
    feed = Feed(lambda: TcpBackend("127.0.0.1:1", Keypair()), "feed-test")
    with TestClient(create_app(feed)) as web:
        for path in ("/", "/dashboard.js", "/dashboard.css", "/api/view"):
            answer = web.get(path)
            assert answer.status_code == 200, path
            assert "script-src 'self'" in answer.headers["content-security-policy"]
            assert answer.headers["x-content-type-options"] == "nosniff"
        assert web.get("/api/view").json() == {"error": "connecting to the coordinator", "problems": {}}
        assert web.get("/../pyproject.toml").status_code == 404


@pytest.mark.parametrize(("args", "message"), [
    (["--run-id", "r"], "give exactly one of --server HOST:PORT"),
    (["--run-id", "r", "--server", "127.0.0.1:1", "--url", "localhost"], "give exactly one of --server"),
    (["--run-id", "r", "--server", "nohost"], "--server must be HOST:PORT"),
    (["--run-id", "r", "--server", "127.0.0.1:1", "--port", "70000"], "--port 70000 is not a TCP port"),
    (["--run-id", "r", "--server", "127.0.0.1:1", "--auth-url", "ftp://x"], "--auth-url 'ftp://x' is not an http"),
    (["--run-id", "r", "--server", "127.0.0.1:1", "--initial-peer", "garbage"], "--initial-peer 'garbage' is not a"),
    (["--run-id", "r", "-u", "localhost", "--program-id", "xyz"], "--program-id 'xyz' is not a base58"),
])
def test_bad_options_get_one_line_naming_the_option(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["dashboard", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_a_failing_dht_only_blanks_its_part_of_the_page(tmp_path: Path) -> None:
    def broken_dht(state):
        raise OSError("no DHT peer answered")

    async def main() -> None:
        server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), Keypair(), join_authority=NO_AUTHORITY)
        port = await server.start(port=0)
        feed = Feed(lambda: TcpBackend(f"127.0.0.1:{port}", Keypair()), "feed-test", read_dht=broken_dht)
        following = asyncio.create_task(feed.run())
        try:
            await wait_until(lambda: "dht" in feed.view["problems"])
            assert feed.view["problems"] == {"dht": "no DHT peer answered"}
            assert feed.view["error"] is None and feed.view["progress"]["phase"] == "WaitingForMembers"
        finally:
            following.cancel()
            await server.stop()

    asyncio.run(main())


def test_an_auth_service_answering_too_much_is_refused() -> None:
    class Flood(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
            body = b'{"' + b"x" * (MAX_CONTRIBUTORS_BYTES + 10) + b'": "a"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flood)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="contributor map is over"):
            contributors_reader(f"http://127.0.0.1:{server.server_port}")("feed-test")
    finally:
        server.shutdown()
        server.server_close()
