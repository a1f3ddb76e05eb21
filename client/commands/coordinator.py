"""Commands that talk to a coordinator: ``serve``, ``status``, ``tick`` and ``keygen``.

A coordinator is reached either with ``--server`` (the TCP backend) or with ``--url`` and ``--run-id``
(the Solana program on a cluster); ``open_backend`` checks that exactly one was given.

Who may join a run is fixed when it is created (``serve`` here, ``create-run`` on Solana), and its creator must
say it: ``--join-authority`` names the key that countersigns every join (the run's auth service), and only
``--permissionless`` opens the run to anyone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Annotated

import typer

from client.commands.options import KEYPAIR_ENV, KEYPAIR_HELP, keypair_option, url_option
from client.commands.pipeline import InitialPeers
from client.identity import DEFAULT_KEYPAIR_PATH
from local_backend.peers import Limits

SERVER_HELP = "The TCP coordinator as HOST:PORT (started with `psyswarm serve`); or give --url."
Server = Annotated[str | None, typer.Option(metavar="HOST:PORT", help=SERVER_HELP)]
KeypairFile = Annotated[Path, keypair_option()]
Url = Annotated[str | None, url_option("A Solana cluster instead of --server: an RPC URL or localhost, devnet, "
                                       "testnet, mainnet-beta (as the Solana CLI's --url).")]
RunId = Annotated[str, typer.Option(metavar="RUN_ID", help=(
    "The run: it locates the run on chain, and a TCP coordinator must serve this run."))]
ProgramId = Annotated[str | None, typer.Option(envvar="PSYSWARM_PROGRAM_ID", help=(
    "The coordinator program's address on the cluster [default: the project's development program id]."))]
JoinAuthority = Annotated[str | None, typer.Option(metavar="PUBKEY_OR_KEYPAIR_FILE", help=(
    "The run's join authority: the key of its auth service (`psyswarm auth-service` prints it), as a public "
    "key or a keypair file. The coordinator then admits only joins it countersigned."))]
Permissionless = Annotated[bool, typer.Option(help="Let anyone join the run, with no auth service.")]


def public_key(text: str, option: str):
    """A base58 public key, or the public key of the keypair file ``text`` names; a usage error otherwise."""
    from solders.pubkey import Pubkey

    from client.identity import KeypairError, load_keypair

    try:
        return Pubkey.from_string(text)
    except ValueError:
        pass
    try:
        return load_keypair(text).pubkey()
    except KeypairError as exc:
        raise typer.BadParameter(f"{option} {text!r}: not a public key, and {exc}") from None


def chosen_join_authority(join_authority: str | None, permissionless: bool) -> bytes:
    """The join authority a run's creator chose: a key, or none (``NO_AUTHORITY``) only when it says
    ``--permissionless``. Neither, or both, exits with a one-line error."""
    from coordinator_program.rules import NO_AUTHORITY

    if (join_authority is None) != permissionless:
        both = "give --join-authority or --permissionless, not both: a run with a join authority is not permissionless"
        neither = ("say who may join the run: --join-authority PUBKEY_OR_KEYPAIR_FILE (its auth service's key) or "
                   "--permissionless (anyone)")
        typer.secho(both if permissionless else neither, fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    if join_authority is None:
        return NO_AUTHORITY
    key = bytes(public_key(join_authority, "--join-authority"))
    if key == NO_AUTHORITY:
        raise typer.BadParameter("the all-zero key means no join authority: say --permissionless instead",
                                 param_hint="--join-authority")
    return key


def admission_line(state) -> str:
    from coordinator_program.rules import admission

    return f"admission: {admission(state.join_authority)}"


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
    from client.commands.config import load_spec_or_exit
    from client.identity import KeypairError, load_keypair, save_keypair
    from coordinator_program.errors import CoordinatorError
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
    try:
        spec = load_spec_or_exit(config)  # a Hugging Face model's digests filled from its source
        key_path = keypair or db.with_suffix(".authority.json")
        if not key_path.exists() and keypair is None:
            from solders.keypair import Keypair

            save_keypair(Keypair(), key_path)
        authority = load_keypair(key_path)
        server = CoordinatorServer(spec, RunStore(db), authority, join_authority=admits, limits=limits)
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
    except (OSError, ValueError) as exc:  # ValueError: the open-file limit leaves no room for connections
        typer.secho(f"cannot listen on {host}:{port}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def open_identity(keypair: Path):
    """The caller's keypair, or end the command with the reason it cannot be read."""
    from client.identity import KeypairError, load_keypair

    try:
        return load_keypair(keypair)
    except KeypairError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def check_target(server: str | None, url: str | None, run_id: str | None) -> None:
    """A usage error unless exactly one of ``--server`` and ``--url`` is given, and ``--url`` with ``--run-id``."""
    if (server is None) == (url is None):
        raise typer.BadParameter("give exactly one of --server (a TCP coordinator) and --url (a Solana cluster)")
    if url is not None and run_id is None:
        raise typer.BadParameter("--url needs --run-id: the run id locates the run's accounts on chain")


def open_backend(server: str | None, url: str | None, run_id: str | None, program_id: str | None, keypair,
                 authorizer=None):
    """The backend ``--server`` or ``--url`` names, not yet connected; ``authorizer`` co-signs its joins (the
    client's ``AuthSession`` on a permissioned run)."""
    check_target(server, url, run_id)
    if server is not None:
        from client.coordinator.tcp import TcpBackend

        return TcpBackend(server, keypair, authorizer=authorizer)
    assert url is not None and run_id is not None
    from client.coordinator.solana import SolanaBackend

    return SolanaBackend(url, keypair, run_id, program_id=program_address(program_id), authorizer=authorizer)


def program_address(program_id: str | None):
    """``--program-id`` as a public key; the project's development program when it is not given."""
    from solders.pubkey import Pubkey

    from coordinator_program.program_id import PROGRAM_ID

    try:
        return Pubkey.from_string(program_id) if program_id else PROGRAM_ID
    except ValueError:
        raise typer.BadParameter(f"--program-id {program_id!r} is not a base58 public key") from None


async def connect(server: str | None, keypair, url: str | None = None, run_id: str | None = None,
                  program_id: str | None = None, authorizer=None):
    """A connected backend of run ``run_id``, or exit with the reason it could not connect (a TCP coordinator
    serving another run included: every command names the run it means)."""
    from client.coordinator.backend import BackendError

    try:
        backend = open_backend(server, url, run_id, program_id, keypair, authorizer)
        await backend.connect()
    except BackendError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    served = backend.state.run_id
    if run_id is not None and served != run_id:
        await backend.close()
        typer.secho(f"the coordinator at {server or url} serves run {served!r}, not {run_id!r}: check --run-id and "
                    "the coordinator's address", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    return backend


def status(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    keypair: Annotated[Path | None, typer.Option("--keypair", "-k", hidden=True, help=(
        "Not read: status only reads the run, as a throwaway identity; accepted so that a command line made for "
        "another command works."))] = None,
    watch: bool = typer.Option(False, help="Keep printing the status as the run changes."),
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
) -> None:
    """Show the run: phase, epoch, round, clients per stage, witnesses, checkpoint; with the run's DHT
    (--initial-peer), also the last loss the trainers committed and the workers each stage announces, with
    how many are still syncing. Needs no keypair: it only reads."""
    from solders.keypair import Keypair

    from client.swarm.status import describe

    async def run() -> None:
        backend = await connect(server, Keypair(), url, run_id, program_id)
        board = await asyncio.to_thread(open_board, initial_peers, backend.state.run_id) if initial_peers else None
        try:
            async for state in backend.updates():
                text = describe(state, now=time.time()) + "\n" + admission_line(state)
                if board is not None:
                    text += "\n" + await asyncio.to_thread(loss_line, board, state)
                    text += "\n" + await asyncio.to_thread(dht_workers_line, board, state)
                typer.echo(text + ("\n" if watch else ""))
                if not watch:
                    return
        finally:
            await backend.close()
            if board is not None:
                await asyncio.to_thread(board.dht.shutdown)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


def open_board(initial_peers: list[str], run_id: str):
    from client.pipeline.discovery import start_dht
    from client.witness.records import Board

    return Board(start_dht(initial_peers), run_id)


def loss_line(board, state) -> str:
    from client.witness.records import last_loss

    found = last_loss(board, state.epoch, state.round.height, state.config.rounds_per_epoch)
    if found is None:
        return "last loss: none committed yet"
    epoch, round_, loss = found
    return f"last loss: {loss:.4f} (epoch {epoch}, round {round_ + 1})"


def dht_workers_line(board, state) -> str:
    from client.swarm.status import workers_line

    return workers_line(dht_worker_records(board, state))


def dht_worker_records(board, state) -> dict:
    """Each stage's name and the worker records it announces in the run's DHT."""
    from client.join.stage_replica import model_config
    from client.pipeline.discovery import WorkerDirectory
    from client.stages import stage_name

    directory = WorkerDirectory(board.dht, state.run_id, model_config(state).fingerprint())
    stages = [stage_name(i, state.config.num_stages) for i in range(state.config.num_stages)]
    return {stage: directory.records(stage) for stage in stages}


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

    from client.coordinator.backend import BackendError
    from coordinator_program.errors import CoordinatorError, NothingToTick

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
    from client.coordinator.backend import BackendError
    from coordinator_program.errors import CoordinatorError

    check_target(server, url, run_id)
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
        typer.secho(f"cannot {verb} run {run_id!r}: {getattr(exc, 'detail', None) or exc}", fg=typer.colors.RED,
                    err=True)
        raise typer.Exit(1) from None
    typer.echo(done.format(run_id=run_id, phase=phase, authority=authority.pubkey()))


def pause(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    keypair: AuthorityKeypair = DEFAULT_KEYPAIR_PATH,
) -> None:
    """Ask the run to halt (the main authority only): it reaches Paused when it next waits for members, at the end
    of its epoch; then it may be updated or closed (`close-run`)."""
    authority_command(run_id, server, url, program_id, keypair, "pause", lambda backend: backend.set_paused(True),
                      "pause requested for run {run_id!r} (it was {phase}): it halts when it next waits for members; "
                      "`psyswarm status` shows Paused then")


def resume(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    keypair: AuthorityKeypair = DEFAULT_KEYPAIR_PATH,
) -> None:
    """Let a paused run (or one asked to pause) go on (the main authority only)."""
    authority_command(run_id, server, url, program_id, keypair, "resume", lambda backend: backend.set_paused(False),
                      "run {run_id!r} resumes (it was {phase})")


def close_run(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    keypair: AuthorityKeypair = DEFAULT_KEYPAIR_PATH,
) -> None:
    """Close a halted run (Paused or Finished; `psyswarm pause` halts one) for good: only its main authority may. On
    Solana both of the run's accounts give their rent back to it and cease to exist; a run on the TCP server ends
    when the server stops."""
    from client.coordinator.solana import SolanaBackend
    from coordinator_program.instructions import CloseRun

    async def close(backend) -> None:  # on chain the accounts vanish, so there is no state to read back
        await (backend.close_run() if isinstance(backend, SolanaBackend) else backend.submit(CloseRun()))

    authority_command(run_id, server, url, program_id, keypair, "close", close,
                      "closed run {run_id!r} (it was {phase}); its accounts' rent went back to {authority}")


def keygen(
    outfile: Annotated[Path, typer.Option("--outfile", "-o", envvar=KEYPAIR_ENV, metavar="FILE", help=(
        "Where to write the keypair (one per process: each `join-run` needs its own identity)."))] = (
        DEFAULT_KEYPAIR_PATH),
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
    app.command()(pause)
    app.command()(resume)
    app.command("close-run")(close_run)
    app.command()(keygen)
