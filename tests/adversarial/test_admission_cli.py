"""Who may join a run is its creator's explicit choice: ``serve`` and ``create-run`` refuse to start without
``--join-authority`` or ``--permissionless``, or with both; a permissioned run shows its join authority in
``status`` and keeps it across restarts; and a contributor that could never be admitted is told why before it
tries. Real CLI processes and the real server, on loopback."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from solders.keypair import Keypair
from typer.testing import CliRunner

from client.cli import app
from client.identity import save_keypair
from tests.join.test_auth import RUN, serving

STATE_TOML = f"""
run_id = "{RUN}"
[config]
min_clients = 4
max_clients = 8
warmup_time = 600
[model]
n_layers = 3
d_model = 16
n_heads = 2
seq_len = 8
"""
PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupGMN"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the server did not start: {server.stdout.read() if server.stdout else ''}")


@pytest.mark.parametrize("command", ["serve", "create-run"])
@pytest.mark.parametrize("flags, says", [
    ((), "say who may join the run"),
    (("--join-authority", str(Keypair().pubkey()), "--permissionless"), "not both"),
], ids=["neither", "both"])
def test_a_run_is_created_only_when_its_creator_says_who_may_join(command: str, flags: tuple[str, ...], says: str,
                                                                  tmp_path: Path) -> None:
    config, db = tmp_path / "state.toml", tmp_path / "run.sqlite"
    config.write_text(STATE_TOML)
    target = {"serve": ("--db", str(db), "--port", str(free_port())),
              "create-run": ("--url", "http://127.0.0.1:1", "--keypair",
                             str(save_keypair(Keypair(), tmp_path / "id.json")))}[command]
    result = cli(command, "--config", str(config), *target, *flags, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "--join-authority" in lines[0] and "--permissionless" in lines[0] and says in lines[0], lines
    assert not db.exists()


def test_the_join_authority_must_be_a_key(tmp_path: Path) -> None:
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML)
    for value, says in (("not-a-key", "not a public key"), ("1" * 32, "all-zero key means no join authority")):
        result = cli("serve", "--config", str(config), "--db", str(tmp_path / "run.sqlite"), "--join-authority",
                     value, cwd=tmp_path)
        assert result.returncode == 2 and says in re.sub(r"\s*│\s*", " ", result.stderr), result.stderr


@pytest.mark.slow
def test_a_permissioned_run_shows_and_keeps_its_join_authority(fake_hub, tmp_path: Path) -> None:
    config, db, port = tmp_path / "state.toml", tmp_path / "run.sqlite", free_port()
    config.write_text(STATE_TOML)
    authority = Keypair()
    key_file = save_keypair(authority, tmp_path / "auth-service.json")
    serve = ("serve", "--config", str(config), "--db", str(db), "--port", str(port))
    server = subprocess.Popen([sys.executable, "-m", "client.cli", *serve, "--join-authority", str(key_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_listening(port, server)
        status = CliRunner().invoke(app, ["status", "--server", f"127.0.0.1:{port}", "--run-id", RUN])
        assert f"admission: permissioned by {authority.pubkey()}" in status.output, status.output

        joiner = str(save_keypair(Keypair(), tmp_path / "joiner.json"))
        join = ("join-run", "--server", f"127.0.0.1:{port}", "--run-id", RUN, "--role", "trainer", "--keypair",
                joiner, "--initial-peer", PEER)
        result = cli(*join, cwd=tmp_path)
        assert result.returncode == 1, result.stderr[-2000:]
        assert f"permissioned by {authority.pubkey()}: join through its auth service with --auth-url" in result.stderr
        with serving(fake_hub) as other:  # an auth service, but not this run's join authority
            result = cli(*join, "--auth-url", other.url, "--hf-token", "tok-alice", "--hf-endpoint", fake_hub.url,
                         cwd=tmp_path)
        assert result.returncode == 1 and "is not this run's join authority" in result.stderr, result.stderr[-2000:]
    finally:
        server.terminate()
        server.wait(30)
    restarted = cli(*serve, "--permissionless", cwd=tmp_path)
    assert restarted.returncode == 1, restarted.stderr
    assert f"permissioned by {authority.pubkey()}, not permissionless" in restarted.stderr, restarted.stderr


@pytest.mark.slow
def test_an_auth_service_told_of_the_wrong_coordinator_refuses_to_start(fake_hub, tmp_path: Path) -> None:
    """The operator points ``auth-service`` at a coordinator whose join authority is another key, or that serves
    another run: its releases would be refused forever (and ended slots never freed), so it stops at startup with
    one line saying what is wrong and how to fix it. With the run's key it starts; with no coordinator up yet (a
    new run starts its service first) it starts too."""
    config, port = tmp_path / "state.toml", free_port()
    config.write_text(STATE_TOML)
    authority = Keypair()
    key_file = save_keypair(authority, tmp_path / "auth-service.json")
    server = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db",
                               str(tmp_path / "run.sqlite"), "--port", str(port), "--join-authority", str(key_file)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)

    databases = iter(range(10))

    def auth_service(run_id: str, *flags: str, coordinator: int = port) -> list[str]:
        return ["auth-service", "--run-id", run_id, "--stages", "3", "--capacity", "4", "--db",
                str(tmp_path / f"auth-{next(databases)}.sqlite"), "--server", f"127.0.0.1:{coordinator}",
                "--hf-endpoint", fake_hub.url, *flags]

    try:
        wait_listening(port, server)
        wrong_key = cli(*auth_service(RUN), cwd=tmp_path)
        lines = wrong_key.stderr.strip().splitlines()
        assert wrong_key.returncode == 1 and len(lines) == 1, wrong_key.stderr
        assert f"has join authority {authority.pubkey()}, not this service's key" in lines[0]
        assert "--join-authority" in lines[0] and "Traceback" not in wrong_key.stderr
        wrong_run = cli(*auth_service("other", "--keypair", str(key_file)), cwd=tmp_path)
        assert wrong_run.returncode == 1 and "serves run 'run-1', not 'other'" in wrong_run.stderr, wrong_run.stderr
        for coordinator in (port, free_port()):  # the run's coordinator, and none listening yet
            right = subprocess.Popen([sys.executable, "-m", "client.cli",
                                      *auth_service(RUN, "--keypair", str(key_file), coordinator=coordinator)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            try:
                assert right.stdout is not None and "listening on" in right.stdout.readline(), right.stderr.read()
                assert right.poll() is None
            finally:
                right.terminate()
                right.wait(30)
    finally:
        server.terminate()
        server.wait(30)
