"""What checked results cost and how fast they catch a liar, in one process over real gRPC workers.

1. Cost: the same number of microbatches through the same swarm (2 workers per stage, psyswarm's byte-level
   model) with checks off and on at each rate, alternating, in this one process; prints, checks-on against
   checks-off, the workers' work (tokens of Forwards, three times those of Backwards) and their compute (the CPU
   time of their runtime threads, which run nothing but the stage's Forwards and Backwards), the wall time and
   the bytes on the wire, and the share of microbatches checked.
2. Catching: a body worker among three that falsifies a share ``f`` of its answers; rounds of ``--round``
   microbatches, each round with a fresh trainer (a fresh secret), until the liar is found wrong; prints the
   rounds it took over ``--trials`` trials beside the formula ``checks.catch_probability``, and the formula's
   answers for the issue's aim (f = 1%, 10 rounds).

    python tests/benchmarks/bench_checks.py [--microbatches 64] [--rates 0.05 0.2] [--trials 5]
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import time

import torch
from torch import nn

from client.data import open_byte_dataset
from client.pipeline.checks import CheckPolicy, catch_probability, rate_needed
from client.pipeline.discovery import WorkerDirectory, start_dht
from client.pipeline.model import ModelConfig
from client.pipeline.trainer import PipelineTrainer
from client.pipeline.worker import StageWorker

CONFIG = ModelConfig(n_layers=6, d_model=128, n_heads=4, seq_len=64, num_stages=3, seed=1)


class Falsified(nn.Module):
    """A stage module whose outputs (and so input gradients) are scaled by 1.01 in a share ``f`` of its calls."""

    def __init__(self, inner: nn.Module, f: float) -> None:
        super().__init__()
        self.inner, self.f, self.rng = inner, f, random.Random()
        self.is_head, self.is_tail = inner.is_head, inner.is_tail

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        out = self.inner(x, targets)
        return out * 1.01 if self.rng.random() < self.f else out


def swarm(dht, run_id: str, counts: dict[str, int]) -> list[StageWorker]:
    workers = [StageWorker(CONFIG, stage, dht=dht, run_id=run_id, announce_period=2.0).start()
               for stage, n in counts.items() for _ in range(n)]
    directory = WorkerDirectory(dht, run_id, CONFIG.fingerprint())
    deadline = time.monotonic() + 30
    while any(len(directory.workers(s)) < n for s, n in counts.items()):
        if time.monotonic() > deadline:
            raise SystemExit("workers did not appear in the DHT within 30 s")
        time.sleep(0.2)
    return workers


def metered(workers: list[StageWorker]) -> list[float]:
    """Running totals of the CPU seconds the workers' runtime threads spend computing, and of the work they do in
    the trainer's units (a Forward's tokens, a Backward's three times: it recomputes the Forward)."""
    spent = [0.0, 0.0]
    for worker in workers:
        execute = worker.runtime.execute

        def timed(task, execute=execute):
            started = time.thread_time()
            try:
                return execute(task)
            finally:
                spent[0] += time.thread_time() - started
                spent[1] += task.request.tokens * (3.0 if task.backward else 1.0)

        worker.runtime.execute = timed
    return spent


def train(directory, dataset, run_id: str, indices: list[int], policy: CheckPolicy | None,
          microbatch: int) -> tuple[float, int, PipelineTrainer]:
    trainer = PipelineTrainer(CONFIG, dataset, directory, run_id=run_id, refresh_period=0.5, checks=policy,
                              stall_timeout=60.0)
    wall = time.perf_counter()
    try:
        trainer.train(indices, microbatch)
    finally:
        trainer.close()
    return time.perf_counter() - wall, trainer.bytes_sent + trainer.bytes_received, trainer


def cost(dht, dataset, args) -> None:
    run_id = "bench-checks-cost"
    workers = swarm(dht, run_id, {"head": 2, "body1": 2, "tail": 2})
    directory = WorkerDirectory(dht, run_id, CONFIG.fingerprint())
    spent = metered(workers)
    try:
        sums: dict[float, list[float]] = {rate: [0.0] * 5 for rate in [0.0, *args.rates]}
        for repeat in range(args.repeats):
            for rate in sums:
                start = (repeat * len(sums) + list(sums).index(rate)) * args.microbatches * 4
                indices = list(range(start, start + args.microbatches * 4))
                before = list(spent)
                wall, nbytes, trainer = train(directory, dataset, run_id, indices,
                                              CheckPolicy(rate) if rate else None, 4)
                checked = trainer.checker.checked / 4 if trainer.checker is not None else 0  # 4 questions each
                for i, value in enumerate((spent[0] - before[0], spent[1] - before[1], wall, nbytes, checked)):
                    sums[rate][i] += value
        base = sums[0.0]
        print(f"cost: {args.microbatches} microbatches of 4 × {CONFIG.seq_len} tokens, 2 workers per stage, "
              f"{args.repeats} alternating repeats")
        print("| check rate | microbatches checked | workers' work, on ÷ off | workers' CPU time, on ÷ off | "
              "wall time, on ÷ off | bytes, on ÷ off |")
        print("|---|---|---|---|---|---|")
        for rate in args.rates:
            cpu, work, wall, nbytes, checked = sums[rate]
            share = checked / (args.microbatches * args.repeats)
            print(f"| {rate:g} | {share:.3f} | {work / base[1]:.3f} | {cpu / base[0]:.3f} | {wall / base[2]:.3f} | "
                  f"{nbytes / base[3]:.3f} |")
    finally:
        for w in workers:
            w.stop(grace=0)


def catching(dht, dataset, args) -> None:
    run_id = "bench-checks-catch"
    workers = swarm(dht, run_id, {"head": 1, "body1": 3, "tail": 1})
    directory = WorkerDirectory(dht, run_id, CONFIG.fingerprint())
    liar = workers[2]
    liar.compute.module = Falsified(liar.compute.module, args.f)  # type: ignore[assignment]
    rounds_taken: list[int] = []
    start = 10**6
    try:
        for _ in range(args.trials):
            for round_ in range(1, args.max_rounds + 1):
                indices = list(range(start, start + args.round * 4))
                start += len(indices)
                *_, trainer = train(directory, dataset, run_id, indices, CheckPolicy(args.rate), 4)
                if any(liar.pubkey.hex() in v.wrong for v in trainer.checker.drain()):
                    rounds_taken.append(round_)
                    break
            else:
                rounds_taken.append(args.max_rounds + 1)
    finally:
        for w in workers:
            w.stop(grace=0)
    n = 2 * args.round / 3  # a body liar among three answers a third of the Forwards and Backwards, each a lie at f
    print(f"catching: f = {args.f}, c = {args.rate}, rounds of {args.round} microbatches, a liar among 3 body "
          f"workers (about {n:.0f} checkable answers a round)")
    print(f"rounds until found wrong, {args.trials} trials: {rounds_taken} (>{args.max_rounds}: not within it)")
    for r in (1, 2, 5, 10):
        measured = sum(t <= r for t in rounds_taken) / len(rounds_taken)
        formula = catch_probability(args.f, args.rate, round(n), r)
        print(f"  within {r:2d} rounds: measured {measured:.2f}, formula ≥ {formula:.2f}")
    need = math.ceil(math.log(0.01) / (10 * math.log(1 - 0.05 * 0.01)))
    print(f"the aim (f = 1%, caught with ≥ 99% within 10 rounds) at c = 0.05 needs n ≥ {need} answers a round "
          f"(P = {catch_probability(0.01, 0.05, need, 10):.3f}); at n = {round(n)}, c ≥ "
          f"{rate_needed(0.01, round(n), 10, 0.99):.2f} (above 1: not reachable with so few answers a round)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--f", type=float, default=0.1, help="share of answers the liar falsifies")
    parser.add_argument("--rate", type=float, default=0.2, help="check rate while catching")
    parser.add_argument("--round", type=int, default=16, help="microbatches a round")
    parser.add_argument("--max-rounds", type=int, default=10)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-catching", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    dataset = open_byte_dataset(["stdlib"], CONFIG.seq_len)
    dht = start_dht()
    try:
        if not args.skip_cost:
            cost(dht, dataset, args)
        if not args.skip_catching:
            catching(dht, dataset, args)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
