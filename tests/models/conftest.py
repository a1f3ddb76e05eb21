"""Tiny Hugging Face causal LMs of each supported family, built from a config on the spot (nothing is
downloaded), a token dataset in their vocabulary, and the pipeline's worker fixtures."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from client.models import HFModelSpec
from client.pipeline.model import build_all_stages
from tests.pipeline.conftest import start_worker, wait_until  # noqa: F401 - fixtures shared with the pipeline's tests

VOCAB = 96
SEQ_LEN = 16
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, num_attention_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False)


def tiny_config(architecture: str, **overrides: object) -> dict[str, object]:
    """config.json of a tiny model of ``architecture``: hidden 32, 5 layers (cut 2 + 2 + 1), 2 heads, vocab 96."""
    from transformers import CONFIG_MAPPING

    family = {
        "llama": dict(intermediate_size=64, num_key_value_heads=1),
        "mistral": dict(intermediate_size=64, num_key_value_heads=1, sliding_window=8),
        "qwen2": dict(intermediate_size=64, num_key_value_heads=1),
        "qwen3": dict(intermediate_size=64, num_key_value_heads=1, head_dim=16),
        "gpt_neox": dict(intermediate_size=64, rotary_pct=0.5),
        "phi": dict(intermediate_size=64, partial_rotary_factor=0.5),
    }[architecture]
    config = CONFIG_MAPPING[architecture](**{**COMMON, **family, **overrides})
    return config.to_dict()


def tiny_spec(architecture: str, *, num_stages: int = 3, seed: int = 5, **overrides: object) -> HFModelSpec:
    return HFModelSpec(tiny_config(architecture, **overrides), num_stages=num_stages, seq_len=SEQ_LEN, seed=seed)


def merged_state(stages: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        merged.update(stage.state_dict())
    return merged


def whole_model(spec: HFModelSpec) -> PreTrainedModel:
    """The unsplit ``transformers`` model holding the same initial parameters as the spec's stages."""
    model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
    model.load_state_dict(merged_state(build_all_stages(spec)), strict=True)
    return model.train(False)


class SyntheticTokens:
    """Token windows in the tiny models' vocabulary, addressed by sample index: sample ``i`` is a short random
    motif repeated (so that there is something to learn), drawn from NumPy's frozen stream of seed ``i``."""

    name = "synthetic"
    fingerprint = "synthetic"
    num_samples = 1 << 20

    def __init__(self, seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> None:
        self.seq_len, self.vocab = seq_len, vocab

    def sample(self, index: int) -> torch.Tensor:
        rng = np.random.RandomState(index)
        motif = rng.randint(0, self.vocab, size=int(rng.randint(2, 6)))
        return torch.from_numpy(np.resize(motif, self.seq_len + 1).astype(np.int64))

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.stack([self.sample(i) for i in indices])


@pytest.fixture(scope="session")
def tokens() -> SyntheticTokens:
    return SyntheticTokens()
