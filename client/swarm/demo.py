"""``psyswarm demo``: the whole system on one machine, on the embedded defaults.

It starts the coordinator (the TCP server, or with ``--backend solana`` a local chain running the program),
a DHT bootstrap, one worker per pipeline stage and a trainer as separate processes on loopback, follows the
run with a live view (phase, round, loss, tokens/s, clients per stage), and ends with a summary and a
loss-curve PNG. Ctrl-C stops every child.

It trains one of ``MODELS``: psyswarm's own byte-level model (the default), or with ``--model tiny-llama`` the tiny
Llama of ``examples/tiny-llama`` on a slice of the corpus (``TINY_LLAMA_CORPUS_BYTES``), prepared once and kept
in the work directory's ``TINY_LLAMA_CACHE`` for the next run.

Each run starts from an empty work directory, yet the demo deletes only what an earlier demo wrote there: a
directory it creates carries ``DEMO_MARKER``, and it clears only such a directory (or an empty one), keeping the
prepared tiny Llama.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import socket
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from client.swarm import tiny_llama
from client.swarm.launcher import Swarm
from client.swarm.status import last_epoch, round_text, stage_counts
from client.witness.records import Board, Commitment, members
from coordinator_program.spec.state import CoordinatorState, Phase

DEMO_MARKER = ".psyswarm-demo"
TINY_LLAMA_CACHE = "tiny-llama"
"""The prepared tiny Llama inside the work directory: what clearing the work directory keeps."""
TINY_LLAMA_CORPUS_BYTES = 2_000_000
"""The demo's tiny Llama sees the first 2 MB of the corpus's 12 (about 600k tokens; the default 24 steps read
about 100k): preparing it takes about 10 s instead of 30, so the whole demo stays within two to three minutes."""

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


@dataclasses.dataclass(frozen=True)
class DemoModel:
    """What a demo trains: the run config it writes (``run_toml(workdir, epochs, rounds, progress)``, which may
    prepare files in the work directory first) and how its loss reads."""

    title: str
    loss_unit: str
    run_toml: Callable[[Path, int, int, tiny_llama.Progress], str]


def byte_model_toml(workdir: Path, epochs: int, rounds: int, progress: tiny_llama.Progress) -> str:
    """psyswarm's own byte-level model on the whole corpus, read as bytes: nothing to prepare."""
    return DEMO_TOML.format(rounds=rounds, steps=epochs * rounds)


def tiny_llama_toml(workdir: Path, epochs: int, rounds: int, progress: tiny_llama.Progress) -> str:
    """The example's tiny Llama on the first ``TINY_LLAMA_CORPUS_BYTES`` of the corpus, prepared once per workdir."""
    prepared = tiny_llama.cached(workdir / TINY_LLAMA_CACHE, corpus_bytes=TINY_LLAMA_CORPUS_BYTES,
                                 progress=progress)
    return tiny_llama.state_toml(prepared, run_id="demo-tiny-llama", rounds_per_epoch=rounds,
                                 total_steps=epochs * rounds)


MODELS = {
    "psyswarm": DemoModel("psyswarm demo: 3-stage byte-level transformer on the Python standard library",
                          "nats per byte", byte_model_toml),
    "tiny-llama": DemoModel("psyswarm demo: tiny Llama (3 stages, BPE) on the Python standard library",
                            "nats per token", tiny_llama_toml),
}


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
        self.out(f"[{time.monotonic() - self.started:6.1f}s] epoch {last_epoch(state)} {round_text(state):<22} "
                 f"step {state.step}/{state.config.total_steps}  {state.phase.name:<17} {loss:<11} {rate:<14} "
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
    board = Board(dht, backend.state)
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
        found = await asyncio.to_thread(board.fetch, Commitment, key[0], key[1], members(state))
        if found:
            collected.add(key)
            view.result(key[0], key[1], state.step, list(found.values()))  # type: ignore[arg-type]
            return
        await asyncio.sleep(0.2)


def plot(results: list[RoundResult], path: Path, model: str = "psyswarm") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw_losses(ax, results, MODELS[model])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_losses(ax, results: list[RoundResult], model: DemoModel = MODELS["psyswarm"]) -> None:
    """The loss per optimizer step on ``ax``, with a labelled line where each epoch begins."""
    ax.plot([r.step for r in results], [r.loss for r in results], marker="o", markersize=3)
    for epoch in sorted({r.epoch for r in results}):
        first = min(r.step for r in results if r.epoch == epoch)
        ax.axvline(first - 0.5, color="grey", linewidth=0.6, linestyle=":")
        ax.annotate(f"epoch {epoch}", (first - 0.5, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                    textcoords="offset points", ha="left", va="top", fontsize=8, color="dimgrey")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    ax.set_xlabel("optimizer step (one per round)")
    ax.set_ylabel(f"training loss ({model.loss_unit})")
    ax.set_title(textwrap.fill(model.title, 60), fontsize=11)  # one line overran the figure's width
    ax.grid(alpha=0.3)


class WorkdirNotOurs(RuntimeError):
    """The work directory holds files the demo did not write; it deletes none of them."""


def claim_workdir(workdir: Path) -> None:
    """Make ``workdir`` an empty directory marked as the demo's, clearing it only if an earlier demo made it; a
    prepared tiny Llama (a real directory, not a link) stays for the next run to reuse."""
    if workdir.exists() and not workdir.is_dir():
        raise WorkdirNotOurs(f"--workdir {workdir} is a file, not a directory; pass a new or empty directory")
    entries = list(workdir.iterdir()) if workdir.exists() else []
    marker = workdir / DEMO_MARKER
    if entries and not (marker.is_file() and not marker.is_symlink()):
        raise WorkdirNotOurs(f"--workdir {workdir} is not empty and was not created by the demo (it has no "
                             f"{DEMO_MARKER}), so nothing was deleted; pass a new or empty directory, or empty it "
                             "yourself")
    for entry in entries:
        if entry.name == TINY_LLAMA_CACHE and entry.is_dir() and not entry.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry != marker:
            entry.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text("Written by `psyswarm demo`: the next demo run with this --workdir empties this directory.\n")


PORTS_TAKEN = 10
"""Ports the demo takes from ``--port-base`` B on: the coordinator B (a local chain B and B + 1), the DHT bootstrap
B + 2, the head, body1 and tail workers' gRPC B + 3..B + 5 and their DHT nodes B + 6..B + 8, the trainer's DHT
node B + 9."""
STAGES = ("head", "body1", "tail")


def busy_ports(base: int) -> list[int]:
    """The ports of ``base``..``base + PORTS_TAKEN - 1`` that something on this machine already listens on."""
    busy = []
    for port in range(base, base + PORTS_TAKEN):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


def client_ports(base: int, name: str) -> tuple[str, ...]:
    """The ``join-run`` options that fix a demo client's ports (none without a base: free ones are picked)."""
    if not base:
        return ()
    if name == "trainer":
        return ("--dht-port", str(base + 9))
    i = STAGES.index(name)
    return ("--port", str(base + 3 + i), "--dht-port", str(base + 6 + i))


def run_demo(workdir: Path, epochs: int, rounds: int, timeout: float, out=print,
             backend: str = "tcp", model: str = "psyswarm", port_base: int = 0) -> list[RoundResult]:
    """Run the demo of ``model`` (a key of ``MODELS``) end to end in a cleared ``workdir`` (``WorkdirNotOurs`` if it
    is not the demo's to clear), on the ports from ``port_base`` (``PORTS_TAKEN`` of them; free ones if 0);
    returns each round's result (the CLI prints the summary)."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, not {model!r}")
    started = time.monotonic()

    def progress(line: str) -> None:
        out(f"[{time.monotonic() - started:6.1f}s] {line}")

    claim_workdir(workdir)
    swarm = Swarm(workdir, MODELS[model].run_toml(workdir, epochs, rounds, progress), backend=backend)
    view = LiveView(out)
    where = "a local Solana chain running the program" if backend == "solana" else "the coordinator server"
    try:
        progress(f"starting {where} (logs in {swarm.logs})")
        swarm.start_server(port_base or None)
        progress(f"coordinator up at {swarm.address}; starting the DHT bootstrap")
        swarm.start_dht(port_base + 2 if port_base else 0)
        progress("DHT up; starting 3 workers (head, body1, tail) and a trainer, each its own process")
        for stage in STAGES:
            swarm.start_client(f"worker-{stage}", "worker", stage, extra=client_ports(port_base, stage))
        swarm.start_client("trainer", "trainer", extra=client_ports(port_base, "trainer"))
        progress("clients started: each loads torch and hivemind, then joins; the run starts once all 4 are in")
        view.started = started
        asyncio.run(follow(swarm, view, timeout))
    finally:
        swarm.stop()
    return view.results
