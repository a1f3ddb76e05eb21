"""``psyswarm export``: a run's stage checkpoints become a Hugging Face model directory that ``transformers`` loads
and generates with, computing what the pipeline computed; a checkpoint that is not the run's model is refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from typer.testing import CliRunner

from client.cli import app
from client.join.checkpoints import named_optimizer_state, revision_for, save_stage, stage_files, upload_stage
from client.models import HFModelSpec, config_digest, tokenizer_digest
from client.models.export import ExportError, ModelCard, export_model
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.trainer import PipelineTrainer
from tests.fake_hub import FakeHub
from tests.models.conftest import SEQ_LEN, VOCAB, SyntheticTokens, merged_state, tiny_config, wait_until

LOGITS_ATOL = 1e-4
"""The exported model and the pipeline's stages compute the same float32 function with the same kernels; only the
order of floating-point operations may differ (the whole model runs its layers in one module, the stages apart)."""
STEPS = 3
MICROBATCH = 4
STEP_SAMPLES = 8


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A model source directory: a tiny Llama's config.json (tied embeddings) and a tokenizer trained here on
    a little text, with at most VOCAB tokens."""
    directory = tmp_path_factory.mktemp("source")
    (directory / "config.json").write_text(json.dumps(tiny_config("llama", tie_word_embeddings=True)))
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    text = [line for line in Path(json.__file__).read_text().splitlines() if line.strip()]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "</s>"]))
    assert tokenizer.get_vocab_size() <= VOCAB
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>").save_pretrained(directory)
    return directory


def spec_of(source: Path) -> HFModelSpec:
    return HFModelSpec(json.loads((source / "config.json").read_text()), num_stages=3, seq_len=SEQ_LEN, seed=5)


def state_toml(path: Path, run_id: str, source: Path) -> Path:
    """The run's state.toml: the tiny Llama from ``source`` with its own tokenizer, pinned by digest."""
    config = json.loads((source / "config.json").read_text())
    text = Path("examples/state.toml").read_text().replace('run_id = "demo"', f'run_id = "{run_id}"')
    text = text.replace("[model]\n", f"""[model]
architecture = "llama"
source = "{source}"
config_sha256 = "{config_digest(config).hex()}"
tokenizer = "model"
tokenizer_sha256 = "{tokenizer_digest(source).hex()}"
""").replace("seq_len = 128", f"seq_len = {SEQ_LEN}")
    path.write_text(text)
    return path


def export_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["export", *args])
    return result.exit_code, result.output


def pipeline_logits(stages: list, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Logits and loss of the stage modules run in turn as the pipeline runs them: the tail's LM head output is
    caught on its way to the loss."""
    caught: list[torch.Tensor] = []
    tail = stages[-1]
    hook = getattr(tail, tail.output_name).register_forward_hook(lambda _m, _i, out: caught.append(out))
    with torch.no_grad():
        hidden = ids[:, :-1]
        for stage in stages[:-1]:
            hidden = stage(hidden)
        loss = float(tail(hidden, ids[:, 1:]))
    hook.remove()
    return caught[0], loss


def test_a_model_trained_through_the_pipeline_exports_loads_and_computes_the_same(
        source: Path, start_worker, dht, run_id: str, tmp_path: Path) -> None:
    spec = spec_of(source)
    workers = [start_worker(stage, config=spec, auto_step_samples=STEP_SAMPLES) for stage in spec.stage_names()]
    directory = WorkerDirectory(dht, run_id, spec.fingerprint())
    for stage in spec.stage_names():
        wait_until(lambda s=stage: directory.workers(s), what=f"a worker of {stage}")
    trainer = PipelineTrainer(spec, SyntheticTokens(), directory, run_id=run_id, refresh_period=0.5,
                              stall_timeout=30.0)
    try:
        trainer.train(range(STEPS * STEP_SAMPLES), microbatch_size=MICROBATCH)
    finally:
        trainer.close()
    assert all(worker.compute.steps == STEPS for worker in workers)
    checkpoint = tmp_path / "checkpoints" / run_id / revision_for(1)
    for worker in workers:
        module = worker.compute.module
        save_stage(checkpoint, worker.stage, module.state_dict(), STEPS,
                   named_optimizer_state(module, worker.compute.optimizer.optimizer))

    output = tmp_path / "exported"
    code, out = export_cli("--run-id", run_id, "--config", str(state_toml(tmp_path / "state.toml", run_id, source)),
                           "--checkpoint", str(checkpoint), "--output", str(output))
    assert code == 0, out
    assert f"exported {run_id} (epoch 1, step {STEPS})" in out
    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    ids = SyntheticTokens().batch(range(100, 102))
    expected, pipeline_loss = pipeline_logits([w.compute.module for w in workers], ids)
    with torch.no_grad():
        got = model(ids[:, :-1], labels=ids[:, :-1])
    assert torch.allclose(got.logits, expected, atol=LOGITS_ATOL, rtol=0), (got.logits - expected).abs().max()
    shifted = torch.nn.functional.cross_entropy(got.logits.flatten(0, 1), ids[:, 1:].flatten())
    assert abs(float(shifted) - pipeline_loss) < 1e-4

    # The tail's LM head trained apart from the head's embeddings: the export is untied and keeps both.
    assert model.config.tie_word_embeddings is False
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    tokenizer = AutoTokenizer.from_pretrained(output)
    prompt = tokenizer("import json", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert generated.shape == (1, prompt.shape[1] + 4)
    with torch.no_grad():
        assert int(generated[0, prompt.shape[1]]) == int(model(prompt).logits[0, -1].argmax())
    assert isinstance(tokenizer.decode(generated[0]), str)
    card = (output / "README.md").read_text()
    assert all(f"{what}" in card for what in (run_id, "epoch: 1", f"step: {STEPS}", "| head |", "| tail |"))


def fresh_checkpoint(spec: HFModelSpec, directory: Path, step: int = 0) -> dict[str, Path]:
    """The run's seed saved as an epoch checkpoint: every stage's files, as workers write them."""
    files = {}
    for stage in spec.stage_names():
        files[stage] = save_stage(directory, stage, spec.build_stage(stage).state_dict(), step)[0]
    return files


def test_a_hub_checkpoint_exports_sharded_and_pushes_to_the_hub(source: Path, tmp_path: Path) -> None:
    spec = spec_of(source)
    hub = FakeHub().start()
    try:
        local = tmp_path / "saved"
        fresh_checkpoint(spec, local, step=6)
        for stage in spec.stage_names():
            upload_stage([local / name for name in stage_files(stage)[::2]], "org/run", revision_for(2), token="t",
                         endpoint=hub.url)
        output = tmp_path / "exported"
        code, out = export_cli(
            "--run-id", "tiny", "--config", str(state_toml(tmp_path / "state.toml", "tiny", source)),
            "--checkpoint", "hub:org/run@epoch-2", "--output", str(output), "--max-shard-mb", "1",
            "--push-to", "org/tiny-llama", "--hf-endpoint", hub.url, "--hf-token", "t")
        assert code == 0, out
        pushed = {name for (repo, revision, name) in hub.files if (repo, revision) == ("org/tiny-llama", "main")}
        assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= pushed
    finally:
        hub.shutdown()
    assert "epoch: 2" in (output / "README.md").read_text()

    sharded = tmp_path / "sharded"
    files = export_model(spec, {s: local / stage_files(s)[0] for s in spec.stage_names()}, source, sharded,
                         ModelCard("tiny", 2, 6, "local"), max_shard_bytes=40_000, progress=False)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((sharded / name) in files for name in shards)
    model = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32)
    merged = merged_state([spec.build_stage(stage) for stage in spec.stage_names()])
    # Untrained, the tail's LM head still equals the embeddings: left out and tied, as save_pretrained does.
    assert "lm_head.weight" not in index["weight_map"] and model.config.tie_word_embeddings
    assert all(torch.equal(value, merged[name]) for name, value in model.state_dict().items())


def broken(spec: HFModelSpec, files: dict[str, Path], stage: str, change) -> None:
    tensors = safetensors.torch.load_file(files[stage])
    change(tensors)
    safetensors.torch.save_file(tensors, files[stage])


@pytest.mark.parametrize(("stage", "change", "message"), [
    ("body1", lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32)}),
     "stages head and body1 both hold model.layers.0.mlp.up_proj.weight"),
    ("tail", lambda t: t.pop("lm_head.weight"), "no stage holds lm_head.weight"),
    ("tail", lambda t: t.update({"lm_head.weight": torch.zeros(VOCAB, 16)}), r"is F32 \[96, 16\], the model needs"),
    ("head", lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].double()}), "is F64"),
    ("body1", lambda t: t.update({"model.layers.9.extra": torch.zeros(2)}), "which the run's model does not have"),
    ("head", lambda t: t["model.embed_tokens.weight"].fill_(float("nan")), "holds non-finite values"),
])
def test_a_checkpoint_that_is_not_the_runs_model_is_refused_and_writes_no_model(
        source: Path, tmp_path: Path, stage: str, change, message: str) -> None:
    spec = spec_of(source)
    files = fresh_checkpoint(spec, tmp_path / "ckpt")
    broken(spec, files, stage, change)
    with pytest.raises(ExportError, match=message):
        export_model(spec, files, source, tmp_path / "out", ModelCard("r", 0, 0, "x"), progress=False)
    assert not (tmp_path / "out" / "config.json").exists()


def test_the_runs_model_is_read_from_its_coordinator(source: Path, tmp_path: Path) -> None:
    from coordinator_program.spec.config import load_run_spec
    from tests.local_backend.test_server import run_with_server

    spec = spec_of(source)
    checkpoint = tmp_path / "checkpoints" / "tiny" / revision_for(0)
    fresh_checkpoint(spec, checkpoint, step=0)
    run = load_run_spec(state_toml(tmp_path / "state.toml", "tiny", source))

    async def export(_server, address: str) -> None:
        code, out = await asyncio.to_thread(export_cli, "--run-id", "tiny", "--server", address, "--checkpoint",
                                            str(checkpoint), "--output", str(tmp_path / "out"))
        assert code == 0 and "exported tiny (epoch 0, step 0)" in out, out
        code, out = await asyncio.to_thread(export_cli, "--run-id", "other", "--server", address, "--checkpoint",
                                            str(checkpoint), "--output", str(tmp_path / "other"))
        assert code == 1 and "serves run 'tiny', not 'other'" in out, out

    run_with_server(tmp_path, export, spec=run)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert model.config.num_hidden_layers == spec.n_layers


def test_missing_stages_mixed_steps_and_the_byte_level_model_are_refused_in_one_line(source: Path,
                                                                                      tmp_path: Path) -> None:
    spec = spec_of(source)
    config = str(state_toml(tmp_path / "state.toml", "tiny", source))
    checkpoint = tmp_path / "ckpt"
    fresh_checkpoint(spec, checkpoint, step=4)
    (checkpoint / "body1.json").write_text(json.dumps({"step": 5}))
    code, out = export_cli("--run-id", "tiny", "--config", config, "--checkpoint", str(checkpoint),
                           "--output", str(tmp_path / "a"))
    assert code == 1 and "were saved at different steps" in out
    (checkpoint / "tail.safetensors").unlink()
    code, out = export_cli("--run-id", "tiny", "--config", config, "--checkpoint", str(checkpoint),
                           "--output", str(tmp_path / "b"))
    assert code == 1 and "holds no tail.safetensors: every stage is needed" in out
    code, out = export_cli("--run-id", "demo", "--config", "examples/state.toml", "--checkpoint", str(checkpoint),
                           "--output", str(tmp_path / "c"))
    assert code == 1 and "psyswarm's own byte-level model" in out
    assert not any((tmp_path / name).exists() for name in "abc")
