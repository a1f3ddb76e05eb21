"""The pipelined language model: what the pipeline needs of any model (``ModelSpec``), and psyswarm's own
decoder-only byte-level transformer (``ModelConfig``), the embedded default. Hugging Face causal LMs implement
``ModelSpec`` in ``client.models``.

Every contributor builds only its own stage, yet all stages together must be exactly the model a single
process would build. So parameters are named by their place in the *whole* model (``layers.4.qkv.weight``)
and each one is initialised from its own random stream, seeded by the run seed and that global name with
NumPy's legacy ``RandomState`` (whose streams NumPy freezes across versions, unlike torch's generators).
A stage built on any machine therefore starts from the same numbers as the matching slice of the model.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from client.models.init import parameter_stream, split_layers
from client.stages import stage_names

VOCAB_SIZE = 256  # byte-level tokenizer: a token is one byte of UTF-8 text


class ModelSpec(Protocol):
    """What the pipeline needs of a model: its cut into stages, the shapes its requests are checked against,
    and a way to build one stage alone (with the run's initial parameters) on any machine.

    A stage module has ``stage``, ``is_head`` and ``is_tail`` attributes and ``forward(x, targets=None)``: the
    head takes token ids ``[B, T]``, a body hidden states ``[B, T, d_model]``; head and bodies return hidden
    states, the tail (given the target ids) the mean cross-entropy. Its ``state_dict`` keys are the tensors'
    names in the whole model, so the stages' state dicts merge into the model's.
    """

    num_stages: int
    seq_len: int

    @property
    def vocab(self) -> int: ...

    @property
    def d_model(self) -> int:
        """The width of the hidden states that travel between stages."""
        ...

    def fingerprint(self) -> str:
        """Short hash that differs between models, carried in DHT records so trainers skip other models."""
        ...

    def to_dict(self) -> dict[str, object]:
        """The model's description as JSON scalars (a worker's Info reply shows it)."""
        ...

    def stage_names(self) -> list[str]: ...

    def build_stage(self, stage: str) -> nn.Module: ...


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model and of its cut into pipeline stages; identical on every machine of a run.

    The defaults train visibly (loss well below the 5.55 of a uniform guess within a few hundred
    microbatches) on two CPU cores.
    """

    n_layers: int = 6
    d_model: int = 128
    n_heads: int = 4
    seq_len: int = 128
    vocab: int = VOCAB_SIZE
    num_stages: int = 3
    mlp_ratio: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.num_stages >= 2, "num_stages must be at least 2 (a head and a tail)"),
            (self.n_layers >= self.num_stages, "n_layers must be at least num_stages (one layer per stage)"),
            (self.d_model > 0 and self.n_heads > 0, "d_model and n_heads must be positive"),
            (self.d_model % max(self.n_heads, 1) == 0, "d_model must be a multiple of n_heads"),
            (self.seq_len > 0, "seq_len must be positive"),
            (0 < self.vocab <= VOCAB_SIZE, f"vocab must be in 1..{VOCAB_SIZE} (tokens are bytes)"),
            (self.mlp_ratio > 0, "mlp_ratio must be positive"),
            (0 <= self.seed < 2**63, "seed must be a non-negative 63-bit integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid ModelConfig: {message}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ModelConfig:
        """Build from a dict such as a run's config file, rejecting unknown keys instead of ignoring them."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]

    def fingerprint(self) -> str:
        """Short hash of the config, carried in DHT records so trainers skip workers of another model."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def stage_names(self) -> list[str]:
        return stage_names(self.num_stages)

    def build_stage(self, stage: str) -> StageModule:
        """The module for ``stage``, with the run's deterministic initial parameters."""
        return StageModule(self, stage)


def stage_index(config: ModelSpec, stage: str) -> int:
    """Position of ``stage`` in the pipeline, with an error naming the valid stages."""
    names = config.stage_names()
    if stage not in names:
        raise ValueError(f"unknown stage {stage!r}; this model has stages {', '.join(names)}")
    return names.index(stage)


def layer_split(config: ModelConfig) -> dict[str, range]:
    """Global layer indices held by each stage: as even as possible, earlier stages take the remainder."""
    return split_layers(config.n_layers, config.num_stages)


class Block(nn.Module):
    """A pre-norm transformer layer: causal multi-head self-attention then a GELU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, config.mlp_ratio * d)
        self.out = nn.Linear(config.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class StageModule(nn.Module):
    """One pipeline stage.

    head: byte tokens ``[B, T]`` → hidden ``[B, T, D]`` (embeddings + its layers);
    body: hidden → hidden; tail: hidden and target tokens → mean cross-entropy (its layers, final norm,
    LM head). The tail returns the loss rather than logits so that only ``[B, T, D]`` activations ever
    cross the network.
    """

    def __init__(self, config: ModelConfig, stage: str) -> None:
        super().__init__()
        self.config = config
        self.stage = stage
        index = stage_index(config, stage)
        self.is_head = index == 0
        self.is_tail = index == config.num_stages - 1
        if self.is_head:
            self.tokens = nn.Embedding(config.vocab, config.d_model)
            self.positions = nn.Embedding(config.seq_len, config.d_model)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in layer_split(config)[stage]})
        if self.is_tail:
            self.norm = nn.LayerNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab)
        init_parameters(self, config.seed, config.n_layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_head:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tokens(x.long()) + self.positions(positions)
        for layer in self.layers.values():
            x = layer(x)
        if not self.is_tail:
            return x
        if targets is None:
            raise ValueError("the tail stage needs target tokens to compute the loss")
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.long().flatten())


def init_parameters(module: nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2-style init, each tensor from its own stream keyed by its global name (see module docstring).

    Residual output projections get std 0.02/sqrt(2·n_layers) so the residual stream does not grow with
    depth; biases start at zero and LayerNorm scales at one.
    """
    residual_std = 0.02 / math.sqrt(2 * n_layers)
    with torch.no_grad():
        for name, param in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if ".ln" in f".{name}" or name.startswith("norm."):
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                param.zero_()
            else:
                std = residual_std if name.endswith(("proj.weight", "out.weight")) else 0.02
                values = parameter_stream(seed, name).standard_normal(param.numel()) * std
                param.copy_(torch.from_numpy(values.reshape(param.shape)))


def build_stage(config: ModelSpec, stage: str) -> nn.Module:
    """The module for ``stage`` of any model, with the run's deterministic initial parameters."""
    return config.build_stage(stage)


def build_all_stages(config: ModelSpec) -> list[nn.Module]:
    """Every stage in pipeline order: the whole model, as one process would train it."""
    return [config.build_stage(name) for name in config.stage_names()]
