"""The ``psyswarm`` command line.

Each command group lives in its own module under ``client.commands`` and registers itself here, so that
``psyswarm --help`` stays fast: heavy libraries (torch, hivemind, solana) are imported inside commands.

May import: client.commands.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperCommand

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


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"psyswarm {version('psyswarm')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("psyswarm (not installed: run from a source tree)")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print psyswarm's version and exit."),
) -> None:
    """Keep the CLI a group of commands even while only one is registered."""

class UniformMetavars(TyperCommand):
    """Every value placeholder in help spelled one way, as the options that name theirs do (``FILE``, ``PORT``,
    ``RUN_ID``): the option's name in capitals, where typer would print its Python type (``<int>``, ``<str>``,
    ``<int range>``, ``<list[Path]>``). Choices keep their list."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.param_type_name == "argument":
                param.metavar = param.metavar or (param.name or "value").upper()
                param.display_type_rich = lambda ctx: None  # its name is its placeholder, as in the usage line
            elif param.metavar is None and not param.is_flag and not param.type_descriptor.is_choice:
                param.metavar = (param.name or "value").upper()


for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)
for _command in app.registered_commands:
    if _command.cls in (None, TyperCommand):
        _command.cls = UniformMetavars


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
