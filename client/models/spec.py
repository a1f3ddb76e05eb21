"""``HFModelSpec``: a Hugging Face causal LM as the pipeline sees it (the ``ModelSpec`` of client.pipeline.model).

A spec is what every machine of a run agrees on: the model's ``config.json`` (whose digest the run names on
chain), the cut into stages, the sequence length, the seed of a fresh initialisation and, when the source
holds weights, where they come from. Building a stage from it allocates that stage's tensors and no others.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from client.models.init import split_layers
from client.stages import stage_names

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from client.models.stages import HFStage
    from client.models.weights import WeightSource

# Families whose base model's forward is exactly: the modules of the config's ``base_model_pp_plan`` in order,
# with the rotary embedding and the causal mask computed once and handed to every layer. Each one is checked
# by tests/models (a stage equals its slice of the whole model; the pipeline trains as one process does).
# A family that does more in its forward (Gemma scales the embeddings, for one) would silently compute
# another function, so an architecture joins this list only with its tests.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "phi")


@dataclass(frozen=True)
class HFModelSpec:
    """A ``transformers`` decoder-only causal LM cut by layer into ``num_stages`` pipeline stages."""

    config: Mapping[str, Any]  # the model's config.json, parsed
    num_stages: int
    seq_len: int
    seed: int = 0  # the run's init_seed: a fresh initialisation draws every parameter from it and its name
    weights: WeightSource | None = field(default=None)  # None: a fresh initialisation from ``seed``

    def __post_init__(self) -> None:
        checks = [
            (self.architecture in SUPPORTED_ARCHITECTURES,
             f"architecture {self.architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"),
            (self.num_stages >= 2, "num_stages must be at least 2 (a head and a tail)"),
            (self.n_layers >= self.num_stages,
             f"the model's {self.n_layers} layers cannot fill {self.num_stages} stages (one layer per stage at least)"),
            (self.d_model > 0 and self.vocab > 0, "hidden_size and vocab_size must be positive"),
            (1 <= self.seq_len <= self.config.get("max_position_embeddings", self.seq_len),
             f"seq_len {self.seq_len} must be in 1..max_position_embeddings "
             f"({self.config.get('max_position_embeddings')})"),
            (0 <= self.seed < 2**64, "seed must be an unsigned 64-bit integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid model: {message}")

    # ----- shape -----

    @property
    def architecture(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def vocab(self) -> int:
        return _positive(self.config, "vocab_size")

    @property
    def d_model(self) -> int:
        """The width of the hidden states that travel between stages."""
        return _positive(self.config, "hidden_size")

    @property
    def n_layers(self) -> int:
        return _positive(self.config, "num_hidden_layers")

    @property
    def config_sha256(self) -> bytes:
        return config_digest(dict(self.config))

    def fingerprint(self) -> str:
        """Short hash of everything that makes two workers' stages the same model, carried in DHT records so
        that trainers skip workers of another model."""
        blob = json.dumps({
            "architecture": self.architecture,
            "config_sha256": self.config_sha256.hex(),
            "num_stages": self.num_stages,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "weights": "" if self.weights is None else self.weights.identity(),
        }, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict[str, object]:
        """The model's description as JSON scalars (a worker's Info reply shows it)."""
        return {"architecture": self.architecture, "config_sha256": self.config_sha256.hex(), "n_layers": self.n_layers,
                "d_model": self.d_model, "vocab": self.vocab, "num_stages": self.num_stages, "seq_len": self.seq_len,
                "seed": self.seed, "weights": "" if self.weights is None else self.weights.identity()}

    # ----- stages -----

    def stage_names(self) -> list[str]:
        return stage_names(self.num_stages)

    def layer_split(self) -> dict[str, range]:
        return split_layers(self.n_layers, self.num_stages)

    def hf_config(self) -> PretrainedConfig:
        """The ``transformers`` configuration object of this model (its own class for the architecture)."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.architecture].from_dict(dict(self.config))

    def build_stage(self, stage: str) -> HFStage:
        """The module of ``stage``: pretrained tensors from ``weights``, or the run's deterministic fresh init."""
        from client.models.stages import HFStage

        return HFStage(self, stage)


def config_digest(config_json: dict[str, Any]) -> bytes:
    """sha256 of ``config.json`` in canonical form (sorted keys, no spaces): the same model on every machine
    whatever the file's formatting."""
    return hashlib.sha256(json.dumps(config_json, sort_keys=True, separators=(",", ":")).encode()).digest()


def _positive(config: Mapping[str, Any], key: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"invalid model: config.json's {key} must be a positive integer, got {value!r}")
    return value
