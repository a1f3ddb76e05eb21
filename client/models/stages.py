"""One pipeline stage of a Hugging Face causal LM, built without the layers it does not hold.

The whole model is first built on PyTorch's ``meta`` device, which records shapes and allocates nothing;
the stage then keeps its own submodules (the head: the embeddings and whatever the config's
``base_model_pp_plan`` runs before the layers; every stage: its layers; the tail: what the plan runs after
the layers, then the LM head), and only those are given memory. They keep the names they have in the whole
model (``model.layers.3.self_attn.q_proj.weight``), so the stages' state dicts merge into the full model's.

Each stage computes the positions, the rotary embeddings (with the model's own rotary module, which holds no
parameters) and the causal mask itself, from the hidden states' shape: only hidden states ``[B, T, D]`` cross
the network. Dropout stays off: a Backward recomputes its Forward and must get the same function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from client.models.init import parameter_stream
from client.models.weights import ModelSourceError, WeightSource

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

ROTARY = "rotary_emb"


class CutModel(Protocol):
    """What a stage is built from: a model, its cut into stages, and where its tensors come from
    (``client.models.spec.HFModelSpec`` is the one the pipeline uses)."""

    @property
    def architecture(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def weights(self) -> WeightSource | None: ...
    def stage_names(self) -> list[str]: ...
    def layer_split(self) -> dict[str, range]: ...
    def hf_config(self) -> PretrainedConfig: ...


class UnsupportedModel(ModelSourceError):
    """The model's structure is not one this module can cut into stages, or its weights do not fit it; the
    message says what is in the way."""


class HFStage(nn.Module):
    """A stage of a ``transformers`` causal LM: head ids → hidden, body hidden → hidden, tail → mean loss."""

    def __init__(self, spec: CutModel, stage: str) -> None:
        super().__init__()
        names = spec.stage_names()
        if stage not in names:
            raise ValueError(f"unknown stage {stage!r}; this model has stages {', '.join(names)}")
        self.stage = stage
        self.is_head = stage == names[0]
        self.is_tail = stage == names[-1]
        skeleton = build_skeleton(spec.hf_config())
        self.hf_config: PretrainedConfig = skeleton.config
        self.base_name = skeleton.base_model_prefix
        self._take_own_modules(skeleton, spec.layer_split()[stage], spec.architecture)
        self.to_empty(device="cpu")  # memory for this stage's tensors, and for no others
        self._build_rotary(getattr(skeleton, self.base_name), spec.architecture)
        tied = tied_sources(skeleton) if self.is_tail else {}
        if spec.weights is None:
            fresh_init(self, spec.seed, self.hf_config, tied)
        else:
            load_tensors(self, spec.weights.stage_tensors(list(self.state_dict()), tied))
        self.train(False)

    def _take_own_modules(self, skeleton: PreTrainedModel, layers: range, architecture: str) -> None:
        """Adopt the skeleton's modules this stage holds, under their names in the whole model: the head the plan's
        modules before the layers, the tail those after them and the LM head; the rest stays on the meta device."""
        base = getattr(skeleton, self.base_name)
        plan = list(self.hf_config.base_model_pp_plan or {})
        if "layers" not in plan:
            raise UnsupportedModel(f"{architecture}: its config has no pipeline plan with a 'layers' entry")
        check_base_children(base, set(plan) | {ROTARY}, architecture)
        output_name = only_output_module(skeleton, architecture)
        split = plan.index("layers")
        self.inputs = plan[:split] if self.is_head else []
        self.finals = plan[split + 1:] if self.is_tail else []
        container = nn.Module()
        for name in [*self.inputs, *self.finals]:
            container.add_module(name, getattr(base, name))
        container.add_module("layers", nn.ModuleDict({str(i): base.layers[i] for i in layers}))
        self.add_module(self.base_name, container)
        self.output_name = output_name if self.is_tail else None
        if self.output_name is not None:
            self.add_module(self.output_name, getattr(skeleton, self.output_name))

    def _build_rotary(self, base: nn.Module, architecture: str) -> None:
        """The rotary module holds only non-persistent buffers computed from the config: built for real, after
        ``to_empty`` (which leaves buffers uninitialised), outside the state dict. Any other buffer would need
        values from somewhere, so a model with one is refused."""
        rotary = getattr(base, ROTARY, None)
        if rotary is not None:
            self.container.add_module(ROTARY, type(rotary)(config=self.hf_config))
        persistent_buffers = set(self.state_dict()) - {name for name, _ in self.named_parameters()}
        if persistent_buffers:
            raise UnsupportedModel(f"{architecture}: buffers {sorted(persistent_buffers)} would need values of "
                                   "their own")

    @property
    def container(self) -> nn.Module:
        """The stage's part of the base model (``model``, ``gpt_neox``, ...), named as in the whole model."""
        return getattr(self, self.base_name)

    def train(self, mode: bool = True) -> HFStage:
        """Always in evaluation mode (no dropout): a Backward recomputes the Forward and must see the same
        function. Gradients flow as in training."""
        return super().train(False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        container = self.container
        if self.is_head:
            x = x.long()
            for name in self.inputs:
                x = getattr(container, name)(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = getattr(container, ROTARY, None)
        position_embeddings = None if rotary is None else rotary(x, position_ids)
        masks = causal_masks(self.hf_config, x, position_ids)
        for index, layer in container.layers.items():
            out = layer(x, attention_mask=masks[layer_type(self.hf_config, int(index))], position_ids=position_ids,
                        position_embeddings=position_embeddings)
            x = out[0] if isinstance(out, tuple) else out
        if not self.is_tail:
            return x
        if targets is None:
            raise ValueError("the tail stage needs target tokens to compute the loss")
        for name in self.finals:
            x = getattr(container, name)(x)
        logits = getattr(self, self.output_name)(x)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.long().flatten())


def build_skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """The whole model on the meta device: every module with its shapes, and no memory behind any tensor."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def check_base_children(base: nn.Module, known: set[str], architecture: str) -> None:
    """Refuse a base model holding tensors outside its pipeline plan: no stage would hold them."""
    for name, child in base.named_children():
        if name not in known and any(True for _ in child.parameters()):
            raise UnsupportedModel(f"{architecture}: module {name!r} has parameters outside the pipeline plan")


def only_output_module(skeleton: PreTrainedModel, architecture: str) -> str:
    """The name of the LM head: the one module of the causal LM besides its base model."""
    others = [name for name, _ in skeleton.named_children() if name != skeleton.base_model_prefix]
    output = skeleton.get_output_embeddings()
    if len(others) != 1 or getattr(skeleton, others[0]) is not output:
        raise UnsupportedModel(f"{architecture}: expected one LM head beside the base model, found {others}")
    return others[0]


def tied_sources(skeleton: PreTrainedModel) -> dict[str, str]:
    """``{lm_head.weight: model.embed_tokens.weight}`` when the config ties them: the tail's own copy of the
    LM head starts from the embeddings' values (and is trained on its own from then on)."""
    if not getattr(skeleton.config, "tie_word_embeddings", False):
        return {}
    keys = skeleton._tied_weights_keys or {}
    return dict(keys) if isinstance(keys, dict) else {}


def layer_type(config: PretrainedConfig, index: int) -> str:
    """``full_attention`` or ``sliding_attention``, as the family's own forward picks the mask of a layer."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"


def causal_masks(config: PretrainedConfig, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict[str, object]:
    """The masks of both attention kinds, as ``transformers`` builds them (None where the kernel is causal)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = dict(config=config, inputs_embeds=hidden, attention_mask=None, cache=None,
                  position_ids=position_ids)
    masks: dict[str, object] = {"full_attention": create_causal_mask(**kwargs)}
    if getattr(config, "sliding_window", None) is not None:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def fresh_init(stage: nn.Module, seed: int, config: PretrainedConfig, tied: dict[str, str]) -> None:
    """The run's deterministic initialisation (see ``client.models.init``): norm scales one, biases zero, every
    other tensor normal with the config's ``initializer_range``, the embedding's padding row zero. A tied LM
    head draws from its embedding's stream, so it starts equal to it."""
    std = float(getattr(config, "initializer_range", 0.02))
    with torch.no_grad():
        for name, param in stage.named_parameters():
            owner = stage.get_submodule(name.rpartition(".")[0])
            leaf = name.rpartition(".")[2]
            if "norm" in type(owner).__name__.lower():
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                param.zero_()
            else:
                values = parameter_stream(seed, tied.get(name, name)).standard_normal(param.numel()) * std
                param.copy_(torch.from_numpy(values.reshape(param.shape)))
                if isinstance(owner, nn.Embedding) and owner.padding_idx is not None:
                    param[owner.padding_idx].zero_()


def load_tensors(stage: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy a source's tensors into the stage, in fp32 (the master weights); every key must be there, with the
    shape the config implies and finite values (a NaN would poison every step after it). Nothing is copied
    unless every tensor passes."""
    own = stage.state_dict()
    missing = sorted(set(own) - set(tensors))
    if missing:
        raise UnsupportedModel(f"the model's weights lack {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    for key, target in own.items():
        value = tensors[key]
        if tuple(value.shape) != tuple(target.shape):
            raise UnsupportedModel(f"tensor {key} has shape {list(value.shape)}; the config implies "
                                   f"{list(target.shape)}")
        if not bool(torch.isfinite(value).all()):
            raise UnsupportedModel(f"tensor {key} holds NaN or infinite values")
    with torch.no_grad():
        for key, target in own.items():
            target.copy_(tensors[key].to(torch.float32))
