"""Where a model comes from: a Hub repo (a stand-in on loopback), a local directory, or a config alone; the
digests a run names on chain; and sources that lie (another config, a shard path outside the repo)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save, save_file

from client.contributor.run_model import model_config
from client.data import tokenizer_sha256
from client.models import (
    HFModelSpec,
    ModelSourceError,
    WeightSource,
    config_digest,
    model_spec_for,
    resolve_model_digests,
)
from client.models.stages import UnsupportedModel
from client.pipeline.model import ModelConfig
from coordinator_program.spec.config import Config, Model, Tokenizer, parse_run_spec

from .conftest import tiny_config, whole_model

REPO = "psyswarm-test/tiny-llama"
TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}).encode()
SHARDS = {  # a sharded checkpoint: a body stage needs only the middle shard
    "model-00001-of-00003.safetensors": ("model.embed_tokens.", "model.layers.0.", "model.layers.1."),
    "model-00002-of-00003.safetensors": ("model.layers.2.", "model.layers.3."),
    "model-00003-of-00003.safetensors": ("model.layers.4.", "model.norm.", "lm_head."),
}


def trained_state(config: dict) -> dict[str, torch.Tensor]:
    """Weights unlike any fresh initialisation (so that loading them is visible)."""
    spec = HFModelSpec(config, num_stages=3, seq_len=16, seed=99)
    return {k: v + 0.5 for k, v in whole_model(spec).state_dict().items()}


def shard(state: dict[str, torch.Tensor]) -> tuple[dict[str, bytes], bytes]:
    weight_map = {k: name for name, prefixes in SHARDS.items() for k in state if k.startswith(prefixes)}
    files = {name: save({k: v for k, v in state.items() if weight_map[k] == name}) for name in SHARDS}
    return files, json.dumps({"metadata": {}, "weight_map": weight_map}).encode()


def run_state(source: str, config_sha256: bytes, **model: object) -> SimpleNamespace:
    return SimpleNamespace(model=Model(architecture="llama", source=source, config_sha256=config_sha256, seq_len=16,
                                       init_seed=5, **model), config=Config(num_stages=3))


@pytest.fixture
def hub_model(fake_hub) -> tuple[object, dict, dict[str, torch.Tensor]]:
    config = tiny_config("llama")
    state = trained_state(config)
    files, index = shard(state)
    fake_hub.publish(REPO, "config.json", json.dumps(config, indent=2).encode())
    fake_hub.publish(REPO, "tokenizer.json", TOKENIZER_JSON)
    fake_hub.publish(REPO, "model.safetensors.index.json", index)
    for name, content in files.items():
        fake_hub.publish(REPO, name, content)
    return fake_hub, config, state


def downloaded_shards(cache: Path) -> set[str]:
    return {p.name for p in cache.rglob("*.safetensors") if "snapshots" in p.parts}


def test_config_digest_is_canonical_json() -> None:
    config = tiny_config("llama")
    reformatted = json.loads(json.dumps(config, indent=4, sort_keys=False))
    assert config_digest(reformatted) == config_digest(config)
    assert config_digest(config) == hashlib.sha256(
        json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).digest()
    assert config_digest(config | {"rms_norm_eps": 1e-5}) != config_digest(config)


def test_a_worker_downloads_only_the_shards_of_its_stage(hub_model, tmp_path) -> None:
    hub, config, state = hub_model
    digest = config_digest(config)
    spec = model_spec_for(run_state(REPO, digest), endpoint=hub.url, cache_dir=tmp_path)
    assert spec.weights is not None and spec.config_sha256 == digest
    body = spec.build_stage("body1")
    assert downloaded_shards(tmp_path) == {"model-00002-of-00003.safetensors"}
    assert all(torch.equal(v, state[k]) for k, v in body.state_dict().items())
    tail = spec.build_stage("tail")
    assert all(torch.equal(v, state[k]) for k, v in tail.state_dict().items())
    assert downloaded_shards(tmp_path) == {"model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors"}


def test_a_config_whose_digest_differs_from_the_runs_is_refused(hub_model, tmp_path) -> None:
    """The Hub (or whoever controls the repo) serves a config the run did not name: no model is built."""
    hub, config, _ = hub_model
    pinned = config_digest(config | {"num_hidden_layers": 4})
    with pytest.raises(ModelSourceError, match="refusing to train another model"):
        model_spec_for(run_state(REPO, pinned), endpoint=hub.url, cache_dir=tmp_path)
    assert downloaded_shards(tmp_path) == set()


def test_a_tokenizer_changed_after_the_run_pinned_it_is_refused(hub_model, tmp_path) -> None:
    """Issue 21, attack 6: workers, trainers and ``export --server`` built the model checking config.json only, so
    a source whose tokenizer.json changed after the run pinned it went through."""
    hub, config, _ = hub_model
    pinned = hashlib.sha256(TOKENIZER_JSON).digest()
    state = run_state(REPO, config_digest(config), tokenizer=Tokenizer.Model, tokenizer_sha256=pinned)
    assert model_spec_for(state, endpoint=hub.url, cache_dir=tmp_path / "first").config_sha256 == config_digest(config)
    hub.publish(REPO, "tokenizer.json", TOKENIZER_JSON.replace(b'"a": 0', b'"b": 0'))
    with pytest.raises(ModelSourceError, match="tokenizer.json has sha256 .* refusing to use another tokenizer"):
        model_spec_for(state, endpoint=hub.url, cache_dir=tmp_path / "second")
    assert downloaded_shards(tmp_path / "second") == set()


def test_a_source_of_another_architecture_is_refused(hub_model, tmp_path) -> None:
    hub, config, _ = hub_model
    state = run_state(REPO, config_digest(config))
    state.model = Model(architecture="qwen2", source=REPO, config_sha256=config_digest(config), seq_len=16)
    with pytest.raises(ModelSourceError, match="model_type is 'llama', the run's architecture is 'qwen2'"):
        model_spec_for(state, endpoint=hub.url, cache_dir=tmp_path)


def test_an_index_naming_a_file_outside_its_directory_is_refused(tmp_path) -> None:
    config = tiny_config("llama")
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    save_file(trained_state(config), str(tmp_path / "outside.safetensors"))
    weight_map = dict.fromkeys(trained_state(config), "../outside.safetensors")
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    spec = model_spec_for(run_state(str(source), config_digest(config)))
    with pytest.raises(ModelSourceError, match="names '../outside.safetensors', not a .safetensors file beside it"):
        spec.build_stage("body1")


def test_weights_of_the_wrong_shape_are_refused(tmp_path) -> None:
    config = tiny_config("llama")
    state = trained_state(config)
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    spec = HFModelSpec(config, num_stages=3, seq_len=16, weights=WeightSource(str(tmp_path)))
    spec.build_stage("head")
    with pytest.raises(UnsupportedModel, match=r"model.layers.2.mlp.up_proj.weight has shape \[3, 3\]"):
        spec.build_stage("body1")


def test_weights_holding_nan_are_refused(tmp_path) -> None:
    config = tiny_config("llama")
    state = trained_state(config)
    state["model.norm.weight"][3] = float("nan")
    save_file(state, str(tmp_path / "model.safetensors"))
    spec = HFModelSpec(config, num_stages=3, seq_len=16, weights=WeightSource(str(tmp_path)))
    with pytest.raises(UnsupportedModel, match="model.norm.weight holds NaN or infinite values"):
        spec.build_stage("tail")


def test_a_local_directory_with_one_safetensors_file_and_tied_embeddings(tmp_path) -> None:
    """A checkpoint of a tied model leaves out ``lm_head.weight``: the tail reads the embedding in its place."""
    config = tiny_config("llama", tie_word_embeddings=True)
    state = trained_state(config)
    del state["lm_head.weight"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(state, str(tmp_path / "model.safetensors"))
    spec = model_spec_for(run_state(str(tmp_path), config_digest(config)))
    tail = spec.build_stage("tail").state_dict()
    assert torch.equal(tail["lm_head.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(tail["model.norm.weight"], state["model.norm.weight"])


def test_a_config_alone_means_the_runs_fresh_initialisation(tmp_path) -> None:
    config = tiny_config("llama")
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_spec_for(run_state(str(tmp_path), config_digest(config)))
    assert spec.weights is None
    fresh = HFModelSpec(config, num_stages=3, seq_len=16, seed=5).build_stage("body1").state_dict()
    assert all(torch.equal(v, fresh[k]) for k, v in spec.build_stage("body1").state_dict().items())


def test_resolve_fills_the_digests_and_refuses_a_pin_the_source_does_not_match(hub_model, tmp_path) -> None:
    hub, config, _ = hub_model
    model = Model(architecture="llama", source=REPO, tokenizer=Tokenizer.Model, seq_len=16)
    resolved = resolve_model_digests(model, endpoint=hub.url)
    assert resolved.config_sha256 == config_digest(config)
    assert resolved.tokenizer_sha256 == hashlib.sha256(TOKENIZER_JSON).digest()
    assert resolve_model_digests(resolved, endpoint=hub.url) == resolved  # a correct pin passes
    with pytest.raises(ModelSourceError, match="its config.json has sha256"):
        resolve_model_digests(Model(architecture="llama", source=REPO, config_sha256=b"\1" * 32), endpoint=hub.url)
    with pytest.raises(ModelSourceError, match="its tokenizer.json has sha256"):
        resolve_model_digests(Model(architecture="llama", source=REPO, tokenizer=Tokenizer.Model,
                                    tokenizer_sha256=b"\1" * 32), endpoint=hub.url)
    assert resolve_model_digests(Model()) == Model()  # the byte-level model has no source


def test_parse_run_spec_resolves_a_local_model(tmp_path) -> None:
    config = tiny_config("llama")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes(TOKENIZER_JSON)
    doc = {"run_id": "tiny", "model": {"architecture": "llama", "source": str(tmp_path), "tokenizer": "model",
                                       "seq_len": 16}}
    spec = parse_run_spec(doc, resolve_model=resolve_model_digests)
    assert spec.model.config_sha256 == config_digest(config)
    assert spec.model.tokenizer_sha256 == tokenizer_sha256(tmp_path)  # the data side names tokenizers the same way


def test_stage_replica_builds_the_model_the_run_names(tmp_path) -> None:
    config = tiny_config("llama")
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_config(run_state(str(tmp_path), config_digest(config)))
    assert isinstance(spec, HFModelSpec) and spec.num_stages == 3 and spec.seq_len == 16 and spec.seed == 5
    byte_model = model_config(SimpleNamespace(model=Model(), config=Config(num_stages=3)))
    assert isinstance(byte_model, ModelConfig) and byte_model == ModelConfig(num_stages=3)


def test_a_missing_source_is_a_clear_error(tmp_path, fake_hub) -> None:
    with pytest.raises(ModelSourceError, match="holds no config.json"):
        model_spec_for(run_state(str(tmp_path / "nowhere"), b"\1" * 32))
    with pytest.raises(ModelSourceError, match="holds no config.json"):
        model_spec_for(run_state("psyswarm-test/absent", b"\1" * 32), endpoint=fake_hub.url, cache_dir=tmp_path)


def test_validate_config_fills_the_digests_and_refuses_a_wrong_pin(tmp_path) -> None:
    from typer.testing import CliRunner

    from client.cli import app

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama")))
    toml = tmp_path / "state.toml"
    body = f'run_id = "tiny-llama"\n[config]\nnum_stages = 3\n[model]\narchitecture = "llama"\nsource = "{tmp_path}"\n'
    toml.write_text(body)
    ok = CliRunner().invoke(app, ["validate-config", str(toml)])
    assert ok.exit_code == 0, ok.output
    toml.write_text(body + f'config_sha256 = "{"01" * 32}"\n')
    refused = CliRunner().invoke(app, ["validate-config", str(toml)])
    assert refused.exit_code == 1
    assert f"invalid config: [model] model source {tmp_path}: its config.json has sha256" in refused.output
