"""`pause`, `resume` and `close-run` name the key they need and where it is, against a real server: on TCP the run's
main authority is the keypair `serve` keeps beside its --db, and a new key from `keygen` would be refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.identity import save_keypair
from tests.local_backend.test_persistence import STATE_TOML, free_port, start_server


def psyswarm(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PSYSWARM_KEYPAIR"} | {"HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.mark.slow
def test_authority_commands_point_at_the_servers_authority_key(tmp_path: Path) -> None:
    config, db, port = tmp_path / "state.toml", tmp_path / "run.sqlite", free_port()
    config.write_text(STATE_TOML)
    server = start_server(config, db, port)
    target = ["--server", f"127.0.0.1:{port}", "--run-id", "persist"]
    try:
        missing = psyswarm("pause", *target, home=tmp_path)  # no -k: the default key does not exist
        assert missing.returncode == 1 and "run.authority.json" in missing.stderr, missing.stderr
        assert "keygen" not in missing.stderr and len(missing.stderr.strip().splitlines()) == 1

        stranger = save_keypair(Keypair(), tmp_path / "stranger.json")
        refused = psyswarm("pause", *target, "-k", str(stranger), home=tmp_path)
        assert refused.returncode == 1 and "main authority" in refused.stderr, refused.stderr
        assert "run.authority.json" in refused.stderr and "keygen" not in refused.stderr

        paused = psyswarm("pause", *target, "-k", str(tmp_path / "run.authority.json"), home=tmp_path)
        assert paused.returncode == 0 and "pause requested" in paused.stdout, paused.stderr
    finally:
        server.terminate()
        server.wait(10)
