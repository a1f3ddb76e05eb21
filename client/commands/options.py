"""Options every command spells the same way, as the Solana CLI does: ``-u/--url`` and ``-k/--keypair``, with one
default keypair for every command (``~/.config/solana/id.json``, or the file ``$PSYSWARM_KEYPAIR`` names)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from client.identity import DEFAULT_KEYPAIR_PATH

KEYPAIR_ENV = "PSYSWARM_KEYPAIR"
"""Names the keypair file a command uses when --keypair is not given."""
KEYPAIR_HELP = "Your identity: a Solana keypair file (one per process)."
URL_HELP = "The Solana cluster: an RPC URL or localhost, devnet, testnet, mainnet-beta (as the Solana CLI's --url)."


def default_keypair_path() -> Path:
    """The keypair a command uses when --keypair is not given: $PSYSWARM_KEYPAIR, else Solana's default file."""
    return Path(os.environ.get(KEYPAIR_ENV) or DEFAULT_KEYPAIR_PATH)


def keypair_option(help_text: str = KEYPAIR_HELP) -> Any:
    """``-k/--keypair`` with the one default (``DEFAULT_KEYPAIR_PATH``), overridden by $PSYSWARM_KEYPAIR, which
    help shows."""
    return typer.Option("--keypair", "-k", envvar=KEYPAIR_ENV, metavar="FILE", help=help_text)


def url_option(help_text: str = URL_HELP) -> Any:
    """``-u/--url`` as the Solana CLI spells it."""
    return typer.Option("--url", "-u", metavar="URL_OR_MONIKER", help=help_text)
