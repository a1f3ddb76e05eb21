"""Benchmark: what the robust reduction costs in loss, with nothing else varying.

``bench_gradients.py --undefended`` runs the real system twice, with and without the averaging layer's defences;
the runs differ in timing too (which replica serves which microbatch, which rounds fail), and their losses move
by a few points from run to run either way. This isolates the one thing the defences change in an honest run:
how a stage's replicas' gradients are combined.

With gradient averaging every step, a stage's replicas hold identical parameters, so one model in one process
stands for all of them (``client/pipeline/local.py``). Each round, its batch's microbatches are dealt to
``--replicas`` replicas (at random from ``--seed``, as a trainer's routing deals them); each replica's mean gradient
over the samples it served is computed on the shared parameters; and every stage's replica gradients are
combined as the all-reduce would: the flat vector cut into one contiguous part per replica (hivemind's butterfly,
one reducer a part, each part within hivemind's 131,072 elements here), each part reduced with the replicas'
sample counts as weights, by

- ``client.averaging.robust.robust_mean`` (the defended reduction: weights capped at the middle one, one
  CenteredClip step from the coordinate median), or
- the weighted mean (hivemind's reduction, undefended);

then the same optimizer step. The two runs see the same batches, the same deal and the same initial weights:
what separates their losses is the reduction alone. Prints, per seed, the training loss (mean of the last
rounds) and held-out loss of each against one process on the whole batch, the defended against the undefended,
and the reduction's time per step.

Run::

    python tests/benchmarks/bench_aggregation.py [--rounds 60] [--replicas 3] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from bench_robust import weighted_mean  # this directory
from bench_sparta import batch, evaluate  # this directory

from client.averaging import robust
from client.data import ByteDataset, open_byte_dataset
from client.pipeline.local import LocalTrainer
from client.pipeline.model import ModelConfig
from client.pipeline.optim import OptimizerConfig

Reduce = Callable[[list[torch.Tensor], list[float]], torch.Tensor]


def deal(microbatches: int, replicas: int, rng: random.Random) -> list[int]:
    """Each microbatch's replica: every replica gets at least one where there are enough, the rest at random."""
    owners = list(range(replicas))[:microbatches] + [rng.randrange(replicas) for _ in range(microbatches - replicas)]
    rng.shuffle(owners)
    return owners


def train(config: ModelConfig, dataset: ByteDataset, args: argparse.Namespace, held_out: list[int],
          reduce: Reduce | None, seed: int) -> tuple[list[float], float, float]:
    """Training losses per round, the held-out loss, and the seconds spent reducing per step; ``reduce`` None:
    one process on the whole batch (the reference)."""
    local = LocalTrainer(config, dataset, OptimizerConfig(lr=args.lr))
    rng = random.Random(seed)
    losses, reducing = [], 0.0
    for round_ in range(args.rounds):
        indices = batch(round_, args.batch_size)
        if reduce is None:
            losses.append(statistics.fmean(local.train(indices, args.microbatch_size)))
            local.step()
            continue
        chunks = [indices[i:i + args.microbatch_size] for i in range(0, len(indices), args.microbatch_size)]
        owners = deal(len(chunks), args.replicas, rng)
        grads: list[list[torch.Tensor]] = []  # per replica: its mean gradient, every stage's parameters in order
        weights: list[float] = []
        round_losses = []
        for replica in range(args.replicas):
            served = [i for chunk, owner in zip(chunks, owners, strict=True) if owner == replica for i in chunk]
            for optimizer in local.optimizers:
                optimizer.zero_grad()
            local.samples_accumulated = 0
            round_losses += local.train(served, args.microbatch_size)
            grads.append([(torch.zeros_like(p) if p.grad is None else p.grad / len(served)).flatten()
                          for p in parameters(local)])
            weights.append(float(len(served)))
        started = time.perf_counter()
        combined = combine(grads, weights, [len(list(stage.parameters())) for stage in local.stages], reduce)
        reducing += time.perf_counter() - started
        for param, grad in zip(parameters(local), combined, strict=True):
            param.grad = grad.view_as(param).clone()
        local.samples_accumulated = 1  # the grads hold the combined mean already: the step divides by 1
        local.step()
        losses.append(statistics.fmean(round_losses))
    return losses, evaluate(local.stages, dataset, held_out), reducing / args.rounds


def parameters(local: LocalTrainer) -> list[torch.nn.Parameter]:
    return [p for stage in local.stages for p in stage.parameters()]


def combine(grads: list[list[torch.Tensor]], weights: list[float], per_stage: Sequence[int],
            reduce: Reduce) -> list[torch.Tensor]:
    """Each stage's replica gradients reduced as its all-reduce would: the stage's flat vector cut into one part
    per replica, each part reduced on its own; returned per parameter."""
    out: list[torch.Tensor] = []
    start = 0
    for count in per_stage:
        sizes = [g.numel() for g in grads[0][start:start + count]]
        flat = [torch.cat(g[start:start + count]) for g in grads]
        reduced = torch.cat([reduce(list(parts), weights)
                             for parts in zip(*(f.tensor_split(len(flat)) for f in flat), strict=True)])
        out += list(reduced.split(sizes))
        start += count
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=3, help="replicas per stage (robust reduction from 3 on)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="deals of microbatches to try")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--last", type=int, default=20, help="rounds averaged for the training loss")
    args = parser.parse_args()
    if args.batch_size // args.microbatch_size < args.replicas:
        parser.error("--batch-size / --microbatch-size must give every replica a microbatch")

    torch.manual_seed(0)
    config = ModelConfig(n_layers=args.layers, d_model=args.width, seq_len=args.seq_len)
    dataset = open_byte_dataset(["stdlib"], config.seq_len)
    held_out = list(range(dataset.num_samples - args.held_out, dataset.num_samples))
    print(f"model: {config}; {args.rounds} rounds of {args.batch_size} samples in microbatches of "
          f"{args.microbatch_size}, {args.replicas} replicas", flush=True)
    losses, reference, _ = train(config, dataset, args, held_out, None, 0)
    one = statistics.fmean(losses[-args.last:])
    print(f"one process: training {one:.4f}, held-out {reference:.4f}")

    def against(value: float, base: float) -> str:
        return f"{100 * (value / base - 1):+.2f}%"

    for seed in args.seeds:
        results = {name: train(config, dataset, args, held_out, reduce, seed)
                   for name, reduce in (("defended", robust.robust_mean), ("undefended", weighted_mean))}
        (d_losses, d_held, d_time), (u_losses, u_held, u_time) = results["defended"], results["undefended"]
        d_train, u_train = statistics.fmean(d_losses[-args.last:]), statistics.fmean(u_losses[-args.last:])
        print(f"seed {seed}: defended training {d_train:.4f} ({against(d_train, one)}), held-out {d_held:.4f} "
              f"({against(d_held, reference)}); undefended training {u_train:.4f} ({against(u_train, one)}), "
              f"held-out {u_held:.4f} ({against(u_held, reference)}); defended against undefended: training "
              f"{against(d_train, u_train)}, held-out {against(d_held, u_held)}; reduction "
              f"{1e3 * d_time:.1f} ms / {1e3 * u_time:.1f} ms a step",
              flush=True)


if __name__ == "__main__":
    main()
