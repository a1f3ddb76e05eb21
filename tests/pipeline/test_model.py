"""The model cut into stages: names, layer split, deterministic init, equivalence with the whole model."""

from __future__ import annotations

import pytest
import torch

from client.pipeline.model import ModelConfig, build_all_stages, build_stage, layer_split, stage_names
from client.pipeline.optim import max_grad_norm

from .conftest import TINY


def test_stage_names_and_split_cover_every_layer_once() -> None:
    config = ModelConfig(n_layers=7, num_stages=4)
    assert stage_names(4) == ["head", "body1", "body2", "tail"]
    split = layer_split(config)
    assert [list(r) for r in split.values()] == [[0, 1], [2, 3], [4, 5], [6]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_stages": 1}, "at least 2"),
        ({"n_layers": 2, "num_stages": 3}, "n_layers must be at least num_stages"),
        ({"d_model": 30, "n_heads": 4}, "multiple of n_heads"),
        ({"vocab": 300}, "vocab"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_config_is_refused_with_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)


def test_from_dict_rejects_unknown_keys() -> None:
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ValueError, match="unknown ModelConfig keys"):
        ModelConfig.from_dict({**TINY.to_dict(), "layers": 3})


def test_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="body1, tail"):
        build_stage(TINY, "body7")


def test_init_depends_only_on_seed_and_global_name() -> None:
    first, again = build_stage(TINY, "body1"), build_stage(TINY, "body1")
    other_seed = build_stage(ModelConfig(**{**TINY.to_dict(), "seed": TINY.seed + 1}), "body1")
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other_seed.parameters(), strict=True):
        assert torch.equal(a, b), name
        if a.std() > 0:  # random tensors differ with the seed; constant ones (norms, biases) do not
            assert not torch.equal(a, c), name
    # The same global layer has the same parameters whatever the cut: body1 of 3 stages holds layer 1,
    # and so does the head of a 2-stage model with 3 layers (layers 0 and 1).
    two_stage_head = build_stage(ModelConfig(**{**TINY.to_dict(), "num_stages": 2}), "head")
    assert torch.equal(two_stage_head.layers["1"].qkv.weight, first.layers["1"].qkv.weight)


def test_stages_compose_into_a_causal_language_model() -> None:
    torch.manual_seed(0)
    stages = build_all_stages(TINY)
    tokens = torch.randint(0, 256, (2, TINY.seq_len + 1))
    hidden = stages[1](stages[0](tokens[:, :-1]))
    loss = stages[2](hidden, tokens[:, 1:])
    assert hidden.shape == (2, TINY.seq_len, TINY.d_model)
    assert abs(float(loss.detach()) - torch.log(torch.tensor(256.0)).item()) < 0.5  # near uniform at init
    # Causality: changing the last token leaves earlier positions' hidden states unchanged.
    changed = tokens.clone()
    changed[:, TINY.seq_len - 1] = (changed[:, TINY.seq_len - 1] + 1) % 256
    hidden2 = stages[1](stages[0](changed[:, :-1]))
    assert torch.allclose(hidden[:, :-1], hidden2[:, :-1])
    assert not torch.allclose(hidden[:, -1], hidden2[:, -1])


def test_tail_needs_targets() -> None:
    with pytest.raises(ValueError, match="target"):
        build_stage(TINY, "tail")(torch.zeros(1, 4, TINY.d_model))


def test_clipping_thresholds_are_stage_wise() -> None:
    assert max_grad_norm("head", 4) == pytest.approx(0.5)
    assert max_grad_norm("body2", 4) == pytest.approx(0.5)
    assert max_grad_norm("tail", 4) == pytest.approx(2.5)
