"""Benchmark: per-step gradient averaging with 2 (or ``--workers-per-stage``) workers per stage against the same
model trained in one process.

Every run trains on the same batches (the same tokens in the same order) with the real system on loopback, as
tests/benchmarks/bench_sparta.py sets it up (in-process gRPC workers, a routing trainer, hivemind averaging),
side by side:

- one process (``client/pipeline/local.py``), the reference;
- 2 workers per stage, no averaging; SPARTA only (``--sparta``); PowerGossip (``--gossip RANK[:CODEC]``: the
  parameters of each stage's pair mixed after every step, ``client.averaging.gossip``); full gradient averaging;
  PowerSGD (rank ``--rank``) and DeMo (``--demo CHUNK/TOPK``, momentum ``--demo-beta``), each with the SPARTA of
  ``--grad-sparta`` beside it (default 20/20, a run's default) in its own codec, as a run's ``grad_values`` sends
  both; with ``--undefended``, each gradient-averaging setting also without the averaging layer's defences
  (hivemind's weighted mean of the declared weights, where the defended runs reduce each part robustly and weigh
  each worker by the samples its trainer-signed Backwards prove).

Prints the loss of each (training: mean of the last rounds; held-out) against one process, and the bytes each
worker sends per step (hivemind's all-reduce messages for a group of 2, computed with hivemind's own partitioner
and serializer from the actual tensor sizes) against full gradient averaging: for PowerSGD and DeMo their
gradients' and then, since a run pays for both, those with the SPARTA beside them. Issue 25's aim: within 1 % of
one process at 1/64 of full averaging's bytes or less. DeMo's all-reduce carries the union of the group's
declared indices, at most ``group size × TOPK`` per chunk (counted at that bound), and each worker also declares
its ``TOPK`` positions per chunk (one byte each in msgpack), counted with it.

``--values int8`` (or float16 or int4, repeatable) sends PowerSGD's and DeMo's values in that codec (a run's
``grad_values``: ``client.averaging.values``), and counts their bytes so. ``--sparta-values int8`` (or int4) sends
the SPARTA-only run's slices as changes since their last average in that codec (``client.averaging.anchored``), and
prints its bytes per step beside full averaging's. ``--link 100/50`` puts every worker's averaging behind its own
emulated link of 100 Mbit/s and 50 ms round trip (``link_emulator.dht_behind_relay``; the pipeline stays on loopback),
to time each round's stepping and averaging as over the internet.

Run::

    python tests/benchmarks/bench_gradients.py [--rounds 120] [--rank 2] [--demo 64/4] [--sparta 5/20] [--values int8]

The README's figures, and the commands that printed them, are in its Figures section.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_sparta import (  # this directory
    SETTINGS,
    Run,
    allreduce_bytes_sent,
    parse_sparta,
    reference,
    stage_bytes,
    system,
)
from hivemind.utils.serializer import MSGPackSerializer
from link_emulator import parse_link  # this directory

from client.averaging import demo
from client.averaging.gossip import sent_shapes
from client.averaging.gradients import GradAveraging, GradientSettings, round_payload
from client.averaging.sparta import SpartaSettings
from client.averaging.values import GradValues
from client.data import SampleDataset, open_byte_dataset, open_dataset
from client.models.spec import HFModelSpec
from client.pipeline.model import ModelConfig, build_stage, stage_names
from client.swarm import tiny_llama
from client.swarm.demo import TINY_LLAMA_CORPUS_BYTES


def quick(matchmaking: float) -> SpartaSettings:
    """Gradient rounds run at every step: matchmaking waits ``matchmaking`` seconds (a fraction of one on
    loopback for a pair; groups of three need longer under load) and requests time out at half of it."""
    return dataclasses.replace(SETTINGS, min_matchmaking_time=matchmaking, request_timeout=matchmaking / 2,
                               matchmaking_timeout=5.0)


def gradient_bytes(config: ModelConfig, settings: GradientSettings, group_size: int,
                   gossip: bool = False) -> dict[str, tuple[int, int]]:
    """Per stage: (parameters, bytes one worker sends per step) averaging its gradients with ``settings`` (with
    ``gossip``: mixing its parameters by PowerGossip at PowerSGD's ``settings``, in a pair)."""
    out = {}
    for name in stage_names(config.num_stages):
        shapes = [tuple(p.shape) for p in build_stage(config, name).parameters() if p.requires_grad]
        carried = sent_shapes(shapes, settings) if gossip else shapes
        sent = sum(allreduce_bytes_sent([torch.zeros(n) for n in phase], group_size, settings.values)
                   for phase in round_payload(carried, settings, group_size))
        out[name] = (sum(torch.Size(s).numel() for s in shapes), sent)
    return out


def sparta_bytes(config: ModelConfig, every: int, partitions: int, group_size: int, values: GradValues) -> float:
    """Bytes one worker sends a step, on average, averaging a 1/``partitions`` slice every ``every`` steps."""
    return sum(b for _, b, _ in stage_bytes(config, partitions, group_size, values).values()) / every


def with_sparta(config: ModelConfig, schedule: tuple[int | None, int], group_size: int, values: GradValues,
                gradient: int, full: int) -> str:
    """What the SPARTA run beside a gradient-averaging run adds a step, its slices in that run's codec, and the two
    together against full averaging: a run pays for both."""
    every, partitions = schedule
    if every is None:
        return ", no SPARTA beside it"
    sparta = sparta_bytes(config, every, partitions, group_size, values)
    return (f"; with SPARTA 1/{partitions} every {every} in {values.value} ({sparta:,.0f} B a step) "
            f"{gradient + sparta:,.0f} B (1/{full / (gradient + sparta):.1f})")


def declared_index_bytes(config: ModelConfig, settings: GradientSettings) -> dict[str, int]:
    """Per stage: bytes of the indices a DeMo worker declares each step (msgpack, as hivemind gathers them)."""
    out = {}
    for name in stage_names(config.num_stages):
        counts = [demo.chunk_count(p.shape, settings.chunk) for p in build_stage(config, name).parameters()
                  if p.requires_grad]
        indices = [list(range(settings.topk)) * n for n in counts if n is not None]
        out[name] = len(MSGPackSerializer.dumps(indices))
    return out


def tiny_llama_run(seq_len: int) -> tuple[HFModelSpec, SampleDataset]:
    """The tiny Llama the demo trains (``psyswarm demo --model tiny-llama``), cut into 3 stages, and its tokenized
    corpus: prepared once (tokenizer, config, tokens) in the temporary directory and reused."""
    prepared = tiny_llama.cached(Path(tempfile.gettempdir()) / "psyswarm-bench-tiny-llama",
                                 corpus_bytes=TINY_LLAMA_CORPUS_BYTES)
    config = json.loads((prepared.model_dir / "config.json").read_text())
    return HFModelSpec(config, num_stages=3, seq_len=seq_len), open_dataset(str(prepared.tokens_dir), seq_len)


def parse_demo(text: str) -> tuple[int, int]:
    """``CHUNK/TOPK`` (DeMo: TOPK DCT coefficients sent of each CHUNK elements)."""
    chunk, _, topk = text.partition("/")
    try:
        return int(chunk), int(topk)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected CHUNK/TOPK such as 64/4") from None


def parse_gossip(text: str) -> tuple[int, GradValues]:
    """``RANK[:CODEC]``, such as ``4:int8``: PowerGossip's rank and how its factors travel (float32 by default)."""
    rank, _, values = text.partition(":")
    try:
        parsed = int(rank), GradValues(values or "float32")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK[:CODEC] such as 4:int8 (codec float32, float16 "
                                         "or int8)") from None
    if not 1 <= parsed[0] <= 64 or parsed[1] == GradValues.INT4:
        raise argparse.ArgumentTypeError(f"{text!r}: the rank must be 1..64 and the codec float32, float16 or int8")
    return parsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=120, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--rank", type=int, action="append", help="PowerSGD's rank (repeatable; default 2)")
    parser.add_argument("--demo", type=parse_demo, action="append", default=[],
                        help="DeMo's CHUNK/TOPK (repeatable; default: no DeMo run)")
    parser.add_argument("--demo-beta", type=float, action="append",
                        help=f"DeMo's momentum decay (repeatable, each with every --demo; default "
                             f"{GradientSettings.beta})")
    parser.add_argument("--values", type=GradValues, action="append",
                        help="how PowerSGD's and DeMo's values travel: float32, float16, int8 or int4 (repeatable, "
                             "each with every --rank and --demo; default float32)")
    parser.add_argument("--gossip", type=parse_gossip, action="append", default=[],
                        help="RANK[:CODEC]: also run each stage's workers mixing their parameters by PowerGossip at "
                             "that rank after every step, in float32 or that codec (a run's gossip_rank and "
                             "grad_values; repeatable; with --whole-batch-moment, each replica's Adam on the whole "
                             "batch's moment)")
    parser.add_argument("--sparta", type=parse_sparta, default=(5, 20),
                        help="EVERY/P of the SPARTA-only runs (default 5/20: Node0's 5%% every 5 steps)")
    parser.add_argument("--grad-sparta", type=parse_sparta, default=(20, 20),
                        help="EVERY/P of the SPARTA beside every gradient-averaging run, whose slices travel in that "
                             "run's codec as a run's grad_values sends both (default 20/20, a run's default; 'none')")
    parser.add_argument("--sparta-values", type=GradValues, default=GradValues.FLOAT32,
                        help="how the SPARTA-only run's slices travel: float32 (default), or float16, int8 or int4 as "
                             "changes since their last average (client.averaging.anchored)")
    parser.add_argument("--whole-batch-moment", action="store_true",
                        help="also run SPARTA with each replica's Adam on the whole batch's estimated second moment "
                             "(a run's whole_batch_moment)")
    parser.add_argument("--crossed", action="store_true",
                        help="also run that SPARTA setting (with --whole-batch-moment, the moment's) with each "
                             "stage's microbatches dealt by runtime alone, not kept to one lane of replicas")
    parser.add_argument("--model", choices=["psyswarm", "tiny-llama"], default="psyswarm",
                        help="psyswarm's byte-level model (--layers, --width), or the Llama of examples/tiny-llama "
                             "(transformers' LlamaForCausalLM: 6 layers, 64 wide, its own 2,048-token BPE), prepared "
                             "once in the temporary directory")
    parser.add_argument("--layers", type=int, default=ModelConfig.n_layers)
    parser.add_argument("--width", type=int, default=ModelConfig.d_model)
    parser.add_argument("--seq-len", type=int, default=ModelConfig.seq_len)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--last", type=int, default=20, help="rounds averaged for the final training loss")
    parser.add_argument("--workers-per-stage", type=int, default=2,
                        help="replicas per stage (the robust reduction differs from the mean from 3 on)")
    parser.add_argument("--matchmaking", type=float, default=0.3,
                        help="seconds each gradient round's matchmaking waits for groupmates")
    parser.add_argument("--link", type=parse_link,
                        help="MBIT/MS: every worker's averaging traffic through its own emulated link of MBIT Mbit/s "
                             "each way and MS ms round trip (link_emulator.py; the pipeline stays on loopback), to "
                             "time the rounds as over the internet (default: loopback)")
    parser.add_argument("--undefended", action="store_true",
                        help="also run each gradient-averaging setting without the averaging layer's defences "
                             "(hivemind's weighted mean of declared weights), for their cost side by side")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    if args.model == "tiny-llama":
        config, dataset = tiny_llama_run(args.seq_len)
    else:
        config = ModelConfig(n_layers=args.layers, d_model=args.width, seq_len=args.seq_len)
        dataset = open_byte_dataset(["stdlib"], config.seq_len)
    held_out = list(range(dataset.num_samples - args.held_out, dataset.num_samples))
    tokens = args.rounds * args.batch_size * config.seq_len
    every, partitions = args.sparta
    full = GradientSettings(GradAveraging.FULL, timeouts=quick(args.matchmaking))
    ranks = args.rank or [2]
    codecs = args.values or [GradValues.FLOAT32]
    powersgd = [GradientSettings(GradAveraging.POWERSGD, rank=rank, timeouts=quick(args.matchmaking), values=values)
                for rank in ranks for values in codecs]
    demos = [GradientSettings(GradAveraging.DEMO, chunk=chunk, topk=topk, beta=beta, timeouts=quick(args.matchmaking),
                              values=values)
             for chunk, topk in args.demo for values in codecs for beta in args.demo_beta or [GradientSettings.beta]]
    print(f"model: {config}")
    print(f"{args.rounds} rounds x {args.batch_size} samples x {config.seq_len} tokens = {tokens:,} tokens, "
          f"{args.workers_per_stage} workers per stage, {torch.get_num_threads()} torch threads", flush=True)

    started = time.monotonic()
    on_link = functools.partial(system, link=args.link)
    runs: list[Run] = [reference(config, dataset, args, held_out)]
    runs.append(on_link(config, dataset, args, held_out, None, 1))
    runs.append(on_link(config, dataset, args, held_out, every, partitions, values=args.sparta_values))
    if args.whole_batch_moment:
        runs.append(on_link(config, dataset, args, held_out, every, partitions, values=args.sparta_values, moment=True))
    if args.crossed:
        runs.append(on_link(config, dataset, args, held_out, every, partitions, values=args.sparta_values,
                           moment=args.whole_batch_moment, lanes=False))
    gossips = [GradientSettings(GradAveraging.POWERSGD, rank=rank, timeouts=quick(args.matchmaking), values=values)
               for rank, values in args.gossip]
    for settings in gossips:
        runs.append(on_link(config, dataset, args, held_out, None, 1, moment=args.whole_batch_moment, gossip=settings))
    grad_every, grad_partitions = args.grad_sparta
    for sparta, gradients in [(None, full), *((grad_every, p) for p in [*powersgd, *demos])]:
        beside = {"every": sparta, "partitions": grad_partitions if sparta else 1, "values": gradients.values}
        runs.append(on_link(config, dataset, args, held_out, gradients=gradients, **beside))
        if args.undefended:
            runs.append(on_link(config, dataset, args, held_out, gradients=gradients, defended=False, **beside))

    base = runs[0]
    print()
    print(f"loss after {tokens:,} tokens (training: mean of the last {args.last} rounds; held-out: "
          f"{args.held_out} samples; in brackets: against one process)")
    for run in runs:
        train = run.tail_loss(args.last)
        print(f"  {run.name:96s} training {train:.4f} ({train / base.tail_loss(args.last) - 1:+.2%})  "
              + "  ".join(f"{k} {v:.4f} ({v / base.held_out['model'] - 1:+.2%})" for k, v in run.held_out.items())
              + (f"  {statistics.median(run.seconds):.3f} s/round (median), {statistics.median(run.averaging):.3f} "
                 f"s of it stepping and averaging" if run.seconds else "")
              + (f", {run.link_bytes:,} B on the busiest link" if run.link_bytes else "")
              + (f"  {sum(run.shared)}/{len(run.shared)} gradient rounds shared" if run.shared else "")
              + (f"  {sum(run.mixed)}/{len(run.mixed)} gossip rounds moved their worker" if run.mixed else "")
              + (f"  [{run.lost} rounds lost]" if run.lost else ""))
        if run.busiest:
            print(f"  {'':96s} {run.deals()}")
    print()
    group = args.workers_per_stage
    print(f"bytes each worker sends per step averaging its gradients (group of {group}):")
    dense = gradient_bytes(config, full, group)
    total_full = sum(b for _, b in dense.values())
    sparta = sparta_bytes(config, every, partitions, group, args.sparta_values)
    print(f"  all stages: full {total_full:,} B, SPARTA 1/{partitions} every {every} in {args.sparta_values.value} "
          f"{sparta:,.0f} B a step on average (1/{total_full / sparta:.1f})")
    for settings in powersgd:
        compressed = gradient_bytes(config, settings, group)
        what = f"PowerSGD rank {settings.rank} in {settings.values.value}"
        for name, (params, full_bytes) in dense.items():
            print(f"  {name:6s} {params:>9,} parameters: full {full_bytes:>10,} B   {what} "
                  f"{compressed[name][1]:>9,} B   (1/{full_bytes / compressed[name][1]:.1f})")
        total = sum(b for _, b in compressed.values())
        print(f"  all stages: full {total_full:,} B, {what} {total:,} B (1/{total_full / total:.1f})"
              + with_sparta(config, args.grad_sparta, group, settings.values, total, total_full))
    for settings in gossips:
        sent = sum(b for _, b in gradient_bytes(config, settings, 2, gossip=True).values())
        print(f"  all stages: full {total_full:,} B, PowerGossip rank {settings.rank} in {settings.values.value} in a "
              f"pair {sent:,} B a step (1/{total_full / sent:.1f})")
    for settings in demos[:: len(args.demo_beta or [GradientSettings.beta])]:  # bytes do not depend on beta
        compressed, declared = gradient_bytes(config, settings, group), declared_index_bytes(config, settings)
        what = f"DeMo {settings.chunk}/{settings.topk} in {settings.values.value}"
        for name, (params, full_bytes) in dense.items():
            sent = compressed[name][1] + declared[name]
            print(f"  {name:6s} {params:>9,} parameters: full {full_bytes:>10,} B   {what} at most "
                  f"{compressed[name][1]:>9,} B + {declared[name]:,} B of indices   (1/{full_bytes / sent:.1f})")
        total = sum(b for _, b in compressed.values()) + sum(declared.values())
        print(f"  all stages: full {total_full:,} B, {what} at most {total:,} B with its indices "
              f"(1/{total_full / total:.1f})"
              + with_sparta(config, args.grad_sparta, group, settings.values, total, total_full))
    print(f"\n{time.monotonic() - started:.0f} s in all", flush=True)


if __name__ == "__main__":
    main()
