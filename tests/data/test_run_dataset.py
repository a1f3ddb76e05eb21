"""The runner opens the run's ``Model.dataset`` by what it names (a token directory is token files, not text),
refuses data tokenized otherwise than the model, and ``validate-config`` refuses such a run before it starts."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import typer
from solders.keypair import Keypair
from typer.testing import CliRunner

from client.cli import app
from client.contributor.context import RunnerOptions
from client.contributor.errors import CannotContribute
from client.contributor.runner import Contributor
from client.contributor.trainer import TrainerRole
from client.data import ByteDataset, TokenDataset
from client.data.sidecar import SIDECAR_NAME
from coordinator_program.spec import limits
from coordinator_program.spec.state import Role
from tests.data.conftest import TOKENIZER_DIGEST, write_token_dir
from tests.witness.rounds import run_with_keys

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "state.toml"


def trainer_for(dataset: str, dht, pinned: bytes | None = None) -> TrainerRole:
    """A trainer's warmup in a run of ``dataset``, pinned as create-run pins it unless ``pinned`` says otherwise."""
    state, _ = run_with_keys()
    if pinned is None:
        pinned = hashlib.sha256((Path(dataset) / SIDECAR_NAME).read_bytes()).digest()
    state.model = dataclasses.replace(state.model, dataset=dataset, dataset_sha256=pinned)
    contributor = Contributor(None, Keypair(), RunnerOptions(role=Role.Trainer, initial_peers=[]))  # type: ignore[arg-type]
    contributor.context.dht = dht
    assert isinstance(contributor.role, TrainerRole)
    contributor.role.prepare(state, limits.NO_STAGE)
    return contributor.role


def test_trainer_reads_a_token_directory_as_tokens(tmp_path: Path, dht) -> None:
    text = bytes(range(256)) * 40
    write_token_dir(tmp_path / "bytes", np.frombuffer(text, dtype=np.uint8), shard_tokens=3000, vocab_size=256,
                    tokenizer_sha256="0" * 64, name="bytes")
    trainer = trainer_for(str(tmp_path / "bytes"), dht)
    dataset = trainer.trainer.dataset  # type: ignore[union-attr]
    assert isinstance(dataset, TokenDataset)
    assert dataset.sample(3).tolist() == ByteDataset(text, dataset.seq_len, name="same").sample(3).tolist()


def test_trainer_refuses_data_of_another_tokenizer(tmp_path: Path, dht) -> None:
    write_token_dir(tmp_path / "bpe", np.arange(5000, dtype=np.uint16) % 1000, shard_tokens=5000)
    with pytest.raises(CannotContribute, match="the run's dataset does not fit its model: dataset .* was tokenized "
                                               "with 'test-bpe'"):
        trainer_for(str(tmp_path / "bpe"), dht)


def _config_with_dataset(tmp_path: Path, dataset: str) -> Path:
    text = EXAMPLE.read_text().replace('dataset = "stdlib"', f'dataset = "{dataset}"')
    assert f'dataset = "{dataset}"' in text
    (tmp_path / "state.toml").write_text(text)
    return tmp_path / "state.toml"


def test_validate_config_refuses_a_dataset_of_another_tokenizer(tmp_path: Path) -> None:
    write_token_dir(tmp_path / "bpe", np.arange(5000, dtype=np.uint16) % 1000, shard_tokens=5000,
                    tokenizer_sha256=TOKENIZER_DIGEST)
    result = CliRunner().invoke(app, ["validate-config", str(_config_with_dataset(tmp_path, str(tmp_path / "bpe")))])
    assert result.exit_code == 1
    assert "invalid config: dataset: dataset" in result.output and "tokenized with 'test-bpe'" in result.output


def test_validate_config_accepts_matching_data_and_notes_unreachable_data(tmp_path: Path) -> None:
    write_token_dir(tmp_path / "bytes", np.arange(5000, dtype=np.uint16) % 256, shard_tokens=5000, vocab_size=256,
                    tokenizer_sha256="0" * 64, name="bytes")
    result = CliRunner().invoke(app, ["validate-config", str(_config_with_dataset(tmp_path, str(tmp_path / "bytes")))])
    assert result.exit_code == 0 and "config OK" in result.output, result.output
    unreachable = _config_with_dataset(tmp_path, "http://127.0.0.1:9/d")
    offline = CliRunner().invoke(app, ["validate-config", str(unreachable)])
    assert offline.exit_code == 1  # a remote dataset must be pinned, and this machine cannot read it to pin it
    assert "cannot pin its dataset.json from here: give dataset_sha256 in [model]" in offline.output
    unreachable.write_text(unreachable.read_text().replace("[model]\n", f'[model]\ndataset_sha256 = "{"ab" * 32}"\n'))
    offline = CliRunner().invoke(app, ["validate-config", str(unreachable)])
    assert offline.exit_code == 0 and "dataset tokenizer not checked: cannot download" in offline.output
    assert "dataset_sha256 not checked: cannot download" in offline.output


@pytest.mark.parametrize("make", [lambda d: d / "missing", lambda d: (d / "empty").mkdir() or d / "empty"])
def test_a_local_dataset_that_cannot_be_read_is_refused_by_validate_config_and_named_by_serve(tmp_path: Path,
                                                                                             make) -> None:
    """Before: `config OK`, not a word from serve, and the run found out at warmup, after every worker joined. The
    coordinator's machine need not hold the data (its trainers' do), so serve says so in one line and serves."""
    location = make(tmp_path)
    config = _config_with_dataset(tmp_path, str(location))
    result = CliRunner().invoke(app, ["validate-config", str(config)])
    assert result.exit_code == 1 and "config OK" not in result.output, result.output
    assert f"invalid config: dataset: {location} " in result.output
    from client.commands.config import check_dataset_or_exit, load_spec_or_exit

    spec = load_spec_or_exit(config, offline=True)
    with pytest.raises(typer.Exit):
        check_dataset_or_exit(spec.model)
    check_dataset_or_exit(spec.model, here=False)  # serve's check: named, not refused


def test_a_hub_dataset_that_does_not_exist_is_refused_by_validate_config_and_named_by_serve(tmp_path: Path,
                                                                                           fake_hub) -> None:
    """Before: a missing Hub dataset was 'not checked' like an unreachable one, `config OK`, and the run found out at
    warmup. The Hub's own answer (no such repo, revision or file) refuses it; a host that does not answer is still
    only noted (the test above)."""
    import subprocess
    import sys

    from client.data import DatasetMissing, check_dataset_tokenizer

    with pytest.raises(DatasetMissing, match="hf:nobody/nothing has no"):
        check_dataset_tokenizer("hf:nobody/nothing", bytes(32), hf_endpoint=fake_hub.url)
    config = _config_with_dataset(tmp_path, "hf:nobody/nothing")
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HF_HUB_OFFLINE": "0"}
    result = subprocess.run([sys.executable, "-m", "client.cli", "validate-config", str(config)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "config OK" not in result.stdout, result.stdout + result.stderr
    assert "invalid config: dataset: hf:nobody/nothing has no" in result.stderr
    assert "Traceback" not in result.stderr


def test_create_run_pins_a_token_datasets_sidecar_and_a_trainer_refuses_another(tmp_path: Path, dht) -> None:
    """The operator leaves dataset_sha256 out: the CLI fills it from dataset.json (as it fills a model's digests);
    a file naming another digest is refused; a trainer whose dataset.json is not the pinned one refuses to train
    on it, naming both digests. Before: nothing pinned the sidecar, and a host could swap or inflate it."""
    from client.commands.config import load_spec_or_exit

    write_token_dir(tmp_path / "bytes", np.arange(5000, dtype=np.uint16) % 256, shard_tokens=5000, vocab_size=256,
                    tokenizer_sha256="0" * 64, name="bytes")
    raw = (tmp_path / "bytes" / SIDECAR_NAME).read_bytes()
    config = _config_with_dataset(tmp_path, str(tmp_path / "bytes"))
    assert load_spec_or_exit(config).model.dataset_sha256 == hashlib.sha256(raw).digest()
    config.write_text(config.read_text().replace("[model]\n", f'[model]\ndataset_sha256 = "{"cd" * 32}"\n'))
    result = CliRunner().invoke(app, ["validate-config", str(config)])
    assert result.exit_code == 1 and "config OK" not in result.output
    assert f"dataset.json has sha256 {hashlib.sha256(raw).hexdigest()}, the run names {'cd' * 32}" in result.output
    with pytest.raises(CannotContribute, match=f"dataset.json has sha256 {hashlib.sha256(raw).hexdigest()}, but "
                                               f"the run pins {'cd' * 32}"):
        trainer_for(str(tmp_path / "bytes"), dht, pinned=bytes.fromhex("cd" * 32))
