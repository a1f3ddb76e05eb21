"""``psyswarm dashboard``: a local web page that follows a run live.

It reads the coordinator through the same backends as ``status`` (TCP or Solana, read-only: no keypair, it
signs nothing), the run's DHT when given ``--initial-peer`` (the workers' sync phases, the trainers' losses),
and, with ``--auth-url``, the run's auth service for which keys belong to one contributor. The page is served by
the web stack every psyswarm web service shares (``local_backend.web``: deadlines, connection caps and sizes),
and its log goes to stderr without ever blocking the server, even when nothing reads it.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
import urllib.request
from typing import Annotated, NoReturn

import typer

from client.commands.connect import ProgramId, RunId, Server, Url
from client.commands.pipeline import InitialPeers
from client.commands.signals import sigterm_interrupts
from client.identity import from_json

MAX_CONTRIBUTORS_BYTES = 1 << 20
"""The most of the auth service's answer read: a contributor map of a full swarm is a few tens of KiB."""
AUTH_TIMEOUT = 5.0

Port = Annotated[int, typer.Option(metavar="PORT", help="Port of the page (0 picks a free one).")]
Host = Annotated[str, typer.Option(metavar="HOST", help=(
    "Address the page listens on; keep 127.0.0.1 unless others must see it."))]
AuthUrl = Annotated[str | None, typer.Option(metavar="URL", help=(
    "The run's auth service (`psyswarm auth-service`): the leaderboard then sums each contributor's keys."))]


def fail(message: str) -> NoReturn:
    """Exit with one line naming what is wrong."""
    typer.secho(f"psyswarm dashboard: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def checked_options(server: str | None, url: str | None, port: int, auth_url: str | None,
                    initial_peers: list[str]) -> None:
    """Every option problem as one line, before anything starts."""
    if (server is None) == (url is None):
        fail("give exactly one of --server HOST:PORT (a TCP coordinator) and -u/--url URL (a Solana cluster)")
    if not 0 <= port <= 65535:
        fail(f"--port {port} is not a TCP port (0..65535)")
    if auth_url is not None and urllib.parse.urlsplit(auth_url).scheme not in ("http", "https"):
        fail(f"--auth-url {auth_url!r} is not an http:// or https:// URL")
    if initial_peers:
        check_multiaddrs(initial_peers)


def check_multiaddrs(initial_peers: list[str]) -> None:
    from hivemind.utils.multiaddr import Multiaddr  # hivemind's own copy of the multiaddr parser

    for peer in initial_peers:
        try:
            Multiaddr(peer)
        except Exception as exc:  # noqa: BLE001 - multiaddr raises several types for a bad address
            fail(f"--initial-peer {peer!r} is not a multiaddr: {exc}")


def backend_opener(server: str | None, url: str | None, run_id: str, program_id: str | None):
    """A function opening a fresh read-only backend each time the feed (re)connects; checked once now so that a
    malformed --server or --program-id is reported at once."""
    from solders.keypair import Keypair

    from client.backends.base import BackendError
    from client.commands.connect import open_backend

    def opener():
        return open_backend(server, url, run_id, program_id, Keypair())  # a throwaway key: it only reads

    try:
        opener()
    except (BackendError, typer.BadParameter) as exc:  # a malformed --server; a malformed --program-id
        fail(str(exc))
    return opener


class DhtReader:
    """Reads the run's DHT for the feed; joins it on first use, on the feed's thread (joining takes seconds)."""

    def __init__(self, initial_peers: list[str], run_id: str) -> None:
        self.initial_peers, self.run_id = initial_peers, run_id
        self.board = None
        self.history = None
        self.members: set[str] = set()
        self.looked_at = -1  # the state nonce of the last look for rounds' results

    def __call__(self, state):
        from client.commands.status import dht_worker_records, open_board
        from client.dashboard.feed import DhtReading
        from client.dashboard.history import History
        from client.witness.records import Commitment, members

        if self.board is None:
            self.board = open_board(self.initial_peers, state)
            self.history = History(lambda epoch, round_: list(
                self.board.fetch(Commitment, epoch, round_, self.members).values()))
        announced = dht_worker_records(self.board, state)
        if state.nonce == self.looked_at:  # a round's commitments are read once per state, not once per refresh
            return DhtReading(announced)
        self.looked_at = state.nonce
        self.members = members(state)  # only the run's clients' commitments count: computed once per state
        return DhtReading(announced, self.history.read(state))

    def close(self) -> None:
        if self.board is not None:
            self.board.dht.shutdown()


def contributors_reader(auth_url: str):
    """Reads the auth service's map of keys to contributors (checked: it is a peer like any other)."""
    from client.dashboard.view import contributor_map

    def read(run_id: str) -> dict[str, str]:
        query = urllib.parse.urlencode({"run_id": run_id})
        with urllib.request.urlopen(f"{auth_url.rstrip('/')}/api/contributors?{query}", timeout=AUTH_TIMEOUT) as r:
            body = r.read(MAX_CONTRIBUTORS_BYTES + 1)
        if len(body) > MAX_CONTRIBUTORS_BYTES:
            raise ValueError(f"the auth service's contributor map is over {MAX_CONTRIBUTORS_BYTES} bytes")
        return contributor_map(from_json(body))

    return read


def dashboard(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
    port: Port = 8080,
    host: Host = "127.0.0.1",
    auth_url: AuthUrl = None,
) -> None:
    """Serve a live web page of the run: phase and time left, stage occupancy, loss and tokens/s (with
    --initial-peer), witnesses, checkpoint and the leaderboard."""
    from client.dashboard.app import create_app
    from client.dashboard.feed import Feed
    from local_backend.logs import to_stderr
    from local_backend.web.server import WebServer

    checked_options(server, url, port, auth_url, initial_peers)
    to_stderr(logging.WARNING)
    opener = backend_opener(server, url, run_id, program_id)
    dht = DhtReader(initial_peers, run_id) if initial_peers else None
    feed = Feed(opener, run_id, read_dht=dht, read_contributors=contributors_reader(auth_url) if auth_url else None)
    try:
        web = WebServer(create_app(feed), host, port)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")

    async def run() -> None:
        following = asyncio.create_task(feed.run())
        typer.echo(f"dashboard: {web.url}/ (following {server or url})")
        try:
            await web.serve()
        finally:
            following.cancel()
            if dht is not None:
                await asyncio.to_thread(dht.close)

    try:
        with sigterm_interrupts():
            asyncio.run(run())
    except KeyboardInterrupt:
        typer.echo("dashboard stopped")


def register(app: typer.Typer) -> None:
    app.command()(dashboard)
