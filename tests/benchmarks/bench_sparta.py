"""Benchmark: SPARTA with 2 workers per stage against the same model trained in one process.

Both train on the same batches (the same tokens, in the same order). The system is the real thing on
loopback: in-process ``StageWorker``s (two per stage, gRPC), a ``PipelineTrainer`` routing microbatches
between replicas, each worker stepping its own AdamW on the samples it saw, and every EVERY steps each stage
averaging one SPARTA partition (p = 1/P) through hivemind, weighted by the samples each worker processed since
the last averaging round. Prints:

- the training loss (mean of the last rounds) and held-out loss of both, and their relative difference
  (aim: within 5 %); held-out loss for each replica chain and for the replicas' mean;
- bytes each worker sends per averaging round, SPARTA slice against the full stage: hivemind's all-reduce
  messages (protobuf, before libp2p framing) for a group of ``--workers-per-stage``, computed with
  hivemind's own partitioner and serializer from the actual slice sizes.

Run::

    python tests/benchmarks/bench_sparta.py [--rounds 300] [--sparta 20/20 --sparta 5/20 --sparta none …]

Each ``--sparta EVERY/P`` adds a run of the system (default: 20/20, the seeds' setting); ``none`` runs it
without any averaging, to show what SPARTA buys. ``--values int8`` (or float16 or int4; repeatable, float32 when left
out) runs every SPARTA setting with its slices sent in that codec, as changes since their last average (a run's
``grad_values``: ``client.averaging.anchored``), and counts their bytes so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from bench_robust import weighted_mean  # this directory
from link_emulator import Link, Relay, dht_behind_relay  # this directory
from solders.keypair import Keypair

from client.averaging import runner
from client.averaging.gossip import GossipAverager
from client.averaging.gradients import GradientAverager, GradientSettings
from client.averaging.membership import Roster
from client.averaging.sparta import (
    AveragingResult,
    AveragingStatus,
    SpartaAverager,
    SpartaMasks,
    SpartaSettings,
    averaging_index,
)
from client.averaging.values import GradValues, codec
from client.data import ByteDataset, open_byte_dataset
from client.pipeline.discovery import WorkerDirectory, start_dht
from client.pipeline.local import LocalTrainer
from client.pipeline.model import ModelConfig, build_stage, stage_names
from client.pipeline.optim import OptimizerConfig, StepStats
from client.pipeline.router import StageFinder
from client.pipeline.trainer import PipelineError, PipelineTrainer
from client.pipeline.worker import StageWorker

SETTINGS = SpartaSettings(min_matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=5.0,
                          allreduce_timeout=20.0, chunk_timeout=5.0)


T = TypeVar("T")

@dataclass
class Run:
    name: str
    losses: list[float] = field(default_factory=list)  # training loss per round
    held_out: dict[str, float] = field(default_factory=dict)
    crossed: int = 0  # stage passes whose backward ran on another replica than their forward
    lost: int = 0  # rounds the trainer gave up on (a worker's admission bound kept refusing a loss spike)
    passes: int = 0
    rounds: list[AveragingResult] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # wall time per round: training, stepping, averaging
    averaging: list[float] = field(default_factory=list)  # of which stepping (gradients averaged) and SPARTA
    link_bytes: int = 0  # with a link: the most any worker's link carried in one direction
    shared: list[bool] = field(default_factory=list)  # per worker and step: whether its gradient round was shared
    mixed: list[bool] = field(default_factory=list)  # per worker and step: whether its gossip round moved it
    busiest: list[float] = field(default_factory=list)  # per stage and step: the busiest replica's share of it
    even: list[bool] = field(default_factory=list)  # per stage-step: no replica over a microbatch ahead of another
    lanes: list[bool] = field(default_factory=list)  # per microbatch: every stage ran on its replicas' same position

    def deals(self) -> str:
        """How evenly the trainer shared out each stage's steps among its replicas, and how many microbatches kept
        to one lane (the i-th replica of every stage, in uid order: ``client.pipeline.router``)."""
        return (f"{sum(self.even)} of {len(self.even)} stage-steps shared evenly, the busiest replica's share "
                f"{statistics.fmean(self.busiest):.2f} on average; {sum(self.lanes)} of {len(self.lanes)} "
                f"microbatches kept one lane") if self.busiest else ""

    def tail_loss(self, last: int) -> float:
        return statistics.fmean(self.losses[-last:])


def batch(round_: int, size: int) -> list[int]:
    return list(range(round_ * size, (round_ + 1) * size))


def evaluate(stages: list[torch.nn.Module], dataset: ByteDataset, indices: list[int]) -> float:
    with torch.no_grad():
        tokens = dataset.batch(indices)
        hidden = tokens[:, :-1]
        for stage in stages[:-1]:
            hidden = stage(hidden)
        return float(stages[-1](hidden, tokens[:, 1:]))


def reference(config: ModelConfig, dataset: ByteDataset, args: argparse.Namespace, held_out: list[int]) -> Run:
    run = Run("one process")
    local = LocalTrainer(config, dataset, OptimizerConfig(lr=args.lr))
    for round_ in range(args.rounds):
        losses = local.train(batch(round_, args.batch_size), args.microbatch_size)
        local.step()
        run.losses.append(statistics.fmean(losses))
    run.held_out["model"] = evaluate(local.stages, dataset, held_out)
    return run


@contextlib.contextmanager
def undefended() -> Iterator[None]:
    """Reducers take hivemind's weighted mean instead of ``robust_mean`` (no weight cap, no clipping), for
    averagers created inside: each forks its hivemind process, which keeps the module as it was at the fork. (The
    audits still recompute ``robust_mean``: with two workers per stage, the default, it is the weighted mean.)"""
    defended = runner.reduce_blocks
    runner.reduce_blocks = lambda parts, weights: weighted_mean(list(parts), list(weights))
    try:
        yield
    finally:
        runner.reduce_blocks = defended


@contextlib.contextmanager
def crossed() -> Iterator[None]:
    """The trainer's routers deal each stage by runtime alone, as before lanes (``client.pipeline.router``): most
    microbatches cross from one replica's chain to another's."""
    lane = StageFinder.lane
    StageFinder.lane = lambda self, stage, after: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        StageFinder.lane = lane  # type: ignore[method-assign]


def system(config: ModelConfig, dataset: ByteDataset, args: argparse.Namespace, held_out: list[int],
           every: int | None, partitions: int, gradients: GradientSettings | None = None,
           defended: bool = True, values: GradValues = GradValues.FLOAT32, moment: bool = False,
           lanes: bool = True, link: Link | None = None, gossip: GradientSettings | None = None) -> Run:
    """The pipeline with ``--workers-per-stage`` replicas per stage; SPARTA p = 1/``partitions`` every ``every``
    steps (None: never); with ``gradients``, the stage's workers also average their gradients before every step
    (``client.averaging.gradients``, used by tests/benchmarks/bench_gradients.py), with the averaging layer's
    defences (robust reduction, weights from the trainer's signed Backwards) or, ``defended`` False, without
    (hivemind's weighted mean of the declared weights); SPARTA's slices travel in ``values``; with ``moment`` each
    replica's Adam steps on the whole batch's estimated second moment (a run's ``whole_batch_moment``); without
    ``lanes`` each stage's microbatches are dealt by runtime alone (``crossed``); with ``link``, every worker's
    averaging traffic comes in through its own emulated link (``link_emulator``: its DHT, whose daemon its averagers
    share, announces a relay in front of it), while the pipeline's stays on loopback; with ``gossip`` (PowerSGD's
    settings: the rank and codec), each stage's workers mix their parameters in pairs after every step
    (``client.averaging.gossip``), as a run with ``gossip_rank`` does."""
    with contextlib.nullcontext() if defended else undefended(), contextlib.nullcontext() if lanes else crossed():
        run = _system(config, dataset, args, held_out, every, partitions, gradients, defended, values, moment, link,
                      gossip)
    if not lanes:
        run.name += ", crossed"
    return run


def _system(config: ModelConfig, dataset: ByteDataset, args: argparse.Namespace, held_out: list[int],
            every: int | None, partitions: int, gradients: GradientSettings | None, defended: bool,
            values: GradValues, moment: bool, link: Link | None, gossip: GradientSettings | None = None) -> Run:
    replicas_name = f"{args.workers_per_stage} workers/stage"
    if gradients is not None:
        rank = (f" rank {gradients.rank}" if gradients.rank else
                f" {gradients.chunk}/{gradients.topk} beta {gradients.beta:g}" if gradients.chunk else "")
        sent_as = "" if gradients.values == GradValues.FLOAT32 else f" in {gradients.values.value}"
        replicas_name += f", {gradients.mode.value}{rank} gradient averaging{sent_as}"
        if defended:
            gradients = dataclasses.replace(gradients, round_samples=args.batch_size, max_weight=args.batch_size)
        else:
            replicas_name += " (undefended)"
    in_codec = "" if values == GradValues.FLOAT32 else f" in {values.value}"
    if gossip is not None:
        sent_as = "" if gossip.values == GradValues.FLOAT32 else f" in {gossip.values.value}"
        replicas_name += f", PowerGossip rank {gossip.rank} every step{sent_as}"
    run = Run((f"{replicas_name}, SPARTA 1/{partitions} every {every}{in_codec}" if every else
               f"{replicas_name}, no SPARTA" if gradients or gossip else f"{replicas_name}, no averaging")
              + (", whole-batch moment" if moment else ""))
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    bootstrap = start_dht()
    peers = [str(a) for a in bootstrap.get_visible_maddrs()]
    names = stage_names(config.num_stages)
    relays: list[Relay] = []
    dhts = [start_dht(peers) if link is None else dht_behind_relay(peers, link, relays)
            for _ in range(len(names) * args.workers_per_stage)]  # one per worker (peer id)
    optimizer = OptimizerConfig(lr=args.lr, whole_batch=args.batch_size if moment else 0)
    workers = {s: [StageWorker(config, s, run_id=run_id, index=i, optimizer=optimizer,
                               dht=dhts[j * args.workers_per_stage + i], max_batch_size=args.microbatch_size)
                   for i in range(args.workers_per_stage)] for j, s in enumerate(names)}
    averagers = {}
    trainer_key = Keypair()
    rosters = {s: Roster(0, frozenset(w.pubkey for w in replicas), frozenset({bytes(trainer_key.pubkey())}))
               for s, replicas in workers.items()}
    if every:  # before the workers serve: each averager forks hivemind's process
        averagers = {w.uid: SpartaAverager.for_worker(w, w.dht, partitions=partitions, seed=config.seed,
                                                      roster=functools.partial(lambda s: rosters[s], s),
                                                      settings=SETTINGS, values=values)
                     for s, replicas in workers.items() for w in replicas}
    grad_averagers: list[GradientAverager] = []
    gossipers = {w.uid: GossipAverager.for_worker(w, w.dht, seed=config.seed, settings=gossip,
                                                  roster=functools.partial(lambda s: rosters[s], s))
                 for s, replicas in workers.items() for w in replicas} if gossip is not None else {}
    current = {"round": 0}
    if gradients is not None:
        for replicas in workers.values():
            for w in replicas:
                grad_averagers.append(GradientAverager.for_worker(
                    w, w.dht, seed=config.seed, settings=gradients,
                    roster=functools.partial(lambda s: rosters[s], w.stage)))
                w.compute.optimizer.gradient_exchange = grad_averagers[-1].exchange(
                    lambda: current["round"], float, work_of=functools.partial(lambda w: w.compute.work, w))
    directory = WorkerDirectory(bootstrap, run_id, config.fingerprint())
    trainer = PipelineTrainer(config, dataset, directory, run_id=run_id, max_inflight=args.inflight, refresh_period=1.0,
                              keypair=trainer_key)
    samples = {w.uid: 0 for replicas in workers.values() for w in replicas}
    lane = {uid: i for replicas in workers.values() for i, uid in enumerate(sorted(w.uid for w in replicas))}
    try:
        for replicas in workers.values():
            for worker in replicas:
                worker.start()
        while not all(len(directory.workers(s)) == args.workers_per_stage for s in names):
            time.sleep(0.2)
        for round_ in range(args.rounds):
            round_started = time.perf_counter()
            try:
                result = trainer.train(batch(round_, args.batch_size), args.microbatch_size)
            except PipelineError as exc:  # the workers still step on what they accumulated, as the swarm does
                run.lost += 1
                print(f"  {run.name}: round {round_ + 1} lost: {exc}", flush=True)
            else:
                run.losses.append(statistics.fmean(result.losses))
                for micro in result.microbatches:
                    run.passes += len(micro.forward_workers)
                    run.crossed += sum(micro.workers[s] != uid for s, uid in micro.forward_workers.items())
                    run.lanes.append(len({lane[uid] for uid in micro.workers.values()}) == 1)
            for replicas in workers.values():
                for worker in replicas:
                    samples[worker.uid] += sum(r.sample_end - r.sample_start for r in worker.drain_receipts())
            current["round"] = round_
            averaging_started = time.perf_counter()
            stepped = step_all([w for replicas in workers.values() for w in replicas])
            for replicas in workers.values():
                counts = [stepped[w.uid].samples for w in replicas]
                if sum(counts):
                    run.busiest.append(max(counts) / sum(counts))
                    run.even.append(max(counts) - min(counts) < 2 * args.microbatch_size)
            run.shared += [a.last is not None and a.last.round == round_ and a.last.shared for a in grad_averagers]
            if gossipers:
                run.mixed += [found.moved for found in all_at_once(workers, lambda w, peers, i=round_ + 1: gossipers[
                    w.uid].mix([p for p in w.compute.module.parameters() if p.requires_grad], i, peers=peers,
                                                  lock=w.compute.lock))]
            index = averaging_index(round_ + 1, every) if every else None
            if index is not None:
                run.rounds += all_at_once(workers, lambda w, peers, i=index, got=samples: averagers[
                    w.uid].average(i, float(got[w.uid]), peers=peers))
                samples = dict.fromkeys(samples, 0)
            run.seconds.append(time.perf_counter() - round_started)
            run.averaging.append(time.perf_counter() - averaging_started)
            if (round_ + 1) % 50 == 0:
                print(f"  {run.name}: round {round_ + 1}, loss {statistics.fmean(run.losses[-50:]):.4f}", flush=True)
        modules = {s: [w.compute.module for w in replicas] for s, replicas in workers.items()}
        for r in range(args.workers_per_stage):
            run.held_out[f"replica chain {r}"] = evaluate([modules[s][r] for s in names], dataset, held_out)
        mean_stages = []
        for s in names:
            stage = build_stage(config, s)
            states = [m.state_dict() for m in modules[s]]
            stage.load_state_dict({k: torch.stack([st[k] for st in states]).mean(0) for k in states[0]})
            mean_stages.append(stage)
        run.held_out["replicas' mean"] = evaluate(mean_stages, dataset, held_out)
    finally:
        trainer.close()
        for replicas in workers.values():
            for worker in replicas:
                worker.stop(grace=0)
        for averager in [*averagers.values(), *grad_averagers, *gossipers.values()]:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        bootstrap.shutdown()
        run.link_bytes = max((relay.busiest_direction_bytes for relay in relays), default=0)
        for relay in relays:
            relay.stop()
    return run


def step_all(workers: list[StageWorker]) -> dict[str, StepStats]:
    """Every worker steps at once, as the swarm's do when a round ends (gradient averaging waits for peers)."""
    stepped: dict[str, StepStats] = {}

    def step(worker: StageWorker) -> None:
        stepped[worker.uid] = worker.step()

    threads = [threading.Thread(target=step, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return stepped


def all_at_once(workers: dict[str, list[StageWorker]], round_of: Callable[[StageWorker, int], T]) -> list[T]:
    """Every worker of every stage runs its round (``round_of(worker, its stage's other workers)``) at once, as the
    swarm's do between rounds."""
    results: list[T] = []
    lock = threading.Lock()

    def one(worker: StageWorker, peers: int) -> None:
        outcome = round_of(worker, peers)
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one, args=(w, len(replicas) - 1))
               for replicas in workers.values() for w in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def allreduce_bytes_sent(buffers: list[torch.Tensor], group_size: int,
                        values: GradValues = GradValues.FLOAT32) -> int:
    """Bytes of the all-reduce messages one peer sends in a group of ``group_size`` equal peers, its values in the
    codec ``values``: its parts to every other reducer, and the averaged parts of its own shard back to every other
    peer (in parts of the averagers' ``PART_BYTES``)."""
    from hivemind.averaging.partition import TensorPartContainer
    from hivemind.proto import averaging_pb2

    from client.averaging.stage_averager import PART_BYTES

    compression = codec(values)

    def sizes(peer: int) -> list[int]:
        container = TensorPartContainer(buffers, (1.0,) * group_size, compression=compression,
                                        part_size_bytes=PART_BYTES)
        return [averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"\0" * 20,
                                            tensor_part=compression.compress(part, None), weight=1.0).ByteSize()
                for part in container.get_raw_input_parts(peer)]

    me = 0
    to_reducers = sum(sum(sizes(peer)) for peer in range(group_size) if peer != me)
    results_back = (group_size - 1) * sum(sizes(me))
    return to_reducers + results_back


def stage_bytes(config: ModelConfig, partitions: int, group_size: int,
                values: GradValues = GradValues.FLOAT32) -> dict[str, tuple[int, int, int]]:
    """Per stage: (parameters, bytes sent per SPARTA round in ``values``, bytes sent averaging the full stage in
    float32)."""
    out = {}
    for name in stage_names(config.num_stages):
        module = build_stage(config, name)
        named = [(n, p.numel()) for n, p in module.named_parameters()]
        sparse = SpartaMasks(named, partitions, config.seed)
        full = SpartaMasks(named, 1, config.seed)
        out[name] = (sum(n for _, n in named),
                     allreduce_bytes_sent([torch.zeros(s) for s in sparse.slice_sizes], group_size, values),
                     allreduce_bytes_sent([torch.zeros(s) for s in full.slice_sizes], group_size))
    return out


def parse_sparta(text: str) -> tuple[int | None, int]:
    """``EVERY/P`` (SPARTA p = 1/P every EVERY steps) or ``none`` (replicas never averaged)."""
    if text == "none":
        return None, 1
    every, _, partitions = text.partition("/")
    try:
        parsed = int(every), int(partitions)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected EVERY/P such as 20/20, or none") from None
    if min(parsed) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: EVERY and P must be at least 1")
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="optimizer steps (coordinator rounds)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=4, help="microbatches in flight in the pipeline")
    parser.add_argument("--sparta", type=parse_sparta, action="append",
                        help="EVERY/P: average p = 1/P of each stage every EVERY steps (repeatable; 'none' for no "
                             "averaging). Default: 20/20, the seeds' sparta_every and sparta_partitions")
    parser.add_argument("--workers-per-stage", type=int, default=2)
    parser.add_argument("--layers", type=int, default=ModelConfig.n_layers, help="transformer layers")
    parser.add_argument("--width", type=int, default=ModelConfig.d_model, help="d_model")
    parser.add_argument("--seq-len", type=int, default=ModelConfig.seq_len, help="tokens per sample")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--held-out", type=int, default=64, help="held-out samples for the final loss")
    parser.add_argument("--last", type=int, default=50, help="rounds averaged for the final training loss")
    parser.add_argument("--values", type=GradValues, action="append",
                        help="how SPARTA's slices travel: float32, or float16, int8 or int4 as changes since their "
                             "last average (repeatable, each with every --sparta; default float32)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    setups = args.sparta or [(20, 20)]
    codecs = args.values or [GradValues.FLOAT32]

    config = ModelConfig(n_layers=args.layers, d_model=args.width, seq_len=args.seq_len)
    dataset = open_byte_dataset(["stdlib"], config.seq_len)
    held_out = list(range(dataset.num_samples - args.held_out, dataset.num_samples))
    tokens = args.rounds * args.batch_size * config.seq_len
    print(f"model: {config}")
    print(f"{args.rounds} rounds x {args.batch_size} samples x {config.seq_len} tokens = {tokens:,} tokens, "
          f"{args.workers_per_stage} workers per stage, {torch.get_num_threads()} torch threads", flush=True)

    runs = [reference(config, dataset, args, held_out)]
    runs += [system(config, dataset, args, held_out, every, partitions, values=values)
             for every, partitions in setups for values in (codecs if every else [GradValues.FLOAT32])]

    base = runs[0]
    print()
    print(f"loss after {tokens:,} tokens (training: mean of the last {args.last} rounds; held-out: "
          f"{args.held_out} samples; in brackets: against one process)")
    for run in runs:
        train = run.tail_loss(args.last)
        print(f"  {run.name:40s} training {train:.4f} ({train / base.tail_loss(args.last) - 1:+.2%})  "
              + "  ".join(f"{k} {v:.4f} ({v / base.held_out['model'] - 1:+.2%})" for k, v in run.held_out.items()))
        if run.passes:
            print(f"  {'':40s} {run.crossed / run.passes:.0%} of forward passes had their backward on the other "
                  f"replica; {run.deals()}")
        if run.rounds:
            averaged = sum(r.status == AveragingStatus.AVERAGED for r in run.rounds)
            print(f"  {'':40s} {averaged} of {len(run.rounds)} worker-rounds averaged, "
                  f"{statistics.fmean(r.seconds for r in run.rounds):.2f} s per round on average")
    for partitions in sorted({p for every, p in setups if every}):
        for values in codecs:
            print()
            print(f"bytes each worker sends per averaging round, p = 1/{partitions} in {values.value}, group of "
                  f"{args.workers_per_stage}:")
            for name, (params, sparse, full) in stage_bytes(config, partitions, args.workers_per_stage,
                                                            values).items():
                print(f"  {name:6s} {params:>9,} parameters: SPARTA {sparse:>10,} B   full stage {full:>10,} B   "
                      f"(1/{full / sparse:.1f})")


if __name__ == "__main__":
    main()
