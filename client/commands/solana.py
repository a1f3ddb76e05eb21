"""Commands for the Solana backend: ``create-run`` on a cluster, and ``localnet``, a local development chain."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from client.commands.coordinator import KEYPAIR_HELP, ProgramId
from client.identity import DEFAULT_KEYPAIR_PATH

LOCALNET_FUNDS = 1_000 * 10**9
"""Lamports ``localnet`` gives each funded key: enough for a long development session's fees and runs."""


def create_run(
    url: Annotated[str, typer.Option(help="The Solana cluster: an RPC URL or localhost, devnet, testnet, "
                                          "mainnet-beta (as the Solana CLI's --url).")],
    config: Annotated[Path, typer.Option(help="The run's state.toml (run_id, [config], [model], [checkpoint]).")],
    run_id: Annotated[str | None, typer.Option(help="Must match the config's run_id [default: the config's].")] = None,
    keypair: Annotated[Path, typer.Option(help=KEYPAIR_HELP + " It pays, and becomes the run's main authority.")] = (
        DEFAULT_KEYPAIR_PATH),
    program_id: ProgramId = None,
) -> None:
    """Create a run on chain, configure it from state.toml and open it to members, in one transaction."""
    from client.commands.config import load_spec_or_exit
    from client.commands.coordinator import open_backend, open_identity
    from client.coordinator.backend import BackendError
    from client.coordinator.solana import SolanaBackend
    from client.swarm.status import describe
    from coordinator_program.errors import CoordinatorError

    spec = load_spec_or_exit(config)
    if run_id is not None and run_id != spec.run_id:
        raise typer.BadParameter(f"--run-id {run_id!r} differs from the config's run_id {spec.run_id!r}")
    authority = open_identity(keypair, required=True)

    async def run() -> None:
        backend = open_backend(None, url, spec.run_id, program_id, authority)
        assert isinstance(backend, SolanaBackend)
        try:
            await backend.create_run(spec)
            typer.echo(f"created run {spec.run_id!r} on {backend.url}: coordinator account "
                       f"{backend.coordinator_address}, instance {backend.instance_address}, "
                       f"program {backend.program_id}")
            typer.echo(describe(backend.state, now=time.time()))
        finally:
            await backend.close()

    try:
        asyncio.run(run())
    except (BackendError, CoordinatorError) as exc:
        typer.secho(f"cannot create the run: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def localnet(
    port: Annotated[int, typer.Option(help="JSON-RPC port; account subscriptions listen on the next one.")] = 8899,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    fund: Annotated[list[str], typer.Option(help=(
        "A public key or keypair file to give 1,000 SOL at start; repeatable. Like solana-test-validator, the "
        "default keypair is funded when it exists."))] = [],  # noqa: B006 - typer reads the default only
) -> None:
    """Run a local Solana chain with the coordinator program, for development: JSON-RPC over HTTP and
    accountSubscribe over websocket, on LiteSVM, its clock following wall time."""
    from solders.pubkey import Pubkey

    from client.identity import KeypairError, load_keypair
    from coordinator_program.localnet.chain import LocalChain
    from coordinator_program.localnet.server import run_localnet

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per subscriber connection
    recipients: list[Pubkey] = []
    for item in fund or ([str(DEFAULT_KEYPAIR_PATH)] if DEFAULT_KEYPAIR_PATH.expanduser().exists() else []):
        try:
            recipients.append(Pubkey.from_string(item))
        except ValueError:
            try:
                recipients.append(load_keypair(item).pubkey())
            except KeypairError as exc:
                raise typer.BadParameter(f"--fund {item!r}: not a public key, and {exc}") from None
    chain = LocalChain()
    for recipient in recipients:
        chain.airdrop(recipient, LOCALNET_FUNDS)

    def ready() -> None:
        typer.echo(f"psyswarm localnet: JSON-RPC http://{host}:{port}, websocket ws://{host}:{port + 1}, "
                   f"program {chain.program_id}; funded {', '.join(map(str, recipients)) or 'nobody'}")

    try:
        asyncio.run(run_localnet(host, port, chain, on_ready=ready))
    except KeyboardInterrupt:
        typer.echo("stopped; a local chain keeps nothing")
    except OSError as exc:
        typer.secho(f"cannot listen on {host}:{port} and {port + 1}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    app.command("create-run")(create_run)
    app.command()(localnet)
