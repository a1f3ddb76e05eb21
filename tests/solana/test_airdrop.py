"""``psyswarm airdrop``: a contributor's transaction fees on a chain that gives SOL away."""

from __future__ import annotations

from pathlib import Path

from solders.keypair import Keypair
from typer.testing import CliRunner

from client.cli import app
from client.identity import save_keypair
from tests.solana.conftest import Localnet


def test_an_unfunded_contributor_gets_its_fees(localnet: Localnet, tmp_path: Path) -> None:
    key = tmp_path / "id.json"
    save_keypair(keypair := Keypair(), key)
    result = CliRunner().invoke(app, ["airdrop", "-u", localnet.url, "-k", str(key), "--sol", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"{keypair.pubkey()} holds 2.0000 SOL on {localnet.url}"
    assert localnet.rpc("getBalance", [str(keypair.pubkey())])["result"]["value"] == 2 * 10**9


def test_a_cluster_that_cannot_be_reached_is_one_line(tmp_path: Path) -> None:
    key = tmp_path / "id.json"
    save_keypair(Keypair(), key)
    result = CliRunner().invoke(app, ["airdrop", "--url", "http://127.0.0.1:9", "--keypair", str(key)])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("airdrop to ") and "failed" in lines[0], result.output
    assert "Traceback" not in result.output


def test_a_bad_url_names_the_option(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["airdrop", "--url", "ftp://nowhere", "--keypair", str(tmp_path / "k")])
    assert result.exit_code == 2 and "--url must be an http(s) RPC URL" in result.output
