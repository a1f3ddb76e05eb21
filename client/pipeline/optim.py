"""The local optimizer each stage runs: AdamW with stage-wise gradient clipping.

Workers and the single-process reference (``local.py``) share this code so that the equivalence between a
pipeline and one process is a property of the transport alone.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)


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


def gradient_norm(grads: Iterable[torch.Tensor]) -> float:
    """The joint L2 norm, computed in float64: fp32 squares overflow from 1.9e19 on and would turn a large but
    finite gradient into an infinite norm (and clipping would then zero every gradient). It is non-finite
    exactly when some element is NaN or infinite."""
    return math.sqrt(sum(float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads))


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did: samples averaged over, the gradient norm before clipping, and whether
    the update was applied (it is not when it would have left a non-finite parameter or optimizer state)."""

    samples: int
    grad_norm: float
    applied: bool = True


class StageOptimizer:
    """Accumulated gradients → mean over samples → clip → AdamW → zero.

    Gradients arrive as sums over samples (the tail differentiates loss × batch size), so dividing by the
    accumulated sample count gives the mean gradient whatever the microbatch sizes were. Weight decay skips
    biases and LayerNorm scales (the 1-d tensors), as is usual for transformers.
    """

    #: Set by per-step gradient averaging (``client.averaging.gradients``): replaces the mean gradients, in
    #: ``params`` order, by the stage's average before clipping; returns the samples the result stands for.
    gradient_exchange: Callable[[list[torch.Tensor], int], int] | None = None

    def __init__(self, module: nn.Module, stage: str, num_stages: int, config: OptimizerConfig) -> None:
        self.stage = stage
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

    def set_learning_rate(self, lr: float) -> None:
        """The rate of the next steps: a run's schedule gives one per swarm step
        (``coordinator_program.spec.schedule``)."""
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be finite and non-negative, got {lr!r}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, samples: int) -> StepStats:
        """Apply the gradients accumulated over ``samples`` samples; a no-op when nothing was accumulated.

        The update is kept only if every parameter and every optimizer state tensor is finite after it. If
        not, or if torch cannot even compute it (a step size overflowing float32 raises half-way through the
        parameters), the stage returns to the state it had before the step, parameters and optimizer state,
        logs a warning, and the gradients are dropped: one bad step must not end the stage's training.
        """
        exchange = self.gradient_exchange
        if samples <= 0 and exchange is None:
            self.zero_grad()
            return StepStats(samples=0, grad_norm=0.0)
        if exchange is not None:  # every peer averages the same tensors: an unused parameter sends zeros
            for param in self.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        grads = [p.grad for p in self.params if p.grad is not None]
        for grad in grads:
            grad.div_(max(samples, 1))
        if exchange is not None and exchange(grads, samples) <= 0:  # nothing here, and nothing came from peers
            self.zero_grad()
            return StepStats(samples=0, grad_norm=0.0)
        norm = gradient_norm(grads)
        if norm > self.clip:
            for grad in grads:
                grad.mul_(self.clip / (norm + 1e-6))
        saved = ([p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict()))
        try:
            self.optimizer.step()
            problem = None if self._finite() else "it would have left a parameter or the optimizer state non-finite"
        except RuntimeError as exc:
            problem = f"torch could not compute it ({exc})"
        self.zero_grad()
        if problem is None:
            return StepStats(samples=samples, grad_norm=norm)
        with torch.no_grad():
            for param, before in zip(self.params, saved[0], strict=True):
                param.copy_(before)
        self.optimizer.load_state_dict(saved[1])
        log.warning(
            "stage %s: optimizer step over %d samples (gradient norm %.3g) not applied: %s; the stage keeps its "
            "last good state",
            self.stage,
            samples,
            norm,
            problem,
        )
        return StepStats(samples=samples, grad_norm=norm, applied=False)

    def _finite(self) -> bool:
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return all(bool(torch.isfinite(t).all()) for t in [*self.params, *state])

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
