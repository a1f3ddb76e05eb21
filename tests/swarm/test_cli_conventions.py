"""The CLI speaks as the Solana CLI does and names what is wrong: ``-u/--url`` and ``-k/--keypair`` with one default
(overridden by $PSYSWARM_KEYPAIR), ``--config`` wherever a config is read, ``--run-id`` required wherever a run is
named, plain types in help; bad intervals and unreachable clusters are one line naming the option or the reason;
``status`` only reads, so no keypair can stop it. Real CLI processes and the real TCP server, on loopback."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from client.cli import app
from tests.adversarial.test_admission_cli import RUN, STATE_TOML, free_port, wait_listening


def help_of(*command: str) -> str:
    result = CliRunner().invoke(app, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())


COMMANDS_WITH_A_KEYPAIR = ["tick", "pause", "resume", "close-run", "keygen", "worker", "trainer", "join-run",
                           "create-run", "airdrop", "deploy"]


@pytest.mark.parametrize("command", COMMANDS_WITH_A_KEYPAIR)
def test_every_keypair_is_k_with_one_default_and_its_env_var(command: str) -> None:
    text = help_of(command)
    flag = "-o, --outfile" if command == "keygen" else "-k, --keypair"
    assert flag in text and "PSYSWARM_KEYPAIR" in text and "~/.config/solana/id.json" in text, text


@pytest.mark.parametrize("command", ["status", "tick", "pause", "resume", "close-run", "join-run", "create-run",
                                     "airdrop", "deploy"])
def test_every_url_is_u(command: str) -> None:
    assert "-u, --url" in help_of(command)


@pytest.mark.parametrize("command", ["status", "tick", "pause", "resume", "close-run", "join-run", "worker",
                                     "trainer", "localnet", "validate-config", "serve", "auth-service", "dht",
                                     "train-tokenizer", "export", "dashboard"])
def test_help_shows_plain_types(command: str) -> None:
    text = help_of(command)
    assert "list[" not in text and "<list" not in text, text


def test_join_run_takes_ports_and_the_auth_service_shows_its_variable() -> None:
    join = help_of("join-run")
    assert "--port" in join and "--dht-port" in join and "--public-host" in join
    assert "[env var: HF_ENDPOINT]" in help_of("auth-service")


JOIN_AS_WORKER = ["join-run", "--server", "127.0.0.1:1", "--run-id", "r", "--role", "worker", "--initial-peer",
                  "/ip4/127.0.0.1/tcp/1"]


@pytest.mark.parametrize(("command", "named"), [
    ([*JOIN_AS_WORKER, "--host", "0.0.0.0"], "--host 0.0.0.0 listens on every interface but names none for "
                                             "trainers to reach: give --public-host"),
    (["worker", "--stage", "head", "--run-id", "r", "--host", "::"], "--host :: listens on every interface"),
    ([*JOIN_AS_WORKER, "--public-host", "my node"], "--public-host 'my node' is neither an IP address nor a DNS"),
    (["worker", "--stage", "head", "--run-id", "r", "--public-host", "0.0.0.0"], "names no single machine"),
    (["dht", "--public-host", "10.0.0.256"], "--public-host '10.0.0.256' is neither an IP address nor a DNS name"),
])
def test_an_address_peers_cannot_reach_is_one_line_naming_the_fix(command: list[str], named: str,
                                                                  tmp_path: Path) -> None:
    """A worker announced at 0.0.0.0 is unreachable from any other machine: refused before anything starts."""
    keypair = [] if command[0] == "dht" else ["-k", str(tmp_path / "id.json")]
    code, output = invoke(*command, *keypair)
    assert code == 2 and named in output, output
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["status", "--server", "127.0.0.1:1"], ["tick", "--server", "127.0.0.1:1"],
                                     ["close-run", "--server", "127.0.0.1:1"],
                                     ["join-run", "--server", "127.0.0.1:1", "--role", "trainer"],
                                     ["worker", "--stage", "head"], ["trainer"]])
def test_every_command_that_names_a_run_requires_run_id(command: list[str]) -> None:
    code, output = invoke(*command)
    assert code == 2 and "Missing option '--run-id'" in output, output


def test_validate_config_takes_config_like_serve_and_create_run(tmp_path: Path) -> None:
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML)
    assert invoke("validate-config", "--config", str(config)) == invoke("validate-config", str(config))
    code, output = invoke("validate-config", "--config", str(config))
    assert code == 0 and "config OK" in output, output
    code, output = invoke("validate-config")
    assert code == 2 and "--config" in output, output


@pytest.mark.parametrize("every", ["nan", "inf", "-inf", "1e-9", "0", "0s", "-1s", "soon"])
def test_tick_refuses_an_interval_that_is_not_one_and_names_every(every: str) -> None:
    code, output = invoke("tick", "--server", "127.0.0.1:1", "--run-id", "r", "--every", every)
    assert code == 2 and "--every" in output and repr(every) in output, output


def test_an_unreachable_cluster_says_why(tmp_path: Path) -> None:
    code, output = invoke("status", "--url", "http://127.0.0.1:9", "--run-id", "r")
    assert code == 1 and output.startswith("cannot read "), output
    reason = output.rsplit("http://127.0.0.1:9: ", 1)[1]
    assert reason.strip() and "connection" in reason.lower(), output


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """``psyswarm serve`` in its own process, permissionless; yields its HOST:PORT."""
    config, port = tmp_path / "state.toml", free_port()
    config.write_text(STATE_TOML)
    process = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db",
                                str(tmp_path / "run.sqlite"), "--port", str(port), "--permissionless"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_listening(port, process)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def test_status_only_reads_so_no_keypair_stops_it(server: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2, 3]")
    home = {"HOME": str(tmp_path), "PSYSWARM_KEYPAIR": str(tmp_path / "absent.json")}  # no keypair anywhere
    for extra in ((), ("--keypair", str(bad)), ("-k", str(tmp_path / "missing.json"))):
        code, output = invoke("status", "--server", server, "--run-id", RUN, *extra, env=home)
        assert code == 0 and f"run {RUN}: WaitingForMembers" in output, output


def test_a_server_of_another_run_is_named(server: str) -> None:
    code, output = invoke("status", "--server", server, "--run-id", "another")
    assert code == 1 and f"serves run {RUN!r}, not 'another': check --run-id" in output, output


def test_keygen_writes_where_o_says(tmp_path: Path) -> None:
    target = tmp_path / "worker2.json"
    code, output = invoke("keygen", "-o", str(target))
    assert code == 0 and target.exists() and str(target) in output, output
