"""Benchmark: a tiny Llama through the pipeline, against the same model in one process; wire bytes; worker memory.

Prints, measured in the same run on this machine:
1. tokens/s of a tiny Llama (``transformers``' LlamaForCausalLM cut into 3 stages by ``client.models``) trained
   through the pipeline (one worker process per stage with its gRPC server, announced on a loopback DHT; the
   trainer here) and trained in one process with the same stages and optimizer (``LocalTrainer``), and their
   ratio, with the run's wire codec float32 and bfloat16 (a set of workers for each: a run has one codec). Rounds
   interleave the four measurements so that all see the same background load (this machine is shared); the
   ratio is given between the best rounds and as the median of same-round ratios, the single process taken at
   the faster of torch's default thread count and one thread.
2. bytes on the wire per token with either codec;
3. a worker's memory for a 12-layer Llama cut into 3 and into 6 stages: each stage's parameter, gradient and AdamW
   bytes,
   and each worker process's peak resident memory (``VmHWM``) after a few training steps, beside that of a
   process that imported the same libraries and holds no stage.

Run::

    python tests/benchmarks/bench_models.py [--rounds 3] [--batches 4] [--skip-memory]

Everything runs on the CPU in float32 (``client.pipeline.device``): this script was written on a machine without a
GPU, and its single-process reference has no device option.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager

import numpy as np
import torch

from client.models import HFModelSpec
from client.pipeline.discovery import WorkerDirectory, start_dht
from client.pipeline.local import LocalTrainer
from client.pipeline.trainer import PipelineTrainer
from client.pipeline.worker import run_worker

SEQ_LEN = 128


def llama(layers: int, hidden: int, heads: int, vocab: int, stages: int) -> HFModelSpec:
    """A Llama built from its config (a fresh initialisation from seed 0: nothing is downloaded)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), intermediate_size=hidden * 8 // 3 // 8 * 8,
                         max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    return HFModelSpec(config.to_dict(), num_stages=stages, seq_len=SEQ_LEN, seed=0)


class RandomTokens:
    """Sample ``i``: SEQ_LEN + 1 token ids from NumPy's frozen stream of seed ``i`` (throughput does not depend on
    what the tokens say)."""

    name = fingerprint = "random"
    num_samples = 1 << 30

    def __init__(self, vocab: int, seq_len: int = SEQ_LEN) -> None:
        self.vocab, self.seq_len = vocab, seq_len

    def sample(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.random.RandomState(index).randint(0, self.vocab, self.seq_len + 1).astype(np.int64))

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.stack([self.sample(i) for i in indices])


@contextmanager
def swarm(spec: HFModelSpec, *, batch: int, codec: str, threads: int):
    """Worker processes for every stage of ``spec`` on a fresh loopback DHT; yields (directory, run id, pids)."""
    dht = start_dht()
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    peers = [str(a) for a in dht.get_visible_maddrs()]
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_worker, args=(spec, stage), kwargs=dict(
        initial_peers=peers, run_id=run_id, torch_threads=threads, auto_step_samples=batch, max_batch_size=batch,
        wire_codec=codec, device="cpu")) for stage in spec.stage_names()]
    for process in processes:
        process.start()
    directory = WorkerDirectory(dht, run_id, spec.fingerprint())
    try:
        deadline = time.monotonic() + 300
        while not all(directory.workers(stage) for stage in spec.stage_names()):
            if time.monotonic() > deadline or not all(p.is_alive() for p in processes):
                raise SystemExit("the workers did not come up")
            time.sleep(0.2)
        yield directory, run_id, [p.pid for p in processes]
    finally:
        for process in processes:
            os.kill(process.pid, signal.SIGTERM)
        for process in processes:
            process.join(30)
        dht.shutdown()


class Batches:
    """Consecutive sample ranges, never reused (a worker refuses a sample twice in one step)."""

    def __init__(self, size: int) -> None:
        self.size, self.next = size, 0

    def take(self, count: int) -> list[int]:
        start, self.next = self.next, self.next + count * self.size
        return list(range(start, self.next))


def throughput(args: argparse.Namespace) -> None:
    spec = llama(layers=6, hidden=128, heads=4, vocab=4096, stages=3)
    data = RandomTokens(spec.vocab)
    tokens_per_batch = args.batch_size * SEQ_LEN
    default_threads = torch.get_num_threads()
    print(f"tiny Llama: 6 layers, hidden 128, 4 heads (2 KV), vocab 4096, seq {SEQ_LEN}, 3 stages; batch "
          f"{args.batch_size}, microbatch {args.microbatch_size}, {args.inflight} in flight; {os.cpu_count()} CPUs")
    local = LocalTrainer(spec, data)
    batches = Batches(args.batch_size)

    def run_local(count: int, threads: int) -> float:
        torch.set_num_threads(threads)
        try:
            started = time.perf_counter()
            for _ in range(count):
                local.train(batches.take(1), args.microbatch_size)
                local.step()
            return count * tokens_per_batch / (time.perf_counter() - started)
        finally:
            torch.set_num_threads(default_threads)

    codecs = ("float32", "bfloat16")
    rates: dict[str, list[float]] = {"local": [], "local 1 thread": [], **{codec: [] for codec in codecs}}
    with ExitStack() as stack:
        trainers = {}
        for codec in codecs:  # both swarms at once, so that every round measures all four under the same load
            directory, run_id, _ = stack.enter_context(
                swarm(spec, batch=args.batch_size, codec=codec, threads=args.worker_threads))
            trainers[codec] = PipelineTrainer(spec, data, directory, run_id=run_id, max_inflight=args.inflight,
                                              wire_codec=codec)
            stack.callback(trainers[codec].close)

        def run_pipeline(codec: str, count: int) -> float:
            started = time.perf_counter()
            trainers[codec].train(batches.take(count), args.microbatch_size)
            return count * tokens_per_batch / (time.perf_counter() - started)

        for codec in codecs:
            run_pipeline(codec, 1)  # warm-up: allocator, thread pools, gRPC channels
        before = {codec: t.bytes_sent + t.bytes_received for codec, t in trainers.items()}
        for round_ in range(args.rounds):
            rates["local"].append(run_local(args.batches, default_threads))
            rates["local 1 thread"].append(run_local(args.batches, 1))
            for codec in codecs:
                rates[codec].append(run_pipeline(codec, args.batches))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()) + " tokens/s",
                  flush=True)
        measured = args.rounds * args.batches * tokens_per_batch
        wire = {codec: (t.bytes_sent + t.bytes_received - before[codec]) / measured for codec, t in trainers.items()}
    best_local = max(rates["local"] + rates["local 1 thread"])
    print()
    print(f"single process          : {best_local:8.0f} tokens/s (best round, {default_threads} threads or 1)")
    for codec in codecs:
        best = max(rates[codec])
        per_round = sorted(r / max(a, b) for r, a, b in zip(rates[codec], rates["local"], rates["local 1 thread"],
                                                            strict=True))
        print(f"pipeline, {codec:8} wire : {best:8.0f} tokens/s   ratio {best / best_local:.2f} of the best "
              f"rounds, {per_round[len(per_round) // 2]:.2f} median of same-round ratios (aim >= 0.7)")
    print(f"wire bytes per token    : float32 {wire['float32']:.0f} B, bfloat16 {wire['bfloat16']:.0f} B "
          f"(hidden {spec.d_model})")


def peak_rss_mib(pid: int) -> float:
    """A process's peak resident set (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def baseline_rss_mib() -> float:
    """Peak resident memory of a process that imports what a worker imports and holds no stage."""
    code = ("import client.pipeline.worker, client.models.stages, transformers, hivemind, resource; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) / 1024


def memory(args: argparse.Namespace) -> None:
    print()
    print("12-layer Llama: hidden 512, 8 heads (4 KV), vocab 8192, seq 128; a stage's parameters, gradients and "
          "AdamW state (fp32), and each worker's peak RSS after 2 optimizer steps")
    baseline = baseline_rss_mib()
    print(f"a process with a worker's imports and no stage: peak RSS {baseline:.0f} MiB")
    largest: dict[int, tuple[float, float]] = {}
    for stages in (3, 6):
        spec = llama(layers=12, hidden=512, heads=8, vocab=8192, stages=stages)
        held = {name: sum(p.numel() * p.element_size() for p in spec.build_stage(name).parameters())
                for name in spec.stage_names()}
        with swarm(spec, batch=4, codec="float32", threads=1) as (directory, run_id, pids):
            trainer = PipelineTrainer(spec, RandomTokens(spec.vocab), directory, run_id=run_id, max_inflight=2)
            try:
                trainer.train(range(8), microbatch_size=2)  # 2 steps of 4 samples: the AdamW state exists
            finally:
                trainer.close()
            rss = {name: peak_rss_mib(pid) for name, pid in zip(spec.stage_names(), pids, strict=True)}
        for name in spec.stage_names():
            print(f"  {stages} stages, {name:6}: parameters {held[name] / 2**20:5.1f} MiB, + gradients + AdamW "
                  f"{4 * held[name] / 2**20:6.1f} MiB, peak RSS {rss[name]:5.0f} MiB")
        worst = max(spec.stage_names(), key=lambda n: rss[n])
        largest[stages] = (4 * held[max(held, key=held.get)] / 2**20, rss[worst])
    (state3, rss3), (state6, rss6) = largest[3], largest[6]
    print(f"largest worker, 6 stages vs 3: parameters + gradients + AdamW {state6:.0f} / {state3:.0f} MiB = "
          f"{state6 / state3:.2f}; peak RSS {rss6:.0f} / {rss3:.0f} MiB = {rss6 / rss3:.2f}, "
          f"{(rss6 - baseline) / (rss3 - baseline):.2f} above the no-stage process (approximate)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds")
    parser.add_argument("--batches", type=int, default=4, help="batches per measurement")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight in the pipeline")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--skip-memory", action="store_true", help="only the throughput and wire figures")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    throughput(args)
    if not args.skip_memory:
        memory(args)


if __name__ == "__main__":
    main()
