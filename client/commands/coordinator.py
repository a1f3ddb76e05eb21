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
import time
from pathlib import Path
from typing import Annotated

import typer

from client.commands.pipeline import InitialPeers
from client.identity import DEFAULT_KEYPAIR_PATH
from local_backend.peers import Limits

SERVER_HELP = "The TCP coordinator as HOST:PORT (started with `psyswarm serve`); or give --url."
KEYPAIR_HELP = "Your identity: a Solana keypair file."
Server = Annotated[str | None, typer.Option(help=SERVER_HELP)]
Url = Annotated[str | None, typer.Option(help="A Solana cluster instead of --server: an RPC URL or localhost, "
                                              "devnet, testnet, mainnet-beta (as the Solana CLI's --url).")]
RunId = Annotated[str | None, typer.Option(help="The run (required with --url: it locates the run on chain).")]
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
    from client.identity import KeypairError, load_keypair, save_keypair
    from coordinator_program.config import load_run_spec
    from coordinator_program.errors import CoordinatorError
    from local_backend.server import CoordinatorServer
    from local_backend.store import RunStore, StoreError

    admits = chosen_join_authority(join_authority, permissionless)
    try:
        limits = Limits(max_connections=max_connections, max_per_identity=max_per_key,
                        login_timeout=parse_interval(login_timeout), idle_timeout=parse_interval(idle_timeout),
                        max_buffered=max_buffered)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        spec = load_run_spec(config)
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
    """A connected backend, or exit with the reason it could not connect."""
    from client.coordinator.backend import BackendError

    try:
        backend = open_backend(server, url, run_id, program_id, keypair, authorizer)
        await backend.connect()
    except BackendError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    return backend


def status(
    server: Server = None,
    url: Url = None,
    run_id: RunId = None,
    program_id: ProgramId = None,
    keypair: Path = typer.Option(DEFAULT_KEYPAIR_PATH, help=KEYPAIR_HELP),
    watch: bool = typer.Option(False, help="Keep printing the status as the run changes."),
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
) -> None:
    """Show the run: phase, epoch, round, clients per stage, witnesses, checkpoint; with the run's DHT
    (--initial-peer), also the last loss the trainers committed and the workers each stage announces, with
    how many are still syncing."""
    from client.swarm.status import describe

    async def run() -> None:
        backend = await connect(server, open_identity(keypair, required=False), url, run_id, program_id)
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
    from client.join.stage_replica import model_config
    from client.pipeline.discovery import WorkerDirectory
    from client.stages import stage_name
    from client.swarm.status import workers_line

    directory = WorkerDirectory(board.dht, state.run_id, model_config(state).fingerprint())
    stages = [stage_name(i, state.config.num_stages) for i in range(state.config.num_stages)]
    return workers_line({stage: directory.records(stage) for stage in stages})


def tick(
    server: Server = None,
    url: Url = None,
    run_id: RunId = None,
    program_id: ProgramId = None,
    keypair: Path = typer.Option(DEFAULT_KEYPAIR_PATH, help=KEYPAIR_HELP),
    every: str = typer.Option(None, help="Keep ticking at this interval (e.g. 1s); once if omitted."),
) -> None:
    """Move the run forward if a transition is due (anyone may tick; on Solana the keypair pays the fee)."""
    from client.coordinator.backend import BackendError
    from coordinator_program.errors import CoordinatorError, NothingToTick

    check_target(server, url, run_id)
    interval = parse_interval(every) if every else None

    async def run() -> None:
        backend = await connect(server, open_identity(keypair, required=url is not None), url, run_id, program_id)
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
