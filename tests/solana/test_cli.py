"""``create-run``, ``status`` and ``tick`` against ``psyswarm localnet``, and the ``--server``/``--url`` choice."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from solders.keypair import Keypair
from typer.testing import CliRunner

from client.backends.solana import SolanaBackend
from client.cli import app
from client.identity import save_keypair
from coordinator_program.spec.state import Role
from tests.solana.conftest import Localnet, new_run_id

STATE_TOML = """
run_id = "{run_id}"
[config]
min_clients = 4
max_clients = 8
num_stages = 3
witness_nodes = 2
witness_quorum = 2
warmup_time = 60
max_round_train_time = 30
round_witness_time = 1
cooldown_time = 1
rounds_per_epoch = 3
[model]
n_layers = 3
n_heads = 2
d_model = 16
seq_len = 8
"""


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, re.sub(r"\s*│\s*", " ", result.output)


def test_create_run_status_and_tick(localnet: Localnet, tmp_path: Path) -> None:
    authority = Keypair()
    key_file = str(save_keypair(authority, tmp_path / "authority.json"))
    asyncio.run(localnet.fund(authority))
    run_id = new_run_id()
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML.format(run_id=run_id))
    target = ("--url", localnet.url, "--run-id", run_id)

    create = ("create-run", *target, "--keypair", key_file, "--config", str(config), "--permissionless")
    code, output = invoke(*create)
    assert code == 0, output
    assert f"created run '{run_id}'" in output and "WaitingForMembers" in output
    code, output = invoke("status", *target)
    assert code == 0 and "WaitingForMembers" in output and "admission: permissionless" in output, output
    code, output = invoke("tick", *target, "--keypair", key_file)
    assert code == 0 and "nothing to tick: WaitingForMembers" in output, output

    async def join_four() -> None:
        keypairs = [Keypair() for _ in range(4)]
        await localnet.fund(*keypairs)
        for keypair, role in zip(keypairs, [Role.Worker] * 3 + [Role.Trainer], strict=True):
            member = SolanaBackend(localnet.url, keypair, run_id)
            await member.connect()
            await member.join(role)
            await member.close()

    asyncio.run(join_four())
    code, output = invoke("tick", *target, "--keypair", key_file)
    assert code == 0 and "ticked: WaitingForMembers -> Warmup" in output, output
    code, output = invoke("status", *target)
    assert code == 0 and "Warmup" in output, output
    code, output = invoke(*create)
    assert code == 1 and "already exists" in output, output


@pytest.mark.parametrize("args, code, message", [
    (["status", "--run-id", "r"], 2, "exactly one of --server"),
    (["tick", "--run-id", "r", "--server", "127.0.0.1:1", "--url", "localhost"], 2, "exactly one of --server"),
    (["status", "--url", "localhost"], 2, "Missing option '--run-id'"),
    (["status", "--server", "127.0.0.1:1"], 2, "Missing option '--run-id'"),
    (["status", "--url", "ftp://example.org", "--run-id", "r"], 1, "--url must be an http(s) RPC URL"),
    (["status", "--url", "localhost", "--run-id", "r", "--program-id", "zzz"], 2, "not a base58 public key"),
    (["join-run", "--run-id", "r", "--role", "trainer", "--initial-peer", "/ip4/127.0.0.1/tcp/1"], 2,
     "exactly one of --server"),
])
def test_choosing_the_backend(args: list[str], code: int, message: str, tmp_path: Path) -> None:
    if args[0] == "join-run":
        args = [*args, "--keypair", str(save_keypair(Keypair(), tmp_path / "id.json"))]
    exit_code, output = invoke(*args)
    assert exit_code == code and message in output, output


def test_unknown_run_and_bad_config(localnet: Localnet, tmp_path: Path) -> None:
    code, output = invoke("status", "--url", localnet.url, "--run-id", new_run_id())
    assert code == 1 and "does not exist" in output
    key_file = str(save_keypair(Keypair(), tmp_path / "id.json"))
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML.format(run_id="good") + "bogus_key = 1\n")
    create = ("create-run", "--url", localnet.url, "--keypair", key_file, "--config", str(config), "--permissionless")
    code, output = invoke(*create)
    assert code == 1 and "invalid config" in output, output
    config.write_text(STATE_TOML.format(run_id="good"))
    code, output = invoke(*create, "--run-id", "other")
    assert code == 2 and "differs from the config's run_id" in output, output
    code, output = invoke(*create)
    assert code == 1 and "no SOL" in output, output  # an unfunded authority cannot pay
