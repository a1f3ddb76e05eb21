"""``psyswarm demo --model tiny-llama``: the example's tiny Llama, prepared once in the work directory and kept
there, trained by the whole local swarm (real server, DHT, workers and trainer processes) until its loss drops,
with safetensors stage checkpoints. An unknown ``--model`` is one line naming the option and the choices."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from client.cli import app
from client.swarm.demo import DEMO_MARKER, TINY_LLAMA_CACHE, claim_workdir, run_demo
from client.swarm.tiny_llama import PREPARED_FILE, TinyLlama, cached, state_toml
from coordinator_program.spec.config import Schedule, parse_run_spec

SMALL = {"vocab": 512, "corpus_bytes": 50_000}  # 8 files; 100 kB takes 13


def test_an_unknown_model_is_one_line_naming_model_and_the_choices(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--workdir", str(workdir), "--model", "nope"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert all(word in errors[0] for word in ("'--model'", "'nope'", "'psyswarm'", "'tiny-llama'")), errors
    with pytest.raises(ValueError, match="model must be one of psyswarm, tiny-llama, not 'nope'"):
        run_demo(workdir, 1, 1, 1.0, model="nope")
    assert not workdir.exists()  # refused before anything was written


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TinyLlama]:
    directory = tmp_path_factory.mktemp("cache") / TINY_LLAMA_CACHE
    return directory, cached(directory, progress=lambda line: None, **SMALL)


def test_the_prepared_tiny_llama_is_reused_with_the_same_choices(prepared: tuple[Path, TinyLlama]) -> None:
    directory, first = prepared
    tokenizer = first.model_dir / "tokenizer.json"
    made = tokenizer.stat().st_mtime_ns
    lines: list[str] = []
    again = cached(directory, progress=lines.append, **SMALL)
    assert again == first and tokenizer.stat().st_mtime_ns == made
    assert lines == [f"tiny Llama already prepared in {directory}: {first.tokens:,} tokens, vocabulary 512"]


def test_another_choice_or_an_unfinished_preparation_is_made_again(tmp_path: Path) -> None:
    directory = tmp_path / TINY_LLAMA_CACHE
    small = cached(directory, progress=lambda line: None, **SMALL)
    larger = cached(directory, progress=lambda line: None, vocab=512, corpus_bytes=100_000)
    assert larger.tokens > small.tokens
    (directory / PREPARED_FILE).unlink()  # as a preparation interrupted before it finished
    lines: list[str] = []
    remade = cached(directory, progress=lines.append, vocab=512, corpus_bytes=100_000)
    assert remade == larger and any(line.startswith("tokenizer: training") for line in lines), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == [TINY_LLAMA_CACHE]  # no staging directory left behind


@pytest.mark.parametrize("epochs, rounds", [(1, 2), (3, 8)])
def test_the_demo_run_of_the_tiny_llama_validates(prepared: tuple[Path, TinyLlama], epochs: int,
                                                  rounds: int) -> None:
    _, model = prepared
    spec = parse_run_spec(tomllib.loads(state_toml(model, run_id="demo-tiny-llama", rounds_per_epoch=rounds,
                                                   total_steps=epochs * rounds)))
    assert spec.config.total_steps == epochs * rounds and spec.config.rounds_per_epoch == rounds
    assert spec.model.architecture == "llama" and spec.model.source == str(model.model_dir)
    assert spec.model.lr_schedule == Schedule.WarmupCosine and spec.model.warmup_steps == epochs * rounds // 10


def test_clearing_the_workdir_keeps_the_prepared_tiny_llama_but_never_follows_a_link(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    claim_workdir(workdir)
    (workdir / TINY_LLAMA_CACHE / "model").mkdir(parents=True)
    (workdir / TINY_LLAMA_CACHE / "model" / "tokenizer.json").write_text("{}")
    (workdir / "logs").mkdir()
    claim_workdir(workdir)
    assert sorted(p.name for p in workdir.iterdir()) == sorted([DEMO_MARKER, TINY_LLAMA_CACHE])
    assert (workdir / TINY_LLAMA_CACHE / "model" / "tokenizer.json").read_text() == "{}"
    outside = tmp_path / "outside"
    (workdir / TINY_LLAMA_CACHE).rename(outside)
    (workdir / TINY_LLAMA_CACHE).symlink_to(outside, target_is_directory=True)
    claim_workdir(workdir)
    assert [p.name for p in workdir.iterdir()] == [DEMO_MARKER]  # the link is removed, not kept as the cache
    assert (outside / "model" / "tokenizer.json").read_text() == "{}"


@pytest.mark.slow
def test_the_demo_trains_the_tiny_llama_until_its_loss_drops(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    workdir = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "client.cli", "demo", "--model", "tiny-llama", "--workdir",
                           str(workdir), "--epochs", "2", "--rounds", "4", "--timeout", "400"],
                          capture_output=True, text=True, timeout=540)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for step in ("tokenizer: training a 2048-token byte-level BPE", "tiny Llama prepared in", "clients started"):
        assert step in output, (step, output[-4000:])
    first, last = map(float, re.search(r"trained epochs 0-1 \(2 of 2\), 8 rounds, loss ([\d.]+) -> ([\d.]+)",
                                       output).groups())  # type: ignore[union-attr]
    assert 6.5 < first < 8.5 and last < first - 0.3, output[-2000:]  # from about ln(2048) = 7.6
    run = tomllib.loads((workdir / "state.toml").read_text())
    assert run["model"]["architecture"] == "llama" and run["model"]["source"] == str(workdir / TINY_LLAMA_CACHE
                                                                                      / "model")
    last_epoch = workdir / "checkpoints" / "demo-tiny-llama" / "epoch-1"
    assert sorted(p.name for p in last_epoch.iterdir() if not p.name.endswith((".json", ".optim.pt"))) == [
        "body1.safetensors", "head.safetensors", "tail.safetensors"]
    assert "model.embed_tokens.weight" in load_file(last_epoch / "head.safetensors")
    assert "lm_head.weight" in load_file(last_epoch / "tail.safetensors")
