"""``psyswarm deploy``: put the committed coordinator program on a cluster, or upgrade it there."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer

from client.commands.options import KEYPAIR_HELP, keypair_option, url_option
from client.identity import DEFAULT_KEYPAIR_PATH
from coordinator_program.onchain.program_id import PROGRAM_KEYPAIR_PATH

PROGRESS_STEP = 10
"""Percent of the chunks between two progress lines (lines rather than a bar, so that logs read well)."""


def deploy(
    url: Annotated[str, url_option()],
    keypair: Annotated[Path, keypair_option(KEYPAIR_HELP + " It pays, and is the program's upgrade authority.")] = (
        DEFAULT_KEYPAIR_PATH),
    program_keypair: Annotated[Path, typer.Option(show_default="the project's development keypair", help=(
        "The program's address, as a keypair file; deploying to it again upgrades the program. The development "
        "keypair's secret is public: use your own for a real deployment."))] = PROGRAM_KEYPAIR_PATH,
) -> None:
    """Deploy the coordinator program (the committed .so) through the upgradeable loader, or upgrade it."""
    from client.backends.base import BackendError
    from client.backends.solana import resolve_url
    from client.identity import KeypairError, load_keypair
    from coordinator_program.onchain.deploy import DeployError
    from coordinator_program.onchain.deploy import deploy as deploy_program
    from coordinator_program.onchain.program_id import PROGRAM_ID
    from coordinator_program.program.build import DEFAULT_OUTPUT

    try:
        rpc_url = resolve_url(url)
        payer = load_keypair(keypair)
        program = load_keypair(program_keypair)
    except (BackendError, KeypairError) as exc:
        raise typer.BadParameter(str(exc)) from None
    image = DEFAULT_OUTPUT.read_bytes()
    typer.echo(f"deploying {DEFAULT_OUTPUT.name} ({len(image):,} bytes) to {program.pubkey()} on {rpc_url}, "
               f"paid by {payer.pubkey()}")
    reported = -1  # the last percentage printed

    def progress(done: int, total: int) -> None:
        nonlocal reported
        percent = 100 * done // total
        if percent // PROGRESS_STEP > reported // PROGRESS_STEP:
            reported = percent
            typer.echo(f"  chunks written: {done}/{total} ({percent}%)")

    try:
        result = asyncio.run(deploy_program(rpc_url, payer, program, image, progress))
    except DeployError as exc:
        typer.secho(f"deploy failed: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{'upgraded' if result.upgraded else 'deployed'} in {result.chunks} chunks "
               f"(transaction {result.signature})")
    if result.program_id != PROGRAM_ID:
        typer.echo(f"clients reach it with --program-id {result.program_id} (or PSYSWARM_PROGRAM_ID)")
    typer.echo(f"program id: {result.program_id}")


def register(app: typer.Typer) -> None:
    app.command()(deploy)
