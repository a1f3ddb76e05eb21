"""The same model trained in one process: the reference the pipeline is tested and benchmarked against.

It uses the pipeline's own stages, microbatching, loss scaling and per-stage optimizers, so that any
difference from a pipeline run is due to the transport and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from client.data import SampleDataset
from client.pipeline.data import microbatches
from client.pipeline.model import ModelSpec, build_all_stages
from client.pipeline.optim import OptimizerConfig, StageOptimizer, StepStats


class LocalTrainer:
    """All stages in one process, trained exactly as workers would train them."""

    def __init__(self, config: ModelSpec, dataset: SampleDataset, optimizer: OptimizerConfig | None = None) -> None:
        self.config = config
        self.dataset = dataset
        self.stages = build_all_stages(config)
        self.optimizers = [
            StageOptimizer(stage, stage.stage, config.num_stages, optimizer or OptimizerConfig())
            for stage in self.stages
        ]
        self.samples_accumulated = 0

    def train(self, indices: Sequence[int], microbatch_size: int) -> list[float]:
        """Forward and backward every microbatch, accumulating gradients; returns per-microbatch losses."""
        losses = []
        for chunk in microbatches(indices, microbatch_size):
            losses.append(accumulate(self.stages, self.optimizers, self.dataset.batch(chunk)))
            self.samples_accumulated += len(chunk)
        return losses

    def step(self) -> list[StepStats]:
        """One optimizer step per stage, as every worker would take when the round ends."""
        stats = [optimizer.step(self.samples_accumulated) for optimizer in self.optimizers]
        self.samples_accumulated = 0
        return stats

    def parameters(self, stage: int) -> list[torch.Tensor]:
        return [p.data for p in self.stages[stage].parameters()]


def accumulate(stages: Sequence[torch.nn.Module], optimizers: Sequence[StageOptimizer], tokens: torch.Tensor) -> float:
    """One microbatch through ``stages`` (one module per stage, in order), its gradients (sums over its samples, as a
    worker accumulates them) added to their parameters' and shown to each stage's ``optimizers``; returns its loss.
    The stages may be different replicas' (``tests/benchmarks/bench_seeds.py`` crosses them as a trainer's routers
    do)."""
    hidden = tokens[:, :-1]
    for stage in stages[:-1]:
        hidden = stage(hidden)
    loss = stages[-1](hidden, tokens[:, 1:])
    observed = [o for o in optimizers if o.moment is not None]  # each microbatch's own gradients
    before = [[None if p.grad is None else p.grad.clone() for p in o.params] for o in observed]
    (loss * len(tokens)).backward()
    for optimizer, was in zip(observed, before, strict=True):
        optimizer.observe([p.grad if b is None or p.grad is None else p.grad - b
                           for p, b in zip(optimizer.params, was, strict=True)], len(tokens))
    return float(loss.detach())
