"""Benchmark: the pipeline's wire codecs, on loopback and over an emulated internet link.

For each codec (float32, float16, bfloat16, int8) it starts the three stage workers of the default byte-level
model (d_model 128) as separate processes in a run of that codec, announced on a loopback DHT, and prints:

- bytes per token on the wire (everything the trainer sent and received; workers talk only to trainers) and
  the training loss after the same tokens: every codec trains the same batches from the same initial
  parameters, one optimizer step per batch, and the loss is the mean of the last ``--tail`` batches'. Any
  perturbation shifts a short run's trajectory (over three runs float32 repeated itself within 0.05%, while
  float16 landed 0.9-1.7% below it), so read a codec's gap against the half-precision codecs' gaps;
- tokens/s with every worker behind its own emulated link (``link_emulator``: by default 100 Mbit/s each way
  and 50 ms round trip) against tokens/s on loopback: the best of ``--rounds`` measurements, interleaved
  across codecs and between loopback and link, all codecs' workers running at once, so that every figure
  sees the same background load; and how many microbatches each trainer kept in flight, which it chooses from
  its own calls unless ``--inflight`` fixes it; and, as the baseline, tokens/s through the link with
  ``--baseline-inflight`` (4) fixed, as the trainer ran before it chose.

A measurement is one optimizer step, as a round is: the workers step every ``--batch-size`` samples and the
trainer trains one batch per call. A step's microbatches cannot overlap the next step's (their backward needs the
parameters their forward used), so each step pays one microbatch's whole chain of round trips once, whatever
is in flight: about ``(2 × stages − 1) × RTT`` plus its compute. Hiding latency therefore takes steps of many
microbatches; the default 128 samples are 32 microbatches of 4.

Run::

    python tests/benchmarks/bench_wire.py [--steps 5] [--bandwidth 100e6] [--rtt 0.05] [--codecs int8 float32]

Training is CPU-bound here (two cores shared by the trainer and three workers), so a link that carries the
traffic with room to spare shows little difference between codecs; the column "link-bound" says how many
tokens/s each codec's bytes would allow over the link if compute were free.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from solders.keypair import Keypair  # noqa: E402

from client.data import open_byte_dataset  # noqa: E402
from client.pipeline.discovery import WorkerDirectory, start_dht  # noqa: E402
from client.pipeline.model import ModelConfig, stage_names  # noqa: E402
from client.pipeline.trainer import PipelineTrainer  # noqa: E402
from client.pipeline.wire import WIRE_CODECS  # noqa: E402
from tests.benchmarks.bench_pipeline import spawn_workers, wait_for_workers  # noqa: E402
from tests.benchmarks.link_emulator import Link, RelayedDirectory  # noqa: E402


@dataclasses.dataclass
class Figures:
    codec: str
    bytes_per_token: float
    loss: float
    loopback: float  # tokens/s
    shaped: float  # tokens/s
    busiest_link_bytes_per_token: float
    inflight: tuple[int, int] = (0, 0)  # microbatches in flight at the end: loopback, link
    fixed: float = 0.0  # tokens/s through the link with --baseline-inflight fixed


def stop_workers(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)
    for process in processes:
        process.join(30)


class CodecRun:
    """One codec's run: its three worker processes and two trainers, one on loopback and one through the link."""

    def __init__(self, codec: str, args: argparse.Namespace, config: ModelConfig, dataset, dht, link: Link) -> None:
        self.codec, self.args = codec, args
        run_id = f"bench-wire-{codec}-{uuid.uuid4().hex[:8]}"
        peers = [str(a) for a in dht.get_visible_maddrs()]
        self.workers = spawn_workers(config, peers, run_id, 1, args.batch_size, codec)
        self.directory = WorkerDirectory(dht, run_id, config.fingerprint())
        self.shaped_directory = RelayedDirectory(self.directory, link)
        # One identity for both trainers, as one contributor measuring two paths, and more retries than a trainer's
        # default: written when a worker's gradient bound refused a loss spike of one of two trainers on every
        # retry; it now scales such a contribution instead (``admission.GradientBound``), and this script has not
        # been measured since without the two.
        options = {"run_id": run_id, "wire_codec": codec, "max_inflight": args.inflight, "keypair": Keypair(),
                   "max_attempts": 32}
        self.loopback = PipelineTrainer(config, dataset, self.directory, **options)  # type: ignore[arg-type]
        self.shaped = PipelineTrainer(config, dataset, self.shaped_directory, **options)  # type: ignore[arg-type]
        # The baseline, in the same run: a fixed number in flight through links of its own.
        self.fixed_directory = RelayedDirectory(self.directory, link)
        self.fixed = PipelineTrainer(config, dataset, self.fixed_directory,  # type: ignore[arg-type]
                                     **{**options, "max_inflight": args.baseline_inflight})
        self.tokens_per_batch = args.batch_size * config.seq_len
        self.next_batch = 0
        self.rates: dict[PipelineTrainer, list[float]] = {self.loopback: [], self.shaped: [], self.fixed: []}
        self.figures = Figures(codec, 0.0, 0.0, 0.0, 0.0, 0.0)

    def train_for_loss(self) -> None:
        """The loss run on loopback: one call per batch, so each worker steps once all of the batch has passed.
        Its calls are also what the loopback trainer measures its in-flight choice from."""
        losses = []
        for _ in range(self.args.steps):
            microbatch_losses = self._batches(self.loopback, 1).losses
            losses.append(sum(microbatch_losses) / len(microbatch_losses))
        self.figures.bytes_per_token = (self.loopback.bytes_sent + self.loopback.bytes_received) / (
            self.args.steps * self.tokens_per_batch
        )
        self.figures.loss = sum(losses[-self.args.tail :]) / len(losses[-self.args.tail :])
        self._batches(self.shaped, 1)  # a warm-up batch opens the relays' connections and measures the link
        self._batches(self.fixed, 1)

    def time_once(self) -> None:
        """One timed measurement on loopback, then one through the link."""
        for trainer, measured in self.rates.items():
            started = time.perf_counter()
            self._batches(trainer, self.args.timed_batches)
            measured.append(self.args.timed_batches * self.tokens_per_batch / (time.perf_counter() - started))

    def finish(self) -> Figures:
        shaped_tokens = (1 + len(self.rates[self.shaped]) * self.args.timed_batches) * self.tokens_per_batch
        self.figures.busiest_link_bytes_per_token = self.shaped_directory.busiest_link_bytes() / shaped_tokens
        self.figures.loopback, self.figures.shaped = max(self.rates[self.loopback]), max(self.rates[self.shaped])
        self.figures.fixed = max(self.rates[self.fixed])
        microbatch = self.args.microbatch_size
        self.figures.inflight = (self.loopback.inflight(microbatch), self.shaped.inflight(microbatch))
        return self.figures

    def close(self) -> None:
        self.loopback.close()
        self.shaped.close()
        self.fixed.close()
        self.shaped_directory.close()
        self.fixed_directory.close()
        stop_workers(self.workers)

    def _batches(self, trainer: PipelineTrainer, count: int):
        first = self.next_batch * self.args.batch_size
        self.next_batch += count
        return trainer.train(range(first, first + count * self.args.batch_size), self.args.microbatch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", nargs="+", default=list(WIRE_CODECS), choices=WIRE_CODECS)
    parser.add_argument("--steps", type=int, default=5, help="batches (optimizer steps) of the loss run")
    parser.add_argument("--tail", type=int, default=2, help="last batches whose mean loss is reported")
    parser.add_argument("--timed-batches", type=int, default=1, help="batches per timed measurement")
    parser.add_argument("--rounds", type=int, default=3, help="timed measurements of each (the best is reported)")
    parser.add_argument("--batch-size", type=int, default=128, help="samples per batch: per optimizer step")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=None,
                        help="microbatches in flight (default: each trainer chooses from what its calls measured)")
    parser.add_argument("--baseline-inflight", type=int, default=4,
                        help="microbatches in flight of the baseline through the link, fixed")
    parser.add_argument("--bandwidth", type=float, default=100e6, help="link bits per second, each way")
    parser.add_argument("--rtt", type=float, default=0.05, help="link round-trip time in seconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    config = ModelConfig()
    link = Link(args.bandwidth, args.rtt)
    dataset = open_byte_dataset(["stdlib"], config.seq_len)
    print(f"model: {config}")
    print(
        f"{args.steps} batches of {args.batch_size} x {config.seq_len} tokens, microbatch {args.microbatch_size}, "
        f"{args.inflight or 'measured'} in flight; each worker behind its own link of {link}; {os.cpu_count()} CPUs"
    )
    dht = start_dht()
    runs: list[CodecRun] = []
    try:  # every codec's workers at once, and measurements interleaved: all see the same background load
        runs = [CodecRun(codec, args, config, dataset, dht, link) for codec in args.codecs]
        for run in runs:
            wait_for_workers(run.directory, stage_names(config.num_stages), timeout=600)  # slow on a busy machine
        for run in runs:
            run.train_for_loss()
            print(f"{run.codec:9s} {run.figures.bytes_per_token:6.0f} B/token, loss {run.figures.loss:.4f}", flush=True)
        for _ in range(args.rounds):
            for run in runs:
                run.time_once()
        figures = [run.finish() for run in runs]
    finally:
        for run in runs:
            run.close()
        dht.shutdown()

    reference = next((f for f in figures if f.codec == "float32"), figures[0])
    print()
    print(f"{'codec':9s} {'B/token':>8s} {'x fp32':>7s} {'loss':>7s} {'vs fp32':>8s} {'loopback':>9s} "
          f"{'link':>7s} {'link/loop':>9s} {'in flight':>9s} {'fixed':>7s} {'fixed/loop':>10s} {'link-bound':>11s}")
    for f in figures:
        bound = link.bandwidth / 8 / f.busiest_link_bytes_per_token
        print(
            f"{f.codec:9s} {f.bytes_per_token:8.0f} {f.bytes_per_token / reference.bytes_per_token:7.3f} "
            f"{f.loss:7.4f} {100 * (f.loss / reference.loss - 1):+7.2f}% {f.loopback:9.0f} {f.shaped:7.0f} "
            f"{f.shaped / f.loopback:8.2f}x {f.inflight[0]:>4d}/{f.inflight[1]:<4d} {f.fixed:7.0f} "
            f"{f.fixed / f.loopback:9.2f}x {bound:11.0f}"
        )
    print(f"(tokens/s; link: every worker behind {link}; in flight: microbatches, loopback/link, as the trainers "
          f"last chose; fixed: through the link with {args.baseline_inflight} in flight, the baseline; link-bound: "
          "the link's bandwidth over the bytes per token that the busiest direction of any worker's link carried)")


if __name__ == "__main__":
    main()
