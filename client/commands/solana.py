"""Commands for the Solana backend: ``create-run`` on a cluster, ``localnet``, a local development chain, and
``airdrop``, transaction fees for a contributor on a chain that gives SOL away (localnet, devnet, testnet)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from client.commands.connect import JoinAuthority, Permissionless, ProgramId
from client.commands.options import KEYPAIR_HELP, default_keypair_path, keypair_option, url_option
from client.identity import DEFAULT_KEYPAIR_PATH

LOCALNET_FUNDS = 1_000 * 10**9
"""Lamports ``localnet`` gives each funded key: enough for a long development session's fees and runs."""


def create_run(
    url: Annotated[str, url_option()],
    config: Annotated[Path, typer.Option(metavar="FILE", help=(
        "The run's state.toml (run_id, [config], [model], [checkpoint]).")),
    ],
    run_id: Annotated[str | None, typer.Option(help="Must match the config's run_id [default: the config's].")] = None,
    keypair: Annotated[Path, keypair_option(KEYPAIR_HELP + " It pays, and becomes the run's main authority (who "
                                                           "may close it).")] = DEFAULT_KEYPAIR_PATH,
    program_id: ProgramId = None,
    join_authority: JoinAuthority = None,
    permissionless: Permissionless = False,
) -> None:
    """Create a run on chain, configure it from state.toml and open it to members, in one transaction. Give
    --join-authority (joins need the auth service's countersignature) or --permissionless."""
    from client.backends.base import BackendError
    from client.backends.solana import SolanaBackend
    from client.commands.config import load_spec_or_exit
    from client.commands.connect import admission_line, chosen_join_authority, open_backend, open_identity
    from client.swarm.status import describe
    from coordinator_program.spec.errors import CoordinatorError

    admits = chosen_join_authority(join_authority, permissionless)
    spec = load_spec_or_exit(config)
    if run_id is not None and run_id != spec.run_id:
        raise typer.BadParameter(f"--run-id {run_id!r} differs from the config's run_id {spec.run_id!r}")
    authority = open_identity(keypair)

    async def run() -> None:
        backend = open_backend(None, url, spec.run_id, program_id, authority)
        assert isinstance(backend, SolanaBackend)
        try:
            await backend.create_run(spec, admits)
            typer.echo(f"created run {spec.run_id!r} on {backend.url}: coordinator account "
                       f"{backend.coordinator_address}, instance {backend.instance_address}, "
                       f"program {backend.program_id}")
            typer.echo(describe(backend.state, now=time.time()) + "\n" + admission_line(backend.state))
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
    fund: Annotated[list[str], typer.Option(metavar="PUBKEY_OR_KEYPAIR_FILE", help=(
        "A public key or keypair file to give 1,000 SOL at start; repeatable. Like solana-test-validator, the "
        "default keypair (--keypair's default, or $PSYSWARM_KEYPAIR) is funded when it exists; give others SOL "
        "later with `psyswarm airdrop`."))] = [],  # noqa: B006 - typer reads the default only
) -> None:
    """Run a local Solana chain with the coordinator program, for development: JSON-RPC over HTTP and
    accountSubscribe over websocket, on LiteSVM, its clock following wall time."""
    from client.commands.connect import public_key
    from coordinator_program.localnet.chain import LocalChain
    from coordinator_program.localnet.server import run_localnet

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per subscriber connection
    default = default_keypair_path()
    defaults = [str(default)] if default.expanduser().exists() else []
    recipients = [public_key(item, "--fund") for item in fund or defaults]
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


def airdrop(
    url: Annotated[str, url_option("The Solana cluster: an RPC URL or localhost, devnet, testnet (mainnet-beta "
                                   "gives no SOL away).")],
    keypair: Annotated[Path, keypair_option(KEYPAIR_HELP + " It receives the SOL.")] = DEFAULT_KEYPAIR_PATH,
    sol: Annotated[float, typer.Option(min=0.001, max=1_000.0, help="How much to ask for, in SOL.")] = 10.0,
) -> None:
    """Ask the cluster for SOL: every contributor on a Solana run pays its transactions' fees."""
    from solana.rpc.api import Client
    from solana.rpc.commitment import Confirmed

    from client.backends.base import BackendError
    from client.backends.solana import resolve_url
    from client.commands.connect import open_identity

    try:
        rpc = resolve_url(url)
    except BackendError as exc:
        raise typer.BadParameter(str(exc)) from None
    pubkey = open_identity(keypair).pubkey()
    client = Client(rpc, commitment=Confirmed, timeout=30)
    try:
        signature = client.request_airdrop(pubkey, round(sol * 10**9)).value
        deadline = time.monotonic() + 60
        while client.get_signature_statuses([signature]).value[0] is None and time.monotonic() < deadline:
            time.sleep(0.5)
        balance = client.get_balance(pubkey).value
    except Exception as exc:  # the RPC's errors come as several exception types; each is one line for the user
        reason = str(exc).strip() or type(exc).__name__
        typer.secho(f"airdrop to {pubkey} on {rpc} failed: {reason} (mainnet-beta and some RPC providers give "
                    "no SOL away: fund the key with a transfer instead)", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{pubkey} holds {balance / 10**9:,.4f} SOL on {rpc}")


def register(app: typer.Typer) -> None:
    app.command("create-run")(create_run)
    app.command()(localnet)
    app.command()(airdrop)
