"""Benchmark: averaging rules against one process over many seeds, their arithmetic without the network.

A single run of ``bench_gradients.py`` moves by a few points between repeats: after 100 steps the small models are
still leaving a plateau, and when each one leaves it depends on every rounding. One seed ranks nothing. This script
replays each rule's arithmetic on two replicas in one process, with the project's own pieces (the pipeline's stages
and optimizer, ``SpartaMasks``, the int8 codec ``values.round_trip``), for each of ``--seeds`` initialisations, and
prints each rule's loss against one process trained on the same batches, per seed and as mean ± standard deviation:

- ``full``: both replicas step on the mean gradient (one process, up to float rounding: the noise floor);
- ``powersgd:R``: the mean of rank-R PowerSGD factors in int8, Q warm-started, with error feedback
  (``client.averaging.gradients``'s round, without its defences);
- ``sparta:EVERY/P``: each replica steps on its own half batch, and every EVERY steps the replicas average one
  1/P slice; ``sparta:EVERY/P:int8`` (or ``:int4``) sends each slice as its change since the last average, in that
  codec (``client.averaging.anchored``);
- ``none``: each replica on its own half, never averaged;
- ``ownv:R``: each replica on its own half, Adam's first moment fed the pair's rank-R PowerSGD mean as ``powersgd:R``
  makes it and its second moment the replica's own half's gradient (``OwnMoment``; R 0: the exact mean), one more
  candidate for PowerSGD at small widths; ``ownv-check:R`` feeds the mean to both, and ``ownv-check:0`` must match
  ``full`` (up to rounding), the check that ``OwnMoment`` is the stages' AdamW;
- ``gossip:R``: each replica on its own half, and every step the pair's parameters mixed along the rank-R directions
  in which they differ most (``Gossip``: PowerGossip's power iteration on the difference of their parameters, its
  factors in float32, or in ``:float16`` or ``:int8``), the candidate for PowerSGD at small widths that holds, each
  move bounded as the client bounds it (``--bound``: ``MOVE_BOUND`` × the replica's own change since its last mix by
  default, ``inf`` for none; the run prints how many moves the bound shortened);
- ``crowd:N`` and ``crowd:N:gossip:R[:codec]``: N replicas (N even), each on every N-th microbatch of each batch,
  never mixed, or mixed by ``gossip`` every step in pairs drawn at random, as a stage's replicas would gossip in
  groups of two (``crowd``).

A rule ending in ``*SCALE`` (``sparta:1/17:int8*1.414``) runs its replicas at SCALE × the learning rate: a replica
stepping Adam on half the batch sees gradients twice as noisy, so its second moment is larger and its steps smaller
than one process's, which the square-root rule for Adam's batch size (scale by √2) would offset where noise dominates.
A rule ending in ``+moment`` (``sparta:1/10:int4+moment``) offsets it by measurement instead
(``client.pipeline.optim.BatchMoment``, a run's ``whole_batch_moment``): each replica estimates, per tensor, how much
of its second moment is the noise of its half batch, from the spread of its own microbatches, and steps Adam on the
second moment the whole batch would have had.

Replicas see each batch split in halves: the first to one, the second to the other. A rule ending in ``+uneven`` deals
each step 1, 2, 2 or 3 of its four microbatches (at random; in general, half give or take one) to the first replica,
as a trainer's routers did when they carried each worker's runtime over from round to round
(``client.pipeline.router``); one ending in ``+crossed`` deals each stage's microbatches evenly but independently of
the other stages', as the routers now do: a microbatch may run the head of one replica and the body of the other.
A replicas' rule ending in ``+rankR`` (``sparta:1/20:int4+rank2``, ``none+rank4``) also averages, every step, each
replica's gradient on a rank-R subspace the pair finds as PowerSGD does (``Subspace``: its factors in int8, Q warm
started) and keeps the rest of it local, with no error feedback: one candidate for PowerSGD at small widths, where
error feedback under Adam does worse than no averaging at all (README, "A subspace averaged, the rest kept local").
Suffixes go in the order ``+moment+rankR+uneven`` (or ``+crossed``).
``--model tiny-llama`` runs the demo's Llama (``bench_gradients.tiny_llama_run``) instead of psyswarm's model.

Run::

    python tests/benchmarks/bench_seeds.py --seeds 10 full powersgd:4 sparta:1/16:int8 none
    python tests/benchmarks/bench_seeds.py --model tiny-llama --seeds 6 full powersgd:4 sparta:1/17:int8 none
    python tests/benchmarks/bench_seeds.py --seeds 10 sparta:1/17:int8 sparta:1/9:int4
    python tests/benchmarks/bench_seeds.py --seeds 10 sparta:1/10:int4 "sparta:1/20:int4+rank2" "none+rank4"
    python tests/benchmarks/bench_seeds.py --seeds 10 gossip:1 gossip:2:float16 gossip:4:int8 sparta:1/10:int4 none
    python tests/benchmarks/bench_seeds.py --seeds 6 crowd:4:gossip:4:int8 crowd:4
    python tests/benchmarks/bench_seeds.py --model tiny-llama --seeds 6 "sparta:1/10:int4+moment" \\
        "sparta:1/10:int4+moment+uneven" "sparta:1/10:int4+moment+crossed"
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from bench_gradients import tiny_llama_run  # this directory
from bench_sparta import evaluate  # this directory
from hivemind.utils.math import orthogonalize_

from client.averaging.gossip_rule import MOVE_BOUND, bounded, part_size, vector_part
from client.averaging.powersgd import compressed_shape, seeded_matrix
from client.averaging.sparta import SpartaMasks
from client.averaging.values import GradValues, encoded_bytes, round_trip
from client.data import SampleDataset, open_byte_dataset
from client.pipeline.data import microbatches
from client.pipeline.local import LocalTrainer, accumulate
from client.pipeline.model import ModelConfig, ModelSpec, build_all_stages
from client.pipeline.optim import OptimizerConfig, StageOptimizer, gradient_norm

Grads = list[list[torch.Tensor]]  # per stage, per parameter


@dataclass(frozen=True)
class Bench:
    """What every run of every rule shares: the settings, the tokens, and the held-out samples."""

    args: argparse.Namespace
    dataset: SampleDataset
    held_out: list[int]

    def trainer(self, spec: ModelSpec, lr_scale: float = 1.0, whole_batch: int = 0) -> LocalTrainer:
        return LocalTrainer(spec, self.dataset, OptimizerConfig(lr=self.args.lr * lr_scale, whole_batch=whole_batch))

    def held_out_loss(self, trainer: LocalTrainer) -> float:
        return evaluate(trainer.stages, self.dataset, self.held_out)


def reduced(parts: list[torch.Tensor], values: GradValues = GradValues.INT8) -> torch.Tensor:
    """The mean of ``parts`` as a reducer returns it in ``values``: each part rounded on its way in, the mean on its
    way out."""
    return round_trip(sum(round_trip(p.contiguous(), values) for p in parts) / len(parts), values)


def first_factors(shapes: Sequence[tuple[int, ...]], rank: int) -> tuple[list, list]:
    """Each tensor's PowerSGD factor shape (None: sent whole) and its first Q, drawn as the client draws it."""
    factors = [compressed_shape(shape, rank, 2.0) for shape in shapes]
    return factors, [None if f is None else seeded_matrix(0, str(i), f[1], rank) for i, f in enumerate(factors)]


class Phases:
    """Two replicas' rank-``rank`` PowerSGD phases in int8, Q warm-started from the last round's mean."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], rank: int) -> None:
        self.factors, self.qs = first_factors(shapes, rank)

    def phases(self, i: int, ms: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Tensor ``i``'s P̂ from the replicas' matrices ``ms`` and each one's own Mᵀ P̂; the Q kept is their mean."""
        orthogonalize_(self.qs[i])
        p = reduced([m @ self.qs[i] for m in ms])
        orthogonalize_(p)
        local = [m.t() @ p for m in ms]
        self.qs[i] = reduced(local)
        return p, local


class PowerSGD(Phases):
    """The mean of the factors for both replicas, with error feedback (``client.averaging.gradients``'s round)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], rank: int) -> None:
        super().__init__(shapes, rank)
        self.errors = [[None if f is None else torch.zeros(f) for f in self.factors] for _ in range(2)]

    def __call__(self, grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        out = []
        for i, factor in enumerate(self.factors):
            if factor is None:
                out.append((grads[0][i] + grads[1][i]) / 2)
                continue
            ms = [g[i].reshape(factor) + e[i] for g, e in zip(grads, self.errors, strict=True)]
            p, local = self.phases(i, ms)
            for error, m, q in zip(self.errors, ms, local, strict=True):
                error[i] = m - p @ q.t()
            out.append((p @ self.qs[i].t()).reshape(grads[0][i].shape))
        return out


class Subspace(Phases):
    """The factors' mean replaces only the part of each replica's own gradient they span: each steps on its
    gradient with its projection onto the pair's P̂ swapped for the pair's (G_r + P̂ P̂ᵀ (mean G − G_r)); the rest
    stays local, with no error feedback, and SPARTA averages what it moves apart."""

    def __call__(self, grads: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[], []]
        for i, factor in enumerate(self.factors):
            if factor is None:
                mean = reduced([g[i] for g in grads])
                for o in out:
                    o.append(mean)
                continue
            ms = [g[i].reshape(factor) for g in grads]
            p, local = self.phases(i, ms)
            for o, m, q in zip(out, ms, local, strict=True):
                o.append((m + p @ (self.qs[i] - q).t()).reshape(grads[0][i].shape))
        return out


class Gossip:
    """PowerGossip (Vogels et al., 2020) for two replicas: PowerSGD's power iteration run on the difference of their
    parameters, not on their gradients. What SPARTA found the pair lacks is mixing of parameters; this spends
    PowerSGD's factors on the directions in which the two differ most.

    Every step, for each matrix, the pair averages ±M_r q (the first replica's sign +, the second's −: the mean is
    D q, D = (M_0 − M_1) / 2) with q warm-started and the same for both, orthonormalises it to P̂, averages ±M_rᵀ P̂
    to Dᵀ P̂, and the first replica steps by −P̂ (Dᵀ P̂)ᵀ, the second by +: both meet on the pair's mean along P̂.
    Sending the signed values, not M_r q itself, gives both the very same P̂ and moves them by exactly opposite
    steps, so a codec's rounding never moves the pair's mean, only how far apart the two stay (a plain mean's
    rounding, applied to both, was noise added to the model every step: +5.8% in float16). Dᵀ P̂ warm-starts the
    next q. Vectors (norms' gains, biases) are averaged an eighth a step, every eighth entry in turn, in float32.
    Each move is bounded as the client bounds it (``gossip_rule.bounded``: ``bound`` × the replica's own change
    since it last mixed; ``math.inf``: unbounded), and ``clipped`` counts the moves the bound shortened."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], rank: int, values: GradValues, bound: float = MOVE_BOUND,
                 replicas: Sequence[Sequence[torch.Tensor]] = ()) -> None:
        """``replicas``: every replica's tensors of this stage, whose values now are where their own change starts."""
        self.shapes, self.rank, self.values, self.bound = shapes, rank, values, bound
        self.factors, self.qs = first_factors(shapes, rank)
        self.anchors = {id(t): t.detach().clone() for ts in replicas for t in ts}
        self.moves = self.clipped = 0

    def drawn(self, step: int) -> list:
        """Each tensor's q drawn afresh for ``step``, as the client draws one for a pair without a common q."""
        return [None if f is None else seeded_matrix(step, str(i), f[1], self.rank) for i, f in enumerate(self.factors)]

    def bytes_per_step(self) -> int:
        """What one replica sends a step: both factors of every matrix in ``values``, every vector's eighth in
        float32."""
        return sum(4 * part_size(math.prod(shape)) if f is None
                   else encoded_bytes(self.values, f[0] * self.rank) + encoded_bytes(self.values, f[1] * self.rank)
                   for shape, f in zip(self.shapes, self.factors, strict=True))

    def _move(self, tensor: torch.Tensor, move: torch.Tensor, part: slice | None = None,
              target: torch.Tensor | None = None) -> None:
        """Move ``tensor`` (``part`` of its flat view) by ``move``, bounded by its own change since its last mix; or,
        given ``target`` (unbounded runs), set it there, as the rule did before the bound, whose figures ``--bound
        inf`` reproduces to the digit."""
        anchor = self.anchors[id(tensor)]  # keyed by the parameter itself: each ``.data`` is a new object
        now, then = (tensor.data, anchor) if part is None else (tensor.view(-1)[part], anchor.view(-1)[part])
        if self.bound < math.inf:
            move, clipped = bounded(move, now - then, self.bound)
            self.clipped += clipped
        self.moves += 1
        if target is not None:
            now.copy_(target)
        else:
            now += move
        then.copy_(now)

    def __call__(self, params: list[list[torch.Tensor]], step: int) -> None:
        """Mix ``params`` (per replica, per tensor) in place after optimizer step ``step`` (which eighth of each
        vector: the same for every pair of a step)."""
        for i, factor in enumerate(self.factors):
            if factor is None:
                part = vector_part(params[0][i].numel(), step)
                first, second = (ps[i].data.view(-1)[part] for ps in params)
                half, mean = (first - second) / 2, (first + second) / 2 if self.bound == math.inf else None
                self._move(params[0][i], -half, part, mean)
                self._move(params[1][i], half, part, mean)
                continue
            first, second = (ps[i].data.view(factor) for ps in params)
            orthogonalize_(self.qs[i])
            p = reduced([first @ self.qs[i], -(second @ self.qs[i])], self.values)
            orthogonalize_(p)
            q = reduced([first.t() @ p, -(second.t() @ p)], self.values)
            self._move(params[0][i], -(p @ q.t()).view(params[0][i].shape))
            self._move(params[1][i], (p @ q.t()).view(params[1][i].shape))
            if q.norm() > 0:
                self.qs[i] = q


def report_clipped(mixers: Sequence[Gossip]) -> None:
    moves = sum(m.moves for m in mixers)
    if moves:
        print(f"    the bound shortened {sum(m.clipped for m in mixers):,} of {moves:,} moves", flush=True)


class OwnMoment:
    """One replica's AdamW (the stages' own: clipped, decoupled decay) whose first moment takes the pair's averaged
    gradient and whose second moment the replica's own. 1-bit Adam's observation: error feedback makes a compressed
    sum right over time, which serves what enters Adam linearly, but a second moment of low-rank gradients is not the
    gradients' second moment; each replica's own, from its half batch, is uncompressed and costs no bytes."""

    def __init__(self, optimizer: StageOptimizer, config: OptimizerConfig) -> None:
        self.params, self.clip, self.config = optimizer.params, optimizer.clip, config
        self.first = [torch.zeros_like(p) for p in self.params]
        self.second = [torch.zeros_like(p) for p in self.params]
        self.steps = 0

    def step(self, shared: list[torch.Tensor], own: list[torch.Tensor]) -> None:
        c, self.steps = self.config, self.steps + 1
        norms = [gradient_norm(g) for g in (shared, own)]
        scale = [self.clip / (n + 1e-6) if n > self.clip else 1.0 for n in norms]
        with torch.no_grad():
            for p, g, o, m, v in zip(self.params, shared, own, self.first, self.second, strict=True):
                if p.dim() >= 2:
                    p.mul_(1 - c.lr * c.weight_decay)
                m.lerp_(g * scale[0], 1 - c.beta1)
                v.mul_(c.beta2).addcmul_(o, o, value=(1 - c.beta2) * scale[1] ** 2)
                denom = (v.sqrt() / math.sqrt(1 - c.beta2 ** self.steps)).add_(c.eps)
                p.addcdiv_(m, denom, value=-c.lr / (1 - c.beta1 ** self.steps))


def own_moment(bench: Bench, spec: ModelSpec, rank: int, check: bool = False) -> tuple[list[float], float]:
    """Two replicas, each on its half batch, stepping ``OwnMoment`` on the pair's rank-``rank`` PowerSGD mean (int8,
    error feedback; rank 0: the exact mean) and on its own second moment. ``check`` feeds the mean to both moments,
    which must reproduce ``full``: the test that ``OwnMoment`` is the stages' AdamW."""
    args = bench.args
    pair = [bench.trainer(spec) for _ in range(2)]
    adams = [[OwnMoment(o, OptimizerConfig(lr=args.lr)) for o in t.optimizers] for t in pair]
    compress = [PowerSGD([tuple(p.shape) for p in o.params], rank) if rank else None for o in pair[0].optimizers]
    losses = []
    for round_ in range(args.rounds):
        indices = list(range(round_ * args.batch_size, (round_ + 1) * args.batch_size))
        got, means = [], []
        for trainer, half in zip(pair, (indices[: len(indices) // 2], indices[len(indices) // 2:]), strict=True):
            got += trainer.train(half, args.microbatch_size)
            means.append([[p.grad / len(half) for p in o.params] for o in trainer.optimizers])
        for s, squeeze in enumerate(compress):
            grads = [means[0][s], means[1][s]]
            mean = squeeze(grads) if squeeze else [(a + b) / 2 for a, b in zip(*grads, strict=True)]
            for r, adam in enumerate(adams):
                adam[s].step(mean, mean if check else grads[r])
        for trainer in pair:
            for optimizer in trainer.optimizers:
                optimizer.zero_grad()
            trainer.samples_accumulated = 0
        losses.append(statistics.fmean(got))
    return losses, statistics.fmean(bench.held_out_loss(t) for t in pair)


def halves(trainer: LocalTrainer, indices: list[int], microbatch: int) -> tuple[list[float], list[Grads]]:
    """Each half batch's losses and mean gradients, from the same parameters."""
    losses, grads = [], []
    for half in (indices[: len(indices) // 2], indices[len(indices) // 2:]):
        for optimizer in trainer.optimizers:
            optimizer.zero_grad()
        losses += trainer.train(half, microbatch)
        grads.append([[p.grad / len(half) for p in o.params] for o in trainer.optimizers])
    return losses, grads


def shared(bench: Bench, spec: ModelSpec, combine: Callable[[int], Callable] | None) -> tuple[list[float], float]:
    """One model stepping on ``combine``'s result of the two halves' gradients (None: on the whole batch)."""
    args, trainer = bench.args, bench.trainer(spec)
    rules = None if combine is None else [combine(s) for s in range(spec.num_stages)]
    losses = []
    for round_ in range(args.rounds):
        indices = list(range(round_ * args.batch_size, (round_ + 1) * args.batch_size))
        if rules is None:
            losses.append(statistics.fmean(trainer.train(indices, args.microbatch_size)))
        else:
            got, grads = halves(trainer, indices, args.microbatch_size)
            losses.append(statistics.fmean(got))
            for s, optimizer in enumerate(trainer.optimizers):
                for param, grad in zip(optimizer.params, rules[s]([grads[0][s], grads[1][s]]), strict=True):
                    param.grad = grad * args.batch_size
            trainer.samples_accumulated = args.batch_size
        trainer.step()
    return losses, bench.held_out_loss(trainer)


class Deal(enum.Enum):
    """How a step's microbatches are shared out between the two replicas (the module docstring)."""

    HALVES = "halves"
    UNEVEN = "uneven"
    CROSSED = "crossed"


def owners(deal: Deal, rng: random.Random, microbatches: int, stages: int) -> list[list[int]]:
    """Per stage, per microbatch: the replica that runs it."""
    half = microbatches // 2
    if deal is Deal.CROSSED:
        return [rng.sample([0] * half + [1] * (microbatches - half), microbatches) for _ in range(stages)]
    first = half if deal is Deal.HALVES else half + rng.choice([-1, 0, 0, 1])
    return [[0] * first + [1] * (microbatches - first)] * stages


def replicas(bench: Bench, spec: ModelSpec, every: int | None, partitions: int, values: GradValues,
             lr_scale: float = 1.0, moment: bool = False, deal: Deal = Deal.HALVES,
             rank: int = 0, gossip: tuple[int, GradValues] | None = None) -> tuple[list[float], float]:
    """Two replicas each stepping on its share of each batch (``deal``) at ``lr_scale`` × the rate (with ``moment``,
    on the whole batch's estimated second moment; with ``rank``, on its gradient with a rank-``rank`` subspace
    averaged: ``Subspace``); every ``every`` steps one slice averaged, in ``values``."""
    args = bench.args
    pair = [bench.trainer(spec, lr_scale, args.batch_size if moment else 0) for _ in range(2)]
    params = [[o.params for o in t.optimizers] for t in pair]
    subspaces = [Subspace([tuple(p.shape) for p in ps], rank) for ps in params[0]] if rank else []
    gossips = [Gossip([tuple(p.shape) for p in ps], *gossip, args.bound, [r[s] for r in params])
               for s, ps in enumerate(params[0])] if gossip else []
    masks = [SpartaMasks([(f"{s}.{i}", p.numel()) for i, p in enumerate(ps)], partitions, spec.seed)
             for s, ps in enumerate(params[0])]
    anchors = [[p.detach().clone().reshape(-1) for p in ps] for ps in params[0]]
    losses = []
    rng = random.Random(spec.seed)
    for round_ in range(args.rounds):
        chunks = microbatches(range(round_ * args.batch_size, (round_ + 1) * args.batch_size), args.microbatch_size)
        dealt = owners(deal, rng, len(chunks), spec.num_stages)
        samples = [[0] * spec.num_stages for _ in pair]
        got = []
        for m, chunk in enumerate(chunks):
            chain = [dealt[s][m] for s in range(spec.num_stages)]
            got.append(accumulate([pair[r].stages[s] for s, r in enumerate(chain)],
                                  [pair[r].optimizers[s] for s, r in enumerate(chain)], bench.dataset.batch(chunk)))
            for s, r in enumerate(chain):
                samples[r][s] += len(chunk)
        for s, subspace in enumerate(subspaces):
            means = [[p.grad / samples[r][s] for p in params[r][s]] for r in range(2)]
            for r, got_back in enumerate(subspace(means)):
                for param, grad in zip(params[r][s], got_back, strict=True):
                    param.grad = grad * samples[r][s]
        for r, trainer in enumerate(pair):
            for s, optimizer in enumerate(trainer.optimizers):
                optimizer.step(samples[r][s])
        losses.append(statistics.fmean(got))
        with torch.no_grad():
            for s, mix in enumerate(gossips):
                mix([ps[s] for ps in params], round_ + 1)
        if every is None or (round_ + 1) % every:
            continue
        partition = (round_ + 1) // every % partitions
        with torch.no_grad():
            for s, mask in enumerate(masks):
                for i, idx in enumerate(mask.indices(partition)):
                    flats = [ps[s][i].data.view(-1) for ps in params]
                    anchor = anchors[s][i]
                    if values == GradValues.FLOAT32:
                        new = (flats[0][idx] + flats[1][idx]) / 2
                    else:
                        new = anchor[idx] + reduced([f[idx] - anchor[idx] for f in flats], values)
                    for flat in flats:
                        flat[idx] = new
                    anchor[idx] = new
    report_clipped(gossips)
    return losses, statistics.fmean(bench.held_out_loss(t) for t in pair)


def crowd(bench: Bench, spec: ModelSpec, size: int, gossip: tuple[int, GradValues] | None,
          moment: bool) -> tuple[list[float], float]:
    """``size`` replicas, each stepping on every ``size``-th microbatch of each batch (with ``moment``, on the whole
    batch's estimated second moment), and with ``gossip`` mixed every step in pairs drawn at random (``Gossip``, one
    warm-started q per tensor for every pair; with ``--client-q``, as the client keeps q: a pair that met last round
    warm-starts from its own, any other from one drawn afresh): how a stage's replicas would gossip in groups of two."""
    args = bench.args
    crowd_ = [bench.trainer(spec, 1.0, args.batch_size if moment else 0) for _ in range(size)]
    params = [[o.params for o in t.optimizers] for t in crowd_]
    mixers = [Gossip([tuple(p.shape) for p in ps], *gossip, args.bound, [r[s] for r in params])
              for s, ps in enumerate(params[0])] if gossip else []
    rng = random.Random(spec.seed)
    losses = []
    partner: list[int | None] = [None] * size  # each replica's partner in the last round
    pair_qs: dict[tuple[int, int], list[list]] = {}  # each pair's qs, per stage, as it left them
    for round_ in range(args.rounds):
        chunks = microbatches(range(round_ * args.batch_size, (round_ + 1) * args.batch_size), args.microbatch_size)
        if len(chunks) % size:
            raise SystemExit(f"crowd:{size}: a batch of {len(chunks)} microbatches does not deal evenly to {size}")
        got = [accumulate(crowd_[m % size].stages, crowd_[m % size].optimizers, bench.dataset.batch(chunk))
               for m, chunk in enumerate(chunks)]
        for trainer in crowd_:
            for optimizer in trainer.optimizers:
                optimizer.step(args.batch_size // size)
        losses.append(statistics.fmean(got))
        order = rng.sample(range(size), size)
        with torch.no_grad():
            for first, second in zip(order[::2], order[1::2], strict=True):
                met = partner[first] == second
                for s, mix in enumerate(mixers):
                    if args.client_q:  # the pair's own q if it met last round, else one drawn afresh
                        mix.qs = pair_qs[first, second][s] if met else mix.drawn(round_ + 1)
                    mix([params[first][s], params[second][s]], round_ + 1)
                pair_qs[first, second] = pair_qs[second, first] = [mix.qs for mix in mixers]
                partner[first], partner[second] = second, first
    report_clipped(mixers)
    return losses, statistics.fmean(bench.held_out_loss(t) for t in crowd_)


def rule(bench: Bench, name: str, spec: ModelSpec) -> tuple[list[float], float]:
    """The training losses and held-out loss of rule ``name`` (the module docstring) from ``spec``'s weights."""
    deal = next((d for d in Deal if name.endswith(f"+{d.value}")), Deal.HALVES)
    name = name.removesuffix(f"+{deal.value}")
    name, _, subspace = name.partition("+rank")
    if subspace and not subspace.isdigit():
        raise SystemExit(f"{name}+rank{subspace!r}: expected +rankR with R a whole number, such as +rank2")
    rank = int(subspace or 0)
    moment, name = name.endswith("+moment"), name.removesuffix("+moment")
    name, _, scale = name.partition("*")
    lr_scale = float(scale or 1.0)
    kind, _, setting = name.partition(":")
    if (scale or moment or rank or deal is not Deal.HALVES) and kind in ("full", "powersgd", "ownv", "ownv-check"):
        raise SystemExit(f"{name!r}: *SCALE, +moment, +rankR and deals apply to the replicas' rules "
                         "(sparta, gossip, none)")
    if kind in ("ownv", "ownv-check"):
        if not setting.isdigit():
            raise SystemExit(f"{name!r}: expected ownv:R with R a whole number (0: the exact mean)")
        return own_moment(bench, spec, int(setting), check=kind == "ownv-check")
    if kind == "full":
        return shared(bench, spec, lambda s: lambda g: [(a + b) / 2 for a, b in zip(*g, strict=True)])
    if kind == "powersgd":
        shapes = [[tuple(p.shape) for p in stage.parameters() if p.requires_grad] for stage in build_all_stages(spec)]
        return shared(bench, spec, lambda s: PowerSGD(shapes[s], int(setting)))
    if kind == "sparta":
        every, _, rest = setting.partition("/")
        partitions, _, codec = rest.partition(":")
        if codec not in ("", "int8", "int4"):
            raise SystemExit(f"{name!r}: a slice travels in float32, int8 or int4 here")
        return replicas(bench, spec, int(every), int(partitions), GradValues(codec or "float32"), lr_scale, moment,
                        deal, rank)
    if kind == "none":
        return replicas(bench, spec, None, 1, GradValues.FLOAT32, lr_scale, moment, deal, rank)
    if kind == "crowd":
        if scale or rank or deal is not Deal.HALVES:
            raise SystemExit(f"{name!r}: a crowd takes +moment alone (each replica runs every N-th microbatch)")
        size, _, rest = setting.partition(":")
        if not size.isdigit() or int(size) % 2 or (rest and not rest.startswith("gossip:")):
            raise SystemExit(f"{name!r}: expected crowd:N or crowd:N:gossip:R[:codec], with N even")
        got_rank, _, codec = rest.removeprefix("gossip:").partition(":")
        return crowd(bench, spec, int(size), (int(got_rank), GradValues(codec or "float32")) if rest else None, moment)
    if kind == "gossip":
        got_rank, _, codec = setting.partition(":")
        if not got_rank.isdigit() or codec not in ("", "int8", "float16"):
            raise SystemExit(f"{name!r}: expected gossip:R[:int8|:float16], with R a whole number")
        gossip = (int(got_rank), GradValues(codec or "float32"))
        shapes = [[tuple(p.shape) for p in stage.parameters() if p.requires_grad] for stage in build_all_stages(spec)]
        sent = sum(Gossip(stage, *gossip).bytes_per_step() for stage in shapes)
        print(f"  {name}: {sent:,} bytes a step, 1/{4 * sum(math.prod(p) for st in shapes for p in st) / sent:.1f} of "
              "full averaging's", flush=True)
        return replicas(bench, spec, None, 1, GradValues.FLOAT32, lr_scale, moment, deal, rank, gossip)
    raise SystemExit(f"{name!r}: expected full, powersgd:R, ownv:R, sparta:EVERY/P[:int8|:int4], gossip:R, "
                     "crowd:N[:gossip:R] or none")


def spread(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rules", nargs="+", help="full, powersgd:R, ownv:R, sparta:EVERY/P[:int8|:int4], "
                                                 "gossip:R[:float16|:int8], crowd:N[:gossip:R[:codec]], none; "
                                                 "replicas' rules may end in *SCALE (the learning rate × SCALE), "
                                                 "+moment, +rankR (a rank-R subspace of the gradients averaged), and "
                                                 "+uneven or +crossed (how microbatches are dealt)")
    parser.add_argument("--bound", type=float, default=MOVE_BOUND,
                        help="gossip: the most a round moves a tensor, in multiples of the replica's own change since "
                             "its last mix (the client's, by default; inf: unbounded)")
    parser.add_argument("--client-q", action="store_true",
                        help="crowds keep q as the client does: a pair that met last round warm-starts from its own, "
                             "any other from one drawn afresh (default: one warm q for every pair)")
    parser.add_argument("--seeds", type=int, default=10, help="initialisations: N seeds from --first-seed on")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--model", choices=["psyswarm", "tiny-llama"], default="psyswarm",
                        help="psyswarm's byte-level model (--layers, --width), or the demo's tiny Llama")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--last", type=int, default=20, help="rounds averaged for the training loss")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    args = parser.parse_args()
    if args.model == "tiny-llama":
        spec, dataset = tiny_llama_run(args.seq_len)
    else:
        spec = ModelConfig(n_layers=args.layers, d_model=args.width, seq_len=args.seq_len)
        dataset = open_byte_dataset(["stdlib"], args.seq_len)
    bench = Bench(args, dataset, list(range(dataset.num_samples - 64, dataset.num_samples)))
    torch.set_num_threads(1)
    started = time.monotonic()
    gaps: dict[str, list[tuple[float, float]]] = {name: [] for name in args.rules}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        seeded = dataclasses.replace(spec, seed=seed)
        base, base_held = shared(bench, seeded, None)
        base_train = statistics.fmean(base[-args.last:])
        for name in args.rules:
            losses, held = rule(bench, name, seeded)
            gap = (statistics.fmean(losses[-args.last:]) / base_train - 1, held / base_held - 1)
            gaps[name].append(gap)
            print(f"seed {seed}  {name:20s} training {gap[0]:+.2%}  held-out {gap[1]:+.2%}", flush=True)
    print(f"\nagainst one process, over {args.seeds} seeds (mean ± standard deviation), "
          f"{time.monotonic() - started:.0f} s:")
    for name, found in gaps.items():
        train, held = zip(*found, strict=True)
        print(f"  {name:20s} training {statistics.fmean(train):+.2%} ± {spread(train):.2%}   held-out "
              f"{statistics.fmean(held):+.2%} ± {spread(held):.2%}")


if __name__ == "__main__":
    main()
