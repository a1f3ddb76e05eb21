"""``psyswarm pause`` and ``psyswarm close-run``: only a run's main authority may halt it and close it, and only once
it is halted; on chain closing returns both accounts' rent and the run is gone. On the TCP server a run ends when the
server stops, and close-run says so, changing nothing. The real program in LiteSVM (``psyswarm localnet``) and the
real TCP server, driven by the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from solders.keypair import Keypair
from typer.testing import CliRunner

from client.cli import app
from client.identity import save_keypair
from tests.adversarial.test_admission_cli import RUN, STATE_TOML, free_port, wait_listening
from tests.solana.conftest import Localnet, localnet, new_run_id  # noqa: F401 - the fixture
from tests.solana.test_cli import STATE_TOML as CHAIN_TOML


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def test_only_the_authority_closes_a_halted_run_on_chain_and_gets_the_rent(localnet: Localnet,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    authority, stranger = localnet.funded_keypairs(2)
    key = str(save_keypair(authority, tmp_path / "authority.json"))
    other = str(save_keypair(stranger, tmp_path / "stranger.json"))
    run_id = new_run_id()
    config = tmp_path / "state.toml"
    config.write_text(CHAIN_TOML.format(run_id=run_id))
    target = ("-u", localnet.url, "--run-id", run_id)
    code, output = invoke("create-run", *target, "-k", key, "--config", str(config), "--permissionless")
    assert code == 0, output

    code, output = invoke("close-run", *target, "-k", key)
    assert code == 1 and f"cannot close run {run_id!r}: the run must be paused" in output, output
    code, output = invoke("pause", *target, "-k", other)
    assert code == 1 and f"cannot pause run {run_id!r}: the signer lacks the authority" in output, output
    code, output = invoke("pause", *target, "-k", key)
    assert code == 0 and "pause requested" in output, output
    code, output = invoke("tick", *target, "-k", key)
    assert code == 0 and "ticked: WaitingForMembers -> Paused" in output, output
    code, output = invoke("close-run", *target, "-k", other)
    assert code == 1 and f"cannot close run {run_id!r}: the signer lacks the authority" in output, output
    code, output = invoke("status", *target)
    assert code == 0 and "Paused" in output, output

    balance = localnet.rpc("getBalance", [str(authority.pubkey())])["result"]["value"]
    code, output = invoke("close-run", *target, "-k", key)
    assert code == 0 and f"closed run {run_id!r} (it was Paused)" in output, output
    assert localnet.rpc("getBalance", [str(authority.pubkey())])["result"]["value"] > balance  # the rent came back
    code, output = invoke("status", *target)
    assert code == 1 and "does not exist" in output, output


def test_the_tcp_server_ends_a_run_by_stopping_and_close_run_says_so(tmp_path: Path) -> None:
    config, db, port = tmp_path / "state.toml", tmp_path / "run.sqlite", free_port()
    config.write_text(STATE_TOML)
    server = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db", str(db),
                               "--port", str(port), "--permissionless"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    target = ("--server", f"127.0.0.1:{port}", "--run-id", RUN)
    try:
        wait_listening(port, server)
        authority = str(db.with_suffix(".authority.json"))  # `serve` made it: the run's main authority
        stranger = str(save_keypair(Keypair(), tmp_path / "stranger.json"))
        code, output = invoke("pause", *target, "-k", stranger)
        assert code == 1 and "only the run's main authority may pause" in output, output
        code, output = invoke("pause", *target, "-k", authority)
        assert code == 0 and "pause requested" in output, output
        code, output = invoke("tick", *target)
        assert code == 0 and "Paused" in output, output  # the server may have ticked it first: either way, Paused
        code, output = invoke("close-run", *target, "-k", authority)
        assert code == 1 and f"cannot close run {RUN!r}" in output and "stop the server" in output, output
        code, output = invoke("status", *target)
        assert code == 0 and f"run {RUN}: Paused" in output, output  # nothing changed
    finally:
        server.terminate()
        server.wait(30)
