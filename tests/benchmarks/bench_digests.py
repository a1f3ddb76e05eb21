"""Benchmark: what a worker's digest of its stage (``client.pipeline.digests``) costs after each optimizer step.

Run from the repository root: ``python -m tests.benchmarks.bench_digests``.

In one process, each stage of the run's default model (the byte-level model a run spec gets by default:
``coordinator_program.spec.config.Model``, cut into the default number of stages) takes optimizer steps on random
accumulated gradients, each followed by the digest of its ``replica_tensors`` (its ``state_dict`` and its optimizer's
moments), timed apart. Prints the medians per stage,
the digest's share of the optimizer step alone (a round's forward and backward passes, which a step follows, cost
far more), and the hashing rate.
"""

from __future__ import annotations

import statistics
import time

import torch

from client.join.state_download import replica_tensors
from client.pipeline.digests import state_digest
from client.pipeline.model import ModelConfig, build_stage
from client.pipeline.optim import OptimizerConfig, StageOptimizer
from client.stages import stage_names
from coordinator_program.spec.config import Config, Model

STEPS = 50


def main() -> None:
    model, config = Model(), Config()
    spec = ModelConfig(n_layers=model.n_layers, d_model=model.d_model, n_heads=model.n_heads, seq_len=model.seq_len,
                       num_stages=config.num_stages, seed=model.init_seed)
    for stage in stage_names(config.num_stages):
        module = build_stage(spec, stage)
        optimizer = StageOptimizer(module, stage, config.num_stages, OptimizerConfig())
        nbytes = sum(t.numel() * t.element_size() for t in replica_tensors(module, optimizer.optimizer).values())
        steps, digests = [], []
        for i in range(STEPS):
            for param in optimizer.params:
                param.grad = torch.randn_like(param) * (i + 1)
            start = time.perf_counter()
            optimizer.step(8)
            steps.append(time.perf_counter() - start)
            start = time.perf_counter()
            state_digest(replica_tensors(module, optimizer.optimizer))
            digests.append(time.perf_counter() - start)
        step, digest = statistics.median(steps), statistics.median(digests)
        print(f"{stage}: {nbytes / 2**20:.2f} MiB of state; median of {STEPS}: optimizer step {step * 1e3:.2f} ms, "
              f"digest {digest * 1e3:.2f} ms ({digest / step:.0%} of the step alone), "
              f"{nbytes / digest / 2**30:.2f} GiB/s hashed")


if __name__ == "__main__":
    main()
