"""The local optimizer each stage runs: AdamW with stage-wise gradient clipping.

Workers and the single-process reference (``local.py``) share this code so that the equivalence between a
pipeline and one process is a property of the transport alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters, identical for every stage of a run."""

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.weight_decay >= 0):
            raise ValueError(f"invalid OptimizerConfig: {self}")


def max_grad_norm(stage: str, num_stages: int) -> float:
    """Clip threshold: 1/sqrt(S) for every stage and 5/sqrt(S) for the tail, whose gradient is the loss's own.

    Clipping each stage separately bounds the whole model's update norm without any stage needing the others'
    gradients, which never leave their workers.
    """
    return (5.0 if stage == "tail" else 1.0) / math.sqrt(num_stages)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did: samples averaged over and the gradient norm before clipping."""

    samples: int
    grad_norm: float


class StageOptimizer:
    """Accumulated gradients → mean over samples → clip → AdamW → zero.

    Gradients arrive as sums over samples (the tail differentiates loss × batch size), so dividing by the
    accumulated sample count gives the mean gradient whatever the microbatch sizes were. Weight decay skips
    biases and LayerNorm scales (the 1-d tensors), as is usual for transformers.
    """

    def __init__(self, module: nn.Module, stage: str, num_stages: int, config: OptimizerConfig) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.clip = max_grad_norm(stage, num_stages)
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            eps=config.eps,
            foreach=False,
        )

    def step(self, samples: int) -> StepStats:
        """Apply the gradients accumulated over ``samples`` samples; a no-op when nothing was accumulated."""
        if samples <= 0:
            self.zero_grad()
            return StepStats(samples=0, grad_norm=0.0)
        grads = [p.grad for p in self.params if p.grad is not None]
        for grad in grads:
            grad.div_(samples)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=False)
        self.optimizer.step()
        self.zero_grad()
        return StepStats(samples=samples, grad_norm=float(norm))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
