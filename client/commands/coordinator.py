"""Commands that talk to a coordinator: ``serve``, ``status``, ``tick`` and ``keygen``."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import typer

from client.identity import DEFAULT_KEYPAIR_PATH

SERVER_HELP = "The TCP coordinator as HOST:PORT (started with `psyswarm serve`)."
KEYPAIR_HELP = "Your identity: a Solana keypair file."


def parse_interval(text: str) -> float:
    """'500ms', '2s', '1m' or a plain number of seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0}
    for suffix in ("ms", "s", "m"):
        if text.endswith(suffix):
            number, scale = text[: -len(suffix)], units[suffix]
            break
    else:
        number, scale = text, 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not an interval like 500ms, 2s or 1m") from None
    if value <= 0:
        raise typer.BadParameter("the interval must be positive")
    return value


def serve(
    config: Path = typer.Option(..., "--config", help="The run's state.toml."),
    port: int = typer.Option(7070, help="TCP port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    db: Path = typer.Option(Path("run.sqlite"), help="SQLite file keeping the run across restarts."),
    keypair: Path = typer.Option(None, help="The server's authority keypair [default: next to --db]."),
) -> None:
    """Run the centralised coordinator: it ticks the run, authenticates clients and broadcasts the state."""
    from client.identity import KeypairError, load_keypair, save_keypair
    from coordinator_program.config import load_run_spec
    from coordinator_program.errors import CoordinatorError
    from local_backend.server import CoordinatorServer
    from local_backend.store import RunStore, StoreError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        spec = load_run_spec(config)
        key_path = keypair or db.with_suffix(".authority.json")
        if not key_path.exists() and keypair is None:
            from solders.keypair import Keypair

            save_keypair(Keypair(), key_path)
        authority = load_keypair(key_path)
        server = CoordinatorServer(spec, RunStore(db), authority)
    except (CoordinatorError, KeypairError, StoreError) as exc:
        typer.secho(f"cannot serve: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None

    async def run() -> None:
        await server.start(host, port)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        typer.echo("stopped; the run is saved and resumes with the same --db")
    except OSError as exc:
        typer.secho(f"cannot listen on {host}:{port}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def open_identity(keypair: Path, *, required: bool):
    """The caller's keypair; commands that only read may use a throwaway one when the file is absent."""
    from solders.keypair import Keypair

    from client.identity import KeypairError, load_keypair

    if not required and not keypair.expanduser().exists():
        return Keypair()
    try:
        return load_keypair(keypair)
    except KeypairError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


async def connect(server: str, keypair):
    from client.backend import BackendError
    from client.tcp_backend import TcpBackend

    backend = TcpBackend(server, keypair)
    try:
        await backend.connect()
    except BackendError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    return backend


def status(
    server: str = typer.Option(..., help=SERVER_HELP),
    keypair: Path = typer.Option(DEFAULT_KEYPAIR_PATH, help=KEYPAIR_HELP),
    watch: bool = typer.Option(False, help="Keep printing the status as the run changes."),
) -> None:
    """Show the run: phase, epoch, round, clients per stage, witnesses, checkpoint."""
    from client.status import describe

    async def run() -> None:
        backend = await connect(server, open_identity(keypair, required=False))
        try:
            if not watch:
                typer.echo(describe(backend.state, now=time.time()))
                return
            async for state in backend.updates():
                typer.echo(describe(state, now=time.time()) + "\n")
        finally:
            await backend.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


def tick(
    server: str = typer.Option(..., help=SERVER_HELP),
    keypair: Path = typer.Option(DEFAULT_KEYPAIR_PATH, help=KEYPAIR_HELP),
    every: str = typer.Option(None, help="Keep ticking at this interval (e.g. 1s); once if omitted."),
) -> None:
    """Move the run forward if a transition is due (anyone may tick)."""
    from coordinator_program.errors import CoordinatorError, NothingToTick

    interval = parse_interval(every) if every else None

    async def run() -> None:
        backend = await connect(server, open_identity(keypair, required=False))
        try:
            while True:
                before = backend.state.phase
                try:
                    await backend.tick()  # the server sends the new state before its reply
                    typer.echo(f"ticked: {before.name} -> {backend.state.phase.name}")
                except NothingToTick:
                    if interval is None:
                        typer.echo(f"nothing to tick: {before.name} has no transition due yet")
                except CoordinatorError as exc:
                    typer.secho(f"tick rejected: {exc.detail}", fg=typer.colors.RED, err=True)
                    raise typer.Exit(1) from None
                if interval is None:
                    return
                await asyncio.sleep(interval)
        finally:
            await backend.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


def keygen(
    outfile: Path = typer.Option(DEFAULT_KEYPAIR_PATH, help="Where to write the keypair."),
    force: bool = typer.Option(False, help="Replace an existing keypair file."),
) -> None:
    """Create an identity: an ed25519 keypair in Solana's keypair-file format."""
    from solders.keypair import Keypair

    from client.identity import KeypairError, save_keypair

    keypair = Keypair()
    try:
        path = save_keypair(keypair, outfile, overwrite=force)
    except KeypairError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {path}; your identity is {keypair.pubkey()}")


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(status)
    app.command()(tick)
    app.command()(keygen)
