"""The command line's small courtesies: `psyswarm --version`, one spelling of value placeholders in every command's
help, and a mistyped demo model answered with the choices and the likeliest one meant."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from client.cli import app

COMMANDS = [c.name or c.callback.__name__ for c in app.registered_commands]


def test_version() -> None:
    result = subprocess.run([sys.executable, "-m", "client.cli", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"psyswarm {version('psyswarm')}"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_spells_every_placeholder_in_capitals(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    typer_labels = r"<(int|str|float|path|bool|file|text|uuid|datetime)( range)?>|<list\[\w+\]>"
    assert not re.search(typer_labels, result.output), result.output


def test_a_mistyped_demo_model_names_the_choices_and_the_likeliest(tmp_path) -> None:
    result = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "d"), "--model", "tiny-lama"])
    assert result.exit_code == 2 and "Value error" not in result.output
    assert "'tiny-lama' is not a demo model: choose 'psyswarm' or 'tiny-llama'; did you mean 'tiny-llama'?" in \
        " ".join(result.output.split())


def test_an_empty_initial_peer_is_refused_at_once(tmp_path) -> None:
    """`--initial-peer "$PEER"` with PEER unset started a client that could find no one."""
    result = CliRunner().invoke(app, ["join-run", "--server", "127.0.0.1:1", "--run-id", "demo", "--role", "worker",
                                      "-k", str(tmp_path / "k.json"), "--initial-peer", ""])
    assert result.exit_code == 2 and "--initial-peer is empty" in " ".join(result.output.split()), result.output
