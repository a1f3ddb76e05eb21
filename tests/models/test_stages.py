"""A Hugging Face model cut into stages: each stage computes its slice of the whole model, holds exactly its
own tensors under the whole model's names, allocates nothing else, and starts from the same numbers on
every machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from client.models import SUPPORTED_ARCHITECTURES, HFModelSpec
from client.models.stages import HFStage
from client.pipeline.model import ModelConfig, build_all_stages

from .conftest import SEQ_LEN, VOCAB, merged_state, tiny_config, tiny_spec, whole_model


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_each_stage_computes_its_slice_of_the_whole_model(architecture: str) -> None:
    spec = tiny_spec(architecture)
    stages = build_all_stages(spec)
    model = whole_model(spec)
    ids = torch.randint(0, VOCAB, (3, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids[:, :-1], output_hidden_states=True)
        expected_loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
        hidden, done = ids[:, :-1], 0
        for stage in stages[:-1]:
            hidden = stage(hidden)
            done += len(stage.container.layers)
            # hidden_states[k] is the residual stream after k layers
            torch.testing.assert_close(hidden, out.hidden_states[done], rtol=1e-5, atol=1e-6)
        loss = stages[-1](hidden, ids[:, 1:])
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_the_stages_path_makes_no_deprecated_call(architecture: str) -> None:
    """transformers 5.24 warned on every forward that a keyword the stages passed goes away in 5.40."""
    import warnings

    spec = tiny_spec(architecture)
    stages = build_all_stages(spec)
    ids = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hidden = ids[:, :-1]
        for stage in stages[:-1]:
            hidden = stage(hidden)
        stages[-1](hidden, ids[:, 1:]).backward()
    deprecated = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning | FutureWarning)]
    assert not deprecated, deprecated


@pytest.mark.parametrize("architecture", ["llama", "gpt_neox"])
def test_stage_state_dicts_merge_into_the_whole_models(architecture: str) -> None:
    spec = tiny_spec(architecture)
    stages = build_all_stages(spec)
    full_keys = set(whole_model(spec).state_dict())
    keys = [set(stage.state_dict()) for stage in stages]
    assert set().union(*keys) == full_keys
    assert sum(len(k) for k in keys) == len(full_keys)  # no tensor held twice
    base = "gpt_neox" if architecture == "gpt_neox" else "model"
    assert f"{base}.layers.2.mlp.dense_h_to_4h.weight" in keys[1] if architecture == "gpt_neox" else (
        f"{base}.layers.2.self_attn.q_proj.weight" in keys[1])
    assert "lm_head.weight" in keys[2] and not any("layers.4" in k for k in keys[0] | keys[1])


def test_a_stage_holds_only_its_own_layers() -> None:
    spec = tiny_spec("llama", num_hidden_layers=6)
    full = dict(whole_model(spec).named_parameters())
    for stage_name, layers in spec.layer_split().items():
        stage = spec.build_stage(stage_name)
        expected = {k for k in full if any(k.startswith(f"model.layers.{i}.") for i in layers)}
        expected |= {"model.embed_tokens.weight"} if stage.is_head else set()
        expected |= {"model.norm.weight", "lm_head.weight"} if stage.is_tail else set()
        assert {k for k, _ in stage.named_parameters()} == expected
        assert sum(p.numel() for p in stage.parameters()) == sum(full[k].numel() for k in expected)
        assert all(p.device.type == "cpu" for p in stage.parameters())


class AllocationCounter(TorchDispatchMode):
    """Bytes of every new tensor storage torch allocates on a real device while active (an upper bound of the
    peak: it counts allocations, never frees)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def test_a_body_stage_never_allocates_the_embeddings_it_does_not_hold() -> None:
    """A model whose embedding and LM head take 512 MB each: building a body stage allocates its two layers and
    nothing else, not even for a moment (the whole model exists only on the meta device)."""
    spec = tiny_spec("llama", vocab_size=2_000_000, hidden_size=64)
    with AllocationCounter() as counter:
        stage = spec.build_stage("body1")
    held = sum(p.numel() * p.element_size() for p in stage.parameters())
    assert held < 500_000
    assert counter.bytes < 2 * held  # its parameters and the rotary tables (measured: held + 384 bytes), not 512 MB
    small = tiny_spec("llama")
    with AllocationCounter() as whole:
        model = AutoModelForCausalLM.from_config(small.hf_config())
    assert whole.bytes >= sum(p.numel() * p.element_size() for p in model.parameters())  # it sees real builds


def test_fresh_initialisation_is_the_same_everywhere_and_follows_the_seed() -> None:
    spec = tiny_spec("qwen2")
    a, b = spec.build_stage("body1").state_dict(), spec.build_stage("body1").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = tiny_spec("qwen2", seed=6).build_stage("body1").state_dict()
    assert not torch.equal(a["model.layers.2.self_attn.q_proj.weight"], other["model.layers.2.self_attn.q_proj.weight"])
    # torch's global RNG plays no part
    torch.manual_seed(123)
    c = spec.build_stage("body1").state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert torch.equal(a["model.layers.2.input_layernorm.weight"], torch.ones(32))
    assert torch.equal(a["model.layers.2.self_attn.q_proj.bias"], torch.zeros(32))  # qwen2's qkv biases
    std = float(a["model.layers.2.mlp.up_proj.weight"].std())
    assert 0.015 < std < 0.025  # the config's initializer_range


def test_a_tied_lm_head_starts_as_the_embedding_in_its_own_tail_copy() -> None:
    spec = tiny_spec("llama", tie_word_embeddings=True)
    head, tail = spec.build_stage("head"), spec.build_stage("tail")
    embedding, lm_head = head.state_dict()["model.embed_tokens.weight"], tail.state_dict()["lm_head.weight"]
    assert torch.equal(embedding, lm_head) and embedding.data_ptr() != lm_head.data_ptr()


def test_dropout_stays_off_so_a_backward_recomputes_its_forward() -> None:
    spec = tiny_spec("qwen2", attention_dropout=0.5)
    stage = spec.build_stage("body1").train()
    assert not stage.training and not any(m.training for m in stage.modules())
    hidden = torch.randn(2, SEQ_LEN, 32)
    assert torch.equal(stage(hidden), stage(hidden))


def test_fingerprints_differ_between_models_and_vocab_comes_from_the_config() -> None:
    specs = [tiny_spec("llama"), tiny_spec("qwen2"), tiny_spec("llama", seed=6), tiny_spec("llama", num_stages=2),
             tiny_spec("llama", hidden_size=64), tiny_spec("llama", vocab_size=128)]
    fingerprints = {spec.fingerprint() for spec in specs} | {ModelConfig().fingerprint()}
    assert len(fingerprints) == len(specs) + 1
    assert tiny_spec("llama").fingerprint() == tiny_spec("llama").fingerprint()
    assert specs[-1].vocab == 128 and specs[0].vocab == VOCAB and specs[4].d_model == 64


@pytest.mark.parametrize(("change", "message"), [
    (dict(config=tiny_config("llama") | {"model_type": "gemma"}), "architecture 'gemma' is not supported"),
    (dict(num_stages=6), "5 layers cannot fill 6 stages"),
    (dict(seq_len=65), "seq_len 65 must be in 1..max_position_embeddings"),
    (dict(config=tiny_config("llama") | {"hidden_size": 0}), "hidden_size must be a positive integer"),
])
def test_an_impossible_model_is_refused_with_the_reason(change: dict, message: str) -> None:
    args = dict(config=tiny_config("llama"), num_stages=3, seq_len=SEQ_LEN) | change
    with pytest.raises(ValueError, match=message):
        HFModelSpec(**args)


def test_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown stage 'body2'"):
        HFStage(tiny_spec("llama"), "body2")


def test_merged_stages_load_into_transformers() -> None:
    spec = tiny_spec("llama")
    model = whole_model(spec)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in merged_state(build_all_stages(spec)).items())
