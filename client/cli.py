"""The ``psyswarm`` command line.

Each command group lives in its own module under ``client.commands`` and registers itself here, so that
``psyswarm --help`` stays fast: heavy libraries (torch, hivemind, solana) are imported inside commands.

May import: client.commands.
"""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES = (
    "client.commands.config",
    "client.commands.operate",
    "client.commands.status",
    "client.commands.keys",
    "client.commands.pipeline",
    "client.commands.run",
    "client.commands.solana",
    "client.commands.deploy",
    "client.commands.demo",
    "client.commands.auth",
    "client.commands.export",
    "client.commands.data",
    "client.commands.dashboard",
)

app = typer.Typer(
    name="psyswarm",
    help="Train one model across many untrusted machines: coordinator, pipeline workers and trainers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Keep the CLI a group of commands even while only one is registered."""

for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
