"""The examples: the tiny-Llama setup runs end to end here with nothing downloaded, and its run config parses,
validates and names a model and data that fit each other; the ~1B config validates offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from client.cli import app
from client.data import TokenDataset, open_dataset
from coordinator_program.spec.config import Tokenizer, load_run_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _prepare_module():
    spec = importlib.util.spec_from_file_location("tiny_llama_prepare", EXAMPLES / "tiny-llama" / "prepare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _prepare_module().prepare(tmp_path_factory.mktemp("tiny"), vocab=1024, corpus_bytes=400_000)


def test_tiny_llama_config_names_what_prepare_wrote(tiny_llama: Path) -> None:
    spec = load_run_spec(tiny_llama)
    model = spec.model
    assert model.architecture == "llama" and model.tokenizer == Tokenizer.Model
    assert model.source == str(tiny_llama.parent / "model") and model.dataset == str(tiny_llama.parent / "tokens")
    dataset = open_dataset(model.dataset, model.seq_len, tokenizer_sha256=model.tokenizer_sha256,
                           dataset_sha256=model.dataset_sha256)  # prepare pins the dataset.json it wrote
    assert isinstance(dataset, TokenDataset) and dataset.vocab_size == 1024 and dataset.num_samples > 500
    result = CliRunner().invoke(app, ["validate-config", str(tiny_llama)])
    assert result.exit_code == 0 and "config OK" in result.output, result.output


def test_tiny_llama_model_reads_its_data(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    from client.models import model_spec_for

    spec = load_run_spec(tiny_llama)
    tokenizer = AutoTokenizer.from_pretrained(spec.model.source)
    assert tokenizer.eos_token == "</s>" and tokenizer.decode(tokenizer.encode("def f(x):")) == "def f(x):"
    model = model_spec_for(SimpleNamespace(model=spec.model, config=spec.config))
    stages = [model.build_stage(name) for name in model.stage_names()]
    batch = open_dataset(spec.model.dataset, spec.model.seq_len).batch([0, 1])
    hidden = batch[:, :-1]
    for stage in stages[:-1]:
        hidden = stage(hidden)
    loss = stages[-1](hidden, batch[:, 1:])
    assert torch.isfinite(loss) and 5.0 < float(loss.detach()) < 9.0  # about ln(1024) for a fresh model


def test_llama_1b_config_validates_offline() -> None:
    result = CliRunner().invoke(app, ["validate-config", "--offline", str(EXAMPLES / "llama-1b" / "state.toml")])
    assert result.exit_code == 0 and "config OK" in result.output, result.output
    assert "config_sha256 and tokenizer_sha256 not checked" in result.output
    assert "dataset hf:YOUR-ORG/fineweb-edu-10bt-tinyllama not checked" in result.output
    assert "offline: dataset_sha256 not checked; without --offline it is filled from hf:YOUR-ORG" in result.output


def test_offline_check_still_refuses_text_for_a_model_tokenizer(tmp_path: Path) -> None:
    text = (EXAMPLES / "llama-1b" / "state.toml").read_text()
    (tmp_path / "state.toml").write_text(text.replace('dataset = "hf:YOUR-ORG/fineweb-edu-10bt-tinyllama"',
                                                      'dataset = "stdlib"'))
    result = CliRunner().invoke(app, ["validate-config", "--offline", str(tmp_path / "state.toml")])
    assert result.exit_code == 1 and "stdlib is text read as bytes, but the model uses its own" in result.output
