"""The ``dht``, ``worker`` and ``trainer`` commands: options, errors, and a real run (slow)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import typer
from solders.keypair import Keypair
from typer.testing import CliRunner

from client.commands import pipeline
from client.identity import save_keypair


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    pipeline.register(app)
    return app


def test_commands_are_registered_with_help(app: typer.Typer) -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("dht", "worker", "trainer"):
        assert command in result.output
    assert "--stage" in CliRunner().invoke(app, ["worker", "--help"]).output


@pytest.mark.parametrize(
    "args, message",
    [
        (["worker", "--stage", "body9"], "stage must be one of head, body1, tail"),
        (["worker", "--stage", "head", "--layers", "2"], "n_layers must be at least num_stages"),
        (["worker", "--stage", "head", "--wire-codec", "int4"], "Invalid value for --wire-codec: must be one of"),
        (["trainer", "--data", "/nonexistent/corpus"], "does not exist"),
        (["trainer", "--inflight", "0"], "give auto or a whole number"),
        (["trainer", "--inflight", "many"], "give auto or a whole number"),
        (["trainer", "--inflight", "33"], "give auto or a whole number"),
        (["trainer", "--keypair", "/nonexistent/id.json"], "create one with `psyswarm keygen"),
        (["worker", "--stage", "head", "-k", "/nonexistent/id.json"], "create one with `psyswarm keygen"),
    ],
)
def test_bad_options_fail_with_a_clear_message(app: typer.Typer, args: list[str], message: str, tmp_path) -> None:
    if "--keypair" not in args and "-k" not in args:
        args = [*args, "--keypair", str(save_keypair(Keypair(), tmp_path / "id.json"))]
    result = CliRunner().invoke(app, [*args, "--run-id", "r"])
    assert result.exit_code == 2
    assert message in re.sub(r"\s*│\s*", " ", result.output)


@pytest.mark.parametrize("command", [["worker", "--stage", "head"], ["trainer"]])
def test_worker_and_trainer_name_their_run(app: typer.Typer, command: list[str], tmp_path) -> None:
    """No silent default run: a standalone worker or trainer names its run, as join-run does."""
    result = CliRunner().invoke(app, [*command, "--keypair", str(save_keypair(Keypair(), tmp_path / "id.json"))])
    assert result.exit_code == 2 and "Missing option '--run-id'" in result.output, result.output


def test_the_default_keypair_comes_from_psyswarm_keypair(app: typer.Typer, tmp_path) -> None:
    """$PSYSWARM_KEYPAIR replaces ~/.config/solana/id.json as every command's --keypair default."""
    missing = tmp_path / "from-the-environment.json"
    result = CliRunner().invoke(app, ["trainer", "--run-id", "r"], env={"PSYSWARM_KEYPAIR": str(missing)})
    assert result.exit_code == 2 and str(missing) in re.sub(r"\s*│\s*", "", result.output), result.output


def _cli(*args: str) -> subprocess.Popen[str]:
    code = "from client.cli import main; main()"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=os.getcwd(),
    )


@pytest.mark.slow
def test_standalone_run_from_the_command_line(tmp_path) -> None:
    """``psyswarm dht``, three workers and a trainer as separate processes, as a user would run them."""
    model = ["--layers", "3", "--width", "32", "--heads", "2", "--seq-len", "16"]
    keypair = save_keypair(Keypair(), tmp_path / "trainer.json")
    processes = [_cli("dht")]
    try:
        peer = None
        for line in processes[0].stdout:  # hivemind may log first
            if found := re.search(r"--initial-peer (\S+)", line):
                peer = found.group(1)
                break
        assert peer, "the DHT bootstrap printed no address"
        for stage in ("head", "body1", "tail"):
            processes.append(
                _cli(
                    "worker",
                    "--stage",
                    stage,
                    "--run-id",
                    "standalone",
                    "--keypair",
                    str(save_keypair(Keypair(), tmp_path / f"{stage}.json")),
                    "--initial-peer",
                    peer,
                    "--step-every",
                    "8",
                    "--threads",
                    "1",
                    *model,
                )
            )
        # Started at once: the trainer logs a stall until every stage has announced a worker, then trains.
        trainer = subprocess.run(
            [
                sys.executable,
                "-c",
                "from client.cli import main; main()",
                "trainer",
                "--run-id",
                "standalone",
                "--initial-peer",
                peer,
                "--steps",
                "3",
                "--batch-size",
                "8",
                "--microbatch-size",
                "4",
                "--keypair",
                str(keypair),
                *model,
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        assert len(re.findall(r"batch \d/3: loss \d+\.\d+", trainer.stderr)) == 3
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
