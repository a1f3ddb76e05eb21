"""``psyswarm keygen``: make an identity, one per process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from client.commands.options import KEYPAIR_ENV
from client.identity import DEFAULT_KEYPAIR_PATH


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
    app.command()(keygen)
