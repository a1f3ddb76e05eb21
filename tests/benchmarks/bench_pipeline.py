"""Benchmark: the 3-stage pipeline on this machine against the same model trained in one process.

Prints tokens per second of both, measured in the same run, their ratio, and the bytes on the wire per
token (fp32 activations; every codec, and a shaped link, in ``bench_wire.py``). Each worker is a separate
process (as on separate machines) holding one stage, announced on a loopback DHT; the trainer runs here. Run::

    python tests/benchmarks/bench_pipeline.py [--batches 6] [--inflight 3] [--worker-threads 1]

Numbers on a shared machine are noisy: the two measurements are interleaved (local, pipeline, local,
pipeline…) so that both see the same background load, and the best of the rounds is reported. The
single process is measured with torch's default thread count and with one thread, and the ratio is taken
against the faster: with OpenMP, a busy neighbour on one core can make a multi-threaded process many times
slower, and that must not flatter the pipeline.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import time
import uuid

import torch

from client.data import open_byte_dataset
from client.pipeline.discovery import WorkerDirectory, start_dht
from client.pipeline.local import LocalTrainer
from client.pipeline.model import ModelConfig, stage_names
from client.pipeline.trainer import PipelineTrainer
from client.pipeline.worker import run_worker


def spawn_workers(config: ModelConfig, peers: list[str], run_id: str, threads: int, batch: int,
                  codec: str = "float32") -> list:
    context = multiprocessing.get_context("spawn")
    processes = []
    for stage in stage_names(config.num_stages):
        process = context.Process(
            target=run_worker,
            args=(config, stage),
            kwargs={
                "initial_peers": peers,
                "run_id": run_id,
                "torch_threads": threads,
                "auto_step_samples": batch,
                "max_batch_size": batch,
                "wire_codec": codec,
            },
        )
        process.start()
        processes.append(process)
    return processes


def wait_for_workers(directory: WorkerDirectory, stages: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(directory.workers(s) for s in stages):
        if time.monotonic() > deadline:
            raise SystemExit("workers did not announce themselves in time")
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=6, help="batches per measurement round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=3, help="microbatches in flight in the pipeline")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads per worker process")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    config = ModelConfig()
    default_threads = torch.get_num_threads()
    tokens_per_batch = args.batch_size * config.seq_len
    dataset = open_byte_dataset(["stdlib"], config.seq_len)
    print(f"model: {config}")
    print(
        f"batch {args.batch_size} x {config.seq_len} tokens, microbatch {args.microbatch_size}, "
        f"{args.inflight} in flight, {args.worker_threads} torch thread(s) per worker, "
        f"{torch.get_num_threads()} for the single process, {os.cpu_count()} CPUs"
    )

    dht = start_dht()
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    peers = [str(a) for a in dht.get_visible_maddrs()]
    workers = spawn_workers(config, peers, run_id, args.worker_threads, args.batch_size)
    directory = WorkerDirectory(dht, run_id, config.fingerprint())
    trainers = {"float32": PipelineTrainer(config, dataset, directory, run_id=run_id, max_inflight=args.inflight)}
    local = LocalTrainer(config, dataset)
    try:
        wait_for_workers(directory, stage_names(config.num_stages))
        next_index = 0

        def batches(count: int) -> list[range]:
            nonlocal next_index
            ranges = [
                range(next_index + i * args.batch_size, next_index + (i + 1) * args.batch_size) for i in range(count)
            ]
            next_index += count * args.batch_size
            return ranges

        def run_local(count: int, threads: int) -> float:
            torch.set_num_threads(threads)
            try:
                started = time.perf_counter()
                for indices in batches(count):
                    local.train(indices, args.microbatch_size)
                    local.step()
                return count * tokens_per_batch / (time.perf_counter() - started)
            finally:
                torch.set_num_threads(default_threads)

        def run_pipeline(dtype: str, count: int) -> float:
            # One call for all batches, as a trainer gets a round's whole assignment: the pipeline stays
            # full across batch boundaries, and each worker steps every batch_size samples on its own.
            indices = [i for batch in batches(count) for i in batch]
            started = time.perf_counter()
            trainers[dtype].train(indices, args.microbatch_size)
            return count * tokens_per_batch / (time.perf_counter() - started)

        run_local(1, default_threads)  # warm-up: allocator, thread pools, gRPC channels
        run_pipeline("float32", 1)
        local_rates, single_rates, pipe_rates = [], [], []
        bytes_before = {d: t.bytes_sent + t.bytes_received for d, t in trainers.items()}
        tokens_measured = {d: 0 for d in trainers}
        for round_ in range(args.rounds):
            local_rates.append(run_local(args.batches, default_threads))
            single_rates.append(run_local(args.batches, 1))
            pipe_rates.append(run_pipeline("float32", args.batches))
            for dtype in trainers:
                tokens_measured[dtype] += args.batches * tokens_per_batch
            print(
                f"round {round_ + 1}: single process {local_rates[-1]:.0f} tok/s ({default_threads} threads), "
                f"{single_rates[-1]:.0f} tok/s (1 thread), pipeline fp32 {pipe_rates[-1]:.0f} tok/s",
                flush=True,
            )
        wire = {
            d: (t.bytes_sent + t.bytes_received - bytes_before[d]) / tokens_measured[d] for d, t in trainers.items()
        }
    finally:
        for trainer in trainers.values():
            trainer.close()
        for process in workers:
            os.kill(process.pid, signal.SIGTERM)
        for process in workers:
            process.join(30)
        dht.shutdown()

    best_local = max(local_rates + single_rates)
    best_pipe = max(pipe_rates)
    print()
    print(f"single process        : {best_local:8.0f} tokens/s (best of {default_threads} threads and 1)")
    print(f"pipeline, fp32 wire   : {best_pipe:8.0f} tokens/s   ratio {best_pipe / best_local:.2f} (aim >= 0.6)")
    print(f"wire bytes per token  : fp32 {wire['float32']:.0f} B (d_model {config.d_model})")


if __name__ == "__main__":
    main()
