"""Commands that move a run: ``serve`` (the TCP coordinator), ``tick`` (anyone), and the main authority's
``pause``, ``resume`` and ``close-run``."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import typer

from client.commands.connect import (
    JoinAuthority,
    Permissionless,
    ProgramId,
    RunId,
    Server,
    Url,
    check_target,
    chosen_join_authority,
    connect,
    open_identity,
)
from client.commands.options import KEYPAIR_HELP, keypair_option
from client.identity import DEFAULT_KEYPAIR_PATH
from local_backend.peers import Limits, listen

MIN_INTERVAL = 0.05
"""The shortest interval any option takes (50 ms): shorter would only flood the coordinator or drop every client."""


def parse_interval(text: str, option: str) -> float:
    """'500ms', '2s', '1m' or a plain number of seconds, finite and at least ``MIN_INTERVAL``; a usage error naming
    ``option`` otherwise."""
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
        raise typer.BadParameter(f"{text!r} is not an interval like 500ms, 2s or 1m", param_hint=option) from None
    if not math.isfinite(value) or value < MIN_INTERVAL:
        raise typer.BadParameter(f"{text!r}: give a finite interval of at least {MIN_INTERVAL * 1000:.0f}ms, like "
                                 "500ms, 2s or 1m", param_hint=option)
    return value


def serve(
    config: Path = typer.Option(..., "--config", help="The run's state.toml."),
    port: int = typer.Option(7070, help="TCP port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 for every interface)."),
    db: Path = typer.Option(Path("run.sqlite"), help="SQLite file keeping the run across restarts."),
    keypair: Annotated[Path | None, typer.Option("--keypair", "-k", metavar="FILE", help=(
        "The server's authority keypair (its main authority) [default: next to --db, created if absent].")
    )] = None,
    join_authority: JoinAuthority = None,
    permissionless: Permissionless = False,
    max_connections: int = typer.Option(Limits.max_connections, help=(
        "Logged-in connections at once (fewer if the open-file limit is lower); when full, a newcomer takes the "
        "place of the oldest connection of a key outside the run.")),
    max_per_key: int = typer.Option(Limits.max_per_identity, help=(
        "Connections one key may hold; its oldest gives way to a newer one.")),
    idle_timeout: str = typer.Option(f"{Limits.idle_timeout:g}s", help=(
        "Close a connection that sends nothing for this long (a client answers the server's pings, so following "
        "the run is not idle).")),
    login_timeout: str = typer.Option(f"{Limits.login_timeout:g}s", help=(
        "Close a connection that has not logged in after this long.")),
    max_buffered: int = typer.Option(Limits.max_buffered, help=(
        "Bytes received from clients and not yet processed that the server holds in all; past it, the "
        "connections holding the most are closed.")),
) -> None:
    """Run the centralised coordinator: it ticks the run, authenticates clients and broadcasts the state.
    Give --join-authority (joins need the auth service's countersignature) or --permissionless."""
    from client.commands.config import check_dataset_or_exit, load_spec_or_exit
    from client.commands.signals import sigterm_interrupts
    from client.identity import KeypairError, load_keypair, save_keypair
    from coordinator_program.spec.errors import CoordinatorError
    from local_backend.server import CoordinatorServer
    from local_backend.store import RunStore, StoreError

    admits = chosen_join_authority(join_authority, permissionless)
    try:
        limits = Limits(max_connections=max_connections, max_per_identity=max_per_key,
                        login_timeout=parse_interval(login_timeout, "--login-timeout"),
                        idle_timeout=parse_interval(idle_timeout, "--idle-timeout"),
                        max_buffered=max_buffered)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    spec = load_spec_or_exit(config)  # a Hugging Face model's digests filled from its source
    check_dataset_or_exit(spec.model, here=False)  # the coordinator's machine need not hold the data
    try:  # bound before the run's database and key are made: a busy port leaves nothing behind
        listener = listen(host, port)
    except OSError as exc:
        typer.secho(f"cannot listen on {host}:{port}: {exc.strerror or exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    try:
        key_path = keypair or db.with_suffix(".authority.json")
        if not key_path.exists() and keypair is None:
            from solders.keypair import Keypair

            save_keypair(Keypair(), key_path)
        authority = load_keypair(key_path)
        server = CoordinatorServer(spec, RunStore(db), authority, join_authority=admits, limits=limits)
    except (CoordinatorError, KeypairError, StoreError) as exc:
        listener.close()
        typer.secho(f"cannot serve: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None

    async def run() -> None:
        await server.start(host, port, listener)
        # What is loaded by now (the imports, torch's among them: hundreds of thousands of objects) lives as long as
        # the process: left to the collector, each full collection walks it all again, a pause of tens of ms in
        # the middle of a change's broadcast every few dozen changes.
        gc.freeze()
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()

    try:
        with sigterm_interrupts():
            asyncio.run(run())
    except KeyboardInterrupt:
        typer.echo("stopped; the run is saved and resumes with the same --db")
    except (OSError, ValueError) as exc:  # ValueError: the open-file limit leaves no room for connections
        typer.secho(f"cannot listen on {host}:{port}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def tick(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    keypair: Annotated[Path, keypair_option(KEYPAIR_HELP + " On Solana it pays the fee.")] = DEFAULT_KEYPAIR_PATH,
    every: Annotated[str | None, typer.Option(metavar="INTERVAL", help=(
        "Keep ticking at this interval (e.g. 500ms, 1s, 1m; at least 50ms); once if omitted."))] = None,
) -> None:
    """Move the run forward if a transition is due (anyone may tick; on Solana the keypair pays the fee)."""
    from solders.keypair import Keypair

    from client.backends.base import BackendError
    from coordinator_program.spec.errors import CoordinatorError, NothingToTick

    check_target(server, url, run_id)
    interval = parse_interval(every, "--every") if every is not None else None
    identity = open_identity(keypair) if url is not None else Keypair()  # the TCP server ticks for anyone

    async def run() -> None:
        backend = await connect(server, identity, url, run_id, program_id)
        try:
            while True:
                before = backend.state.phase
                try:
                    await backend.tick()  # both backends have the new state when the tick returns
                    typer.echo(f"ticked: {before.name} -> {backend.state.phase.name}")
                except NothingToTick:
                    if interval is None:
                        typer.echo(f"nothing to tick: {before.name} has no transition due yet")
                except CoordinatorError as exc:
                    typer.secho(f"tick rejected: {exc.detail}", fg=typer.colors.RED, err=True)
                    raise typer.Exit(1) from None
                except BackendError as exc:
                    typer.secho(f"tick failed: {exc}", fg=typer.colors.RED, err=True)
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


AuthorityKeypair = Annotated[Path, keypair_option(
    "The run's main authority: its creator's keypair (`create-run`), or the server's (`serve` writes it next to "
    "its --db as *.authority.json).")]


def authority_command(run_id: str, server: str | None, url: str | None, program_id: str | None, keypair: Path,
                      verb: str, action, done: str) -> None:
    """Connect to run ``run_id`` as its main authority, run ``action(backend)`` and print ``done`` with the phase
    the run is then in; the coordinator's refusal, or an unreachable backend, is one line and exit status 1."""
    from client.backends.base import BackendError
    from coordinator_program.spec.errors import CoordinatorError, NotAuthorized

    check_target(server, url, run_id)
    advice = ("on the TCP server the run's main authority is the keypair `serve` keeps beside its --db "
              "(run.authority.json beside run.sqlite): give it with -k" if server is not None else
              "on Solana it is the keypair that ran `create-run`: give it with -k")
    if not keypair.expanduser().exists():  # a new key would not be the run's authority: no keygen advice here
        typer.secho(f"cannot {verb} run {run_id!r}: keypair file {keypair} does not exist; {advice}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    authority = open_identity(keypair)

    async def run() -> str:
        backend = await connect(server, authority, url, run_id, program_id)
        try:
            phase = backend.state.phase.name
            await action(backend)
            return phase
        finally:
            await backend.close()

    try:
        phase = asyncio.run(run())
    except (CoordinatorError, BackendError) as exc:
        why = getattr(exc, "detail", None) or exc
        typer.secho(f"cannot {verb} run {run_id!r}: {why}{f'; {advice}' if isinstance(exc, NotAuthorized) else ''}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(done.format(run_id=run_id, phase=phase, authority=authority.pubkey()))


def authority_verb(name: str, verb: str, action: Callable[[object], Awaitable[object]], done: str, doc: str):
    """A command that ``authority_command`` carries out: the run it names, how it reaches the coordinator and the
    authority's key are one set of options, declared here once for ``pause``, ``resume`` and ``close-run``."""

    def command(
        run_id: RunId,
        server: Server = None,
        url: Url = None,
        program_id: ProgramId = None,
        keypair: AuthorityKeypair = DEFAULT_KEYPAIR_PATH,
    ) -> None:
        authority_command(run_id, server, url, program_id, keypair, verb, action, done)

    command.__name__, command.__doc__ = name, doc
    return command


async def close(backend) -> None:
    """Close the run: on chain its accounts vanish (so there is no state to read back); on TCP the server refuses."""
    from client.backends.solana import SolanaBackend
    from coordinator_program.spec.instructions import CloseRun

    await (backend.close_run() if isinstance(backend, SolanaBackend) else backend.submit(CloseRun()))


pause = authority_verb(
    "pause", "pause", lambda backend: backend.set_paused(True),
    "pause requested for run {run_id!r} (it was {phase}): it halts when it next waits for members; "
    "`psyswarm status` shows Paused then",
    """Ask the run to halt (the main authority only): it reaches Paused when it next waits for members, at the end
    of its epoch; then it may be updated or closed (`close-run`).""")
resume = authority_verb(
    "resume", "resume", lambda backend: backend.set_paused(False), "run {run_id!r} resumes (it was {phase})",
    """Let a paused run (or one asked to pause) go on (the main authority only).""")
close_run = authority_verb(
    "close-run", "close", close, "closed run {run_id!r} (it was {phase}); its accounts' rent went back to {authority}",
    """Close a halted run (Paused or Finished; `psyswarm pause` halts one) for good: only its main authority may. On
    Solana both of the run's accounts give their rent back to it and cease to exist; a run on the TCP server ends
    when the server stops.""")


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(tick)
    for command in (pause, resume, close_run):
        app.command(command.__name__)(command)
