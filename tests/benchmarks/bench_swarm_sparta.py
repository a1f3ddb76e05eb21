"""Benchmark: what averaging every step costs a coordinated run's rounds.

It runs the whole system on loopback three times, one run after the other, with the same model, clients and
rounds: a TCP coordinator, a DHT, two workers on each of three stages and one trainer, each a process of its own.
The runs differ in how a stage's workers average: not at all (``sparta_every`` beyond the run's last step), the
internet setting of ``examples/state.toml`` (SPARTA: a tenth of the stage every step, sent in int4 as its change
since its anchor), or the whole gradient every step (``grad_averaging = "full"``). It prints, per run:

- seconds per round, from one RoundTrain's start to the next's as the coordinator's states arrive (the median of
  every round after the first), and their ratio to the run without averaging; and the trainer's share of a round,
  its calls through the pipeline (from the tokens per second it logs for each round);
- each averaging round's seconds as the workers log them, and for SPARTA how many slices travelled in which codec
  and their size (``SpartaAverager.average``): a stage's first cycle of partitions goes in float32, since no peer
  holds an anchor yet (``client.averaging.anchored``), so a run of ``--rounds`` 10 or fewer sends no int4 slice.
  A worker averages its gradients before its step, and SPARTA's slice after it, in RoundWitness, holding the next
  round's batches until it is done: an averaging round that outlasts RoundWitness delays the next round by the
  difference.

With ``--link MBIT/MS`` every worker sits behind a router of its own on that link (``link_emulator``): it listens
on 127.0.0.1 and is reached at 127.0.0.2 (``join-run --public-host``), where one relay forwards its gRPC and DHT
ports over one line, so the trainer's Forwards and Backwards, its groupmates' averaging and the DHT all cross it.
The coordinator stays on loopback; its messages are a few hundred bytes a phase.

Run::

    python -m tests.benchmarks.bench_swarm_sparta [--rounds 12] [--width 128] [--witness-time 2] [--link 100/50]

Nine processes (coordinator, DHT, six workers, a trainer) share this machine's two cores, so a round's seconds
here are mostly compute; the ratio is what averaging adds to it.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from client.swarm.launcher import Swarm, free_port
from coordinator_program.spec.state import CoordinatorState, Phase
from tests.benchmarks.link_emulator import ROUTER, Link, Relay, parse_link
from tests.integration.test_swarm import watch

STAGES = ("head", "body1", "tail")
WORKERS_PER_STAGE = 2
RUN = """
run_id = "bench"
[config]
min_clients = {clients}
max_clients = 16
num_stages = 3
witness_nodes = 3
witness_quorum = 2
warmup_time = 30
max_round_train_time = 120
round_witness_time = {witness_time}
cooldown_time = 5
rounds_per_epoch = {rounds}
total_steps = {rounds}
global_batch_size = 16
[model]
n_layers = 3
n_heads = 4
d_model = {width}
seq_len = 64
microbatch_size = 8
learning_rate = 0.002
sparta_every = {every}
sparta_partitions = 10
grad_values = "{values}"
grad_averaging = "{gradients}"
"""
TRAINED = re.compile(r"round \S+: trained samples (\d+)-(\d+), loss [\d.]+, (\d+) tokens/s")
AVERAGING = re.compile(r"(?:averaging|gradient) round \d+(?: \(partition \d+\))?: (\w+).*?, ([\d.]+) s"
                       r"(?:, slice of ([\d.]+) kB in (\w+))?")


@dataclass(frozen=True)
class Outcome:
    name: str
    round_seconds: list[float]  # from one RoundTrain's start to the next's, every round after the first
    averaging_seconds: list[float]  # every worker's averaging rounds that averaged
    slice_kb: dict[str, list[float]]  # by the codec they travelled in
    statuses: dict[str, int]
    link_mb: float  # with a link: the most any worker's line carried in one direction, MB
    training_seconds: list[float]  # the trainer's, each round: its calls through the pipeline, from its log


def behind_router(link: Link | None, routers: list[Relay]) -> tuple[str, ...]:
    """``join-run`` options for a worker behind a router of its own on ``link`` (appended to ``routers``, for the
    caller to stop); none without a link."""
    if link is None:
        return ()
    grpc_port, dht_port = free_port(), free_port()
    routers.append(Relay(f"127.0.0.1:{grpc_port}", link, listen=f"{ROUTER}:{grpc_port}").start())
    routers[-1].forward(f"{ROUTER}:{dht_port}", f"127.0.0.1:{dht_port}")
    return "--port", str(grpc_port), "--dht-port", str(dht_port), "--public-host", ROUTER


def run(name: str, toml: str, timeout: float, link: Link | None) -> Outcome:
    """One whole run of ``toml``, every worker behind ``link`` if given; its round times and its workers' SPARTA
    rounds."""
    with tempfile.TemporaryDirectory(prefix="bench-swarm-") as workdir:
        swarm = Swarm(Path(workdir), toml)
        starts: dict[tuple[int, int], float] = {}
        routers: list[Relay] = []

        def on_state(state: CoordinatorState) -> None:
            if state.phase == Phase.RoundTrain:
                starts.setdefault((state.epoch, state.round.height), time.monotonic())

        try:
            swarm.start_server()
            swarm.start_dht()
            workers = [(f"{stage}{i}", stage) for i in range(WORKERS_PER_STAGE) for stage in STAGES]
            for label, stage in workers[:-1]:
                swarm.start_client(label, "worker", stage, extra=behind_router(link, routers))
            swarm.start_client("trainer", "trainer")
            # the last worker once every other client is queued: all enter the first epoch
            asyncio.run(watch(swarm, lambda s: len(s.pending) >= len(workers), 180))
            label, stage = workers[-1]
            swarm.start_client(label, "worker", stage, extra=behind_router(link, routers))
            asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, timeout, on_state))
        finally:
            swarm.stop()
            for router in routers:
                router.stop()
        times = [starts[k] for k in sorted(starts)]
        averaging, kb, statuses = [], {}, {}
        for label, _ in workers:
            for status, seconds, size, values in AVERAGING.findall(swarm.log_text(label)):
                statuses[status] = statuses.get(status, 0) + 1
                if status == "averaged":
                    averaging.append(float(seconds))
                    if size:
                        kb.setdefault(values, []).append(float(size))
        carried = max((r.busiest_direction_bytes for r in routers), default=0) / 1e6
        seq_len = tomllib.loads(toml)["model"]["seq_len"]
        training = [(int(end) - int(start)) * seq_len / int(rate)
                    for start, end, rate in TRAINED.findall(swarm.log_text("trainer"))]
        return Outcome(name, [b - a for a, b in zip(times[1:], times[2:], strict=False)], averaging, kb, statuses,
                       carried, training)


def describe(outcome: Outcome, baseline: Outcome | None) -> str:
    line = f"{outcome.name:<28} {statistics.median(outcome.round_seconds):6.2f} s a round"
    if baseline is not None:
        line += (f" ({statistics.median(outcome.round_seconds) / statistics.median(baseline.round_seconds):.2f}×"
                 " the run without averaging)")
    if outcome.training_seconds:
        line += f", the trainer's share {statistics.median(outcome.training_seconds):.2f} s median"
    if outcome.averaging_seconds:
        line += (f"; averaging rounds {statistics.median(outcome.averaging_seconds):.2f} s median, "
                 f"{max(outcome.averaging_seconds):.2f} s at most")
    for values, sizes in outcome.slice_kb.items():  # float32: a cycle without anchors yet (``anchored``)
        line += f", {len(sizes)} slices in {values} ({statistics.median(sizes):.1f} kB)"
    if outcome.link_mb:
        line += f"; the busiest worker's line carried {outcome.link_mb:.1f} MB one way"
    return line + f"; averaging outcomes {outcome.statuses}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds (optimizer steps) in each run")
    parser.add_argument("--width", type=int, default=128, help="the model's d_model")
    parser.add_argument("--witness-time", type=int, default=2, help="round_witness_time, seconds (1..5 sets "
                        "how long SPARTA's matchmaking waits: client.join.stage_replica.sparta_settings)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--link", type=parse_link, metavar="MBIT/MS",
                        help="put every worker behind a router of its own on this link, such as 100/50")
    args = parser.parse_args()
    common = dict(clients=len(STAGES) * WORKERS_PER_STAGE + 1, rounds=args.rounds, width=args.width,
                  witness_time=args.witness_time)
    none = args.rounds + 1
    baseline = run("no averaging", RUN.format(every=none, values="float32", gradients="off", **common), args.timeout,
                   args.link)
    print(describe(baseline, None), flush=True)
    for name, every, values, gradients in (("SPARTA 1/10 every step, int4", 1, "int4", "off"),
                                           ("full gradients every step", none, "float32", "full")):
        outcome = run(name, RUN.format(every=every, values=values, gradients=gradients, **common), args.timeout,
                      args.link)
        print(describe(outcome, baseline), flush=True)


if __name__ == "__main__":
    main()
