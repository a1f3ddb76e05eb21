"""``psyswarm demo``: the whole system on one machine, on the embedded defaults.

It starts the coordinator (the TCP server, or with ``--backend solana`` a local chain running the program),
a DHT bootstrap, one worker per pipeline stage and a trainer as separate processes on loopback, follows the
run with a live view (phase, round, loss, tokens/s, clients per stage), and ends with a summary and a
loss-curve PNG. Ctrl-C stops every child.

Each run starts from an empty work directory, yet the demo deletes only what an earlier demo wrote there: a
directory it creates carries ``DEMO_MARKER``, and it clears only such a directory (or an empty one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from pathlib import Path

from client.swarm.launcher import Swarm
from client.swarm.status import stage_counts
from client.witness.records import Board, Commitment
from coordinator_program.state import CoordinatorState, Phase

DEMO_MARKER = ".psyswarm-demo"

DEMO_TOML = """\
# The demo run: a 3-stage byte-level transformer trained on the Python standard library's sources.
run_id = "demo"

[config]
min_clients = 4
max_clients = 16
num_stages = 3
witness_nodes = 2
witness_quorum = 2
warmup_time = 30
max_round_train_time = 60
round_witness_time = 1
cooldown_time = 20
rounds_per_epoch = {rounds}
total_steps = {steps}
global_batch_size = 16

[model]
n_layers = 3
n_heads = 4
d_model = 128
seq_len = 128
microbatch_size = 8
learning_rate = 0.002
dataset = "stdlib"
"""


@dataclasses.dataclass
class RoundResult:
    epoch: int
    round: int
    step: int
    loss: float
    tokens: int
    seconds: float


class LiveView:
    """Prints one line per phase change and per finished round."""

    def __init__(self, out=print) -> None:
        self.out = out
        self.results: list[RoundResult] = []
        self.round_started: dict[tuple[int, int], float] = {}
        self.last: tuple | None = None
        self.started = time.monotonic()

    def phase(self, state: CoordinatorState) -> None:
        key = (state.phase, state.epoch, state.round.height)
        if key == self.last:
            return
        self.last = key
        if state.phase == Phase.RoundTrain:
            self.round_started.setdefault((state.epoch, state.round.height), time.monotonic())
        loss = f"loss {self.results[-1].loss:.3f}" if self.results else "loss -"
        rate = f"{self.results[-1].tokens / self.results[-1].seconds:,.0f} tok/s" if self.results else ""
        self.out(f"[{time.monotonic() - self.started:6.1f}s] epoch {state.epoch} round "
                 f"{state.round.height + 1}/{state.config.rounds_per_epoch} step {state.step}/"
                 f"{state.config.total_steps}  {state.phase.name:<17} {loss:<11} {rate:<14} "
                 f"{stage_counts(state)}")

    def result(self, epoch: int, round_: int, step: int, commitments: list[Commitment]) -> None:
        began = self.round_started.get((epoch, round_), time.monotonic())
        loss = sum(c.loss * (c.end - c.start) for c in commitments) / max(1, sum(c.end - c.start for c in commitments))
        tokens = sum(c.tokens for c in commitments)
        self.results.append(RoundResult(epoch, round_, step, loss, tokens, max(time.monotonic() - began, 1e-3)))


async def follow(swarm: Swarm, view: LiveView, timeout: float) -> CoordinatorState:
    """Watch the run until it finishes, collecting each round's loss from the trainers' commitments."""
    from client.pipeline.discovery import start_dht

    backend = swarm.observer()
    await backend.connect()
    dht = await asyncio.to_thread(start_dht, [swarm.peer])
    board = Board(dht, backend.state.run_id)
    collected: set[tuple[int, int]] = set()
    deadline = time.monotonic() + timeout
    try:
        async for state in backend.updates():
            view.phase(state)
            if state.phase in (Phase.RoundWitness, Phase.Cooldown, Phase.Finished):
                await _collect(board, state, view, collected)
            if state.phase == Phase.Finished:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish within {timeout:.0f} s")
    finally:
        await backend.close()
        await asyncio.to_thread(dht.shutdown)
    raise RuntimeError("the coordinator connection ended")


async def _collect(board: Board, state: CoordinatorState, view: LiveView, collected: set) -> None:
    # A finished run has already counted its last epoch; the round is still the last one it ran.
    key = (state.epoch - 1 if state.phase == Phase.Finished else state.epoch, state.round.height)
    if key in collected:
        return
    for _ in range(10):  # the commitment may still be propagating through the DHT
        found = await asyncio.to_thread(board.fetch, Commitment, key[0], key[1])
        if found:
            collected.add(key)
            view.result(key[0], key[1], state.step, list(found.values()))  # type: ignore[arg-type]
            return
        await asyncio.sleep(0.2)


def plot(results: list[RoundResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r.step for r in results], [r.loss for r in results], marker="o", markersize=3)
    for epoch in sorted({r.epoch for r in results})[1:]:
        first = min(r.step for r in results if r.epoch == epoch)
        ax.axvline(first - 0.5, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("optimizer step (one per round)")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("psyswarm demo: 3-stage pipeline on the Python standard library")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


class WorkdirNotOurs(RuntimeError):
    """The work directory holds files the demo did not write; it deletes none of them."""


def claim_workdir(workdir: Path) -> None:
    """Make ``workdir`` an empty directory marked as the demo's, clearing it only if an earlier demo made it."""
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirNotOurs(f"--workdir {workdir} is a file, not a directory; pass a new or empty directory")
    entries = list(workdir.iterdir()) if workdir.exists() else []
    marker = workdir / DEMO_MARKER
    if entries and not (marker.is_file() and not marker.is_symlink()):
        raise WorkdirNotOurs(f"--workdir {workdir} is not empty and was not created by the demo (it has no "
                             f"{DEMO_MARKER}), so nothing was deleted; pass a new or empty directory, or empty it "
                             "yourself")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry != marker:
            entry.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text("Written by `psyswarm demo`: the next demo run with this --workdir empties this directory.\n")


def run_demo(workdir: Path, epochs: int, rounds: int, timeout: float, out=print,
             backend: str = "tcp") -> list[RoundResult]:
    """Run the demo end to end in a cleared ``workdir`` (``WorkdirNotOurs`` if it is not the demo's to clear);
    returns each round's result (the CLI prints the summary)."""
    claim_workdir(workdir)
    toml = DEMO_TOML.format(rounds=rounds, steps=epochs * rounds)
    swarm = Swarm(workdir, toml, backend=backend)
    view = LiveView(out)
    where = "a local Solana chain running the program" if backend == "solana" else "the coordinator server"
    try:
        out(f"starting {where}, a DHT bootstrap, 3 workers and a trainer (logs in {swarm.logs})")
        swarm.start_server()
        swarm.start_dht()
        for stage in ("head", "body1", "tail"):
            swarm.start_client(f"worker-{stage}", "worker", stage)
        swarm.start_client("trainer", "trainer")
        asyncio.run(follow(swarm, view, timeout))
    finally:
        swarm.stop()
    return view.results
