"""The local optimizer each stage runs: AdamW with stage-wise gradient clipping.

Workers and the single-process reference (``local.py``) share this code so that the equivalence between a
pipeline and one process is a property of the transport alone.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable, Sequence
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
    #: The samples of the whole batch that a stage's replicas share out each step, when each replica's Adam should
    #: step on that batch's estimated second moment instead of its own share's (``BatchMoment``); 0: Adam's own.
    whole_batch: int = 0

    def __post_init__(self) -> None:
        if not (self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.weight_decay >= 0
                and self.whole_batch >= 0):
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


class BatchMoment:
    """Adam on the whole batch's second moment, for a replica that steps on its share of it.

    A replica's mean gradient over its share of the batch is the whole batch's mean plus more noise: per element,
    E[g²] = E[ḡ²] + (1 − share) · s², where s² is the variance of the replica's mean. So Adam's second moment is
    larger on a share than on the whole batch, and its steps smaller than one process's (measured: on the tiny Llama
    SPARTA's replicas end about 2% above one process for this alone; README, "SPARTA in int4"). The spread of the
    replica's own microbatches estimates s² without a byte sent: Σ n_i (g_i − g)² / ((k − 1) N) over its k
    microbatches of n_i of its N samples. Per tensor, the noise's share of the second moment, f = EMA(Σ (1 − share)
    s²) / Σ v (at most 1 − share), scales Adam's second moment by 1 − f for the step: per element the estimate would
    be too noisy to take a square root of, and a tensor's elements share their noise fraction roughly. Adam's own
    second moment goes on uncorrected, so the correction is each step's alone and the optimizer's state stays the
    standard one (what digests and checkpoints hold).

    Its cost is one float32 copy of the stage's parameters (the spread) and one multiply-add a microbatch. What a liar
    can do with it is bounded by the cap: a trainer whose Backwards disagree on purpose makes the worker's steps at
    most 1/√share times Adam's own (√2 with two replicas), each Backward still within the stage's gradient bound.

    Whether a model gains from it is measured, not assumed: at the byte-level model's width 128 it costs 1.3 points,
    as every larger step did there. A run turns it on (``Model.whole_batch_moment``).
    """

    def __init__(self, params: list[torch.Tensor], whole_batch: int, beta2: float) -> None:
        self.params, self.whole_batch, self.beta2 = params, whole_batch, beta2
        self.noise = [0.0] * len(params)  # per tensor: the EMA of Σ (1 − share) s²
        self.spread = [torch.zeros_like(p) for p in params]  # per element: Σ c_i² / n_i over this step's microbatches
        self.microbatches = 0

    def observe(self, grads: Sequence[torch.Tensor | None], samples: int) -> None:
        """One microbatch's contribution to the accumulated gradients: its sum over ``samples`` samples."""
        for spread, grad in zip(self.spread, grads, strict=True):
            if grad is not None:
                spread.addcmul_(grad, grad, value=1.0 / samples)
        self.microbatches += 1

    def apply(self, optimizer: torch.optim.Optimizer, means: Sequence[torch.Tensor], samples: int,
              clipped: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Set each tensor's second moment for the coming step from this step's clipped mean gradients ``means``
        (``clipped`` × the mean over ``samples``); returns (moment, Adam's own) pairs to restore after it."""
        share = min(samples / self.whole_batch, 1.0)
        k, restore = self.microbatches, []
        for i, (param, g) in enumerate(zip(self.params, means, strict=True)):
            if k > 1:  # the unclipped mean is g / clipped; the clipped one's noise is clipped² times its own
                s2 = float((self.spread[i] * clipped**2 - samples * g * g).sum()) / ((k - 1) * samples)
                self.noise[i] = self.beta2 * self.noise[i] + (1 - self.beta2) * (1 - share) * s2
            state = optimizer.state.get(param)
            if not state or "exp_avg_sq" not in state:
                continue
            own = state["exp_avg_sq"] * self.beta2 + (1 - self.beta2) * g * g  # Adam's after this step
            f = min(max(self.noise[i] / max(float(own.sum()), 1e-30), 0.0), 1 - share)
            if f == 0:  # nothing to take out: Adam's own step, to the bit
                continue
            state["exp_avg_sq"].copy_(((own * (1 - f) - (1 - self.beta2) * g * g) / self.beta2).clamp_min(0))
            restore.append((state["exp_avg_sq"], own))
        for spread in self.spread:
            spread.zero_()
        self.microbatches = 0
        return restore


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
        self.moment = BatchMoment(self.params, config.whole_batch, config.beta2) if config.whole_batch else None

    def observe(self, grads: Sequence[torch.Tensor | None], samples: int) -> None:
        """One microbatch's parameter gradients (sums over its ``samples``), as they are accumulated: what
        ``BatchMoment`` estimates the noise from, when the run asks for it."""
        if self.moment is not None:
            self.moment.observe(grads, samples)

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
        clipped = self.clip / (norm + 1e-6) if norm > self.clip else 1.0
        if clipped != 1.0:
            for grad in grads:
                grad.mul_(clipped)
        saved = ([p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict()))
        # With per-step gradient averaging the gradients are the whole batch's already.
        restore = ([] if self.moment is None or exchange is not None else self.moment.apply(
            self.optimizer, [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params], samples, clipped))
        try:
            self.optimizer.step()
            problem = None if self._finite() else "it would have left a parameter or the optimizer state non-finite"
        except RuntimeError as exc:
            problem = f"torch could not compute it ({exc})"
        for moment, own in restore:  # Adam's own second moment goes on
            moment.copy_(own)
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
