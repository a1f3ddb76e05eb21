"""The whole system, multi-process on loopback: a real server, a real DHT, real workers and trainers."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from client.backends.base import Backend
from client.identity import load_keypair
from client.swarm.launcher import Swarm
from client.witness.records import Board, Commitment
from coordinator_program.spec import derived
from coordinator_program.spec.state import CoordinatorState, Phase, Role
from tests.fake_hub import FakeHub

TINY = """
run_id = "it"
[config]
min_clients = {min_clients}
max_clients = 16
num_stages = 3
witness_nodes = 3
witness_quorum = 2
warmup_time = 20
max_round_train_time = {train_time}
round_witness_time = 1
cooldown_time = 5
rounds_per_epoch = {rounds}
total_steps = {steps}
global_batch_size = 16
[model]
n_layers = 3
n_heads = 2
d_model = 32
seq_len = 32
microbatch_size = 8
learning_rate = 0.01
"""


def tiny(min_clients: int = 4, rounds: int = 3, steps: int = 6, train_time: int = 20) -> str:
    return TINY.format(min_clients=min_clients, rounds=rounds, steps=steps, train_time=train_time)


def recording(backend: Backend) -> list[CoordinatorState]:
    """Keep every state the backend receives, in order (its followers see a coalesced stream)."""
    history: list[CoordinatorState] = []
    publish = backend._publish

    async def keep(state: CoordinatorState) -> None:
        if backend._state is None or state.nonce > backend._state.nonce:
            history.append(state)
        await publish(state)

    backend._publish = keep  # type: ignore[method-assign]
    return history


async def watch(swarm: Swarm, until: Callable[[CoordinatorState], bool], timeout: float,
                on_state: Callable[[CoordinatorState], None] | None = None) -> list[CoordinatorState]:
    """Follow the run until ``until`` holds; returns every state seen."""
    observer = swarm.observer()
    history = recording(observer)
    await observer.connect()
    try:
        async def loop() -> None:
            async for state in observer.updates():
                if on_state:
                    on_state(state)
                if until(state):
                    return
        await asyncio.wait_for(loop(), timeout)
    finally:
        await observer.close()
    return history


def phases_in_order(history: list[CoordinatorState]) -> list[Phase]:
    out: list[Phase] = []
    for state in history:
        if not out or out[-1] != state.phase:
            out.append(state.phase)
    return out


def launch(tmp_path: Path, toml: str, workers: list[str], trainers: int = 1, backend: str = "tcp",
           extra: tuple[str, ...] = ()) -> Swarm:
    """Start a swarm whose clients all enter the first epoch: the last worker (the one that completes the
    pipeline) starts only once every other client is pending, so admission cannot leave one behind. ``extra``
    options go to every client."""
    swarm = Swarm(tmp_path, toml, backend=backend)
    swarm.start_server()
    swarm.start_dht()
    for i, stage in enumerate(workers[:-1]):
        swarm.start_client(f"worker{i}-{stage}", "worker", stage, extra=extra)
    for i in range(trainers):
        swarm.start_client(f"trainer{i}", "trainer", extra=extra)
    others = len(workers) - 1 + trainers
    asyncio.run(watch(swarm, lambda s: len(s.pending) >= others, 120))
    swarm.start_client(f"worker{len(workers) - 1}-{workers[-1]}", "worker", workers[-1], extra=extra)
    return swarm


def fail_with_logs(swarm: Swarm, exc: BaseException) -> None:
    """Fail with every phase change the server logged (an epoch that ended early shows there, however long the run)
    and the end of each process's log."""
    phases = [line for line in swarm.log_text("server").splitlines() if " phase " in line]
    logs = "\n".join(f"--- {name}\n{swarm.log_text(name)[-1500:]}" for name in swarm.procs)
    pytest.fail(f"{exc!r}\n--- the server's phases\n" + "\n".join(phases) + f"\n{logs}")


class CommittedLosses:
    """The trainers' committed losses, read from the run's DHT as each round ends (pass it to ``watch`` as
    ``on_state``): the clients' DHT nodes hold the records, and they leave as soon as the run finishes."""

    def __init__(self, swarm: Swarm) -> None:
        from client.pipeline.discovery import start_dht

        self.dht = start_dht([swarm.peer])
        self.board: Board | None = None  # named for the run's instance, which the first state gives
        self.rounds: dict[tuple[int, int], dict[str, float]] = {}
        self.heights: dict[int, int] = {}  # the highest round seen in each epoch

    def __call__(self, state: CoordinatorState) -> None:
        self.board = self.board or Board(self.dht, state)
        # The observer hands on the newest state, so a watcher busy fetching can miss a round's witness phase:
        # every round below the current height is over, and so is the current one once it is witnessed.
        epoch, height = state.epoch, state.round.height
        self.heights[epoch] = max(self.heights.get(epoch, 0), height)
        for e, top in self.heights.items():
            last = top if e < epoch or state.phase in (Phase.RoundWitness, Phase.Cooldown) else top - 1
            for r in range(last + 1):
                self.rounds.setdefault((e, r), {})
        # a busy trainer's record can land after its round closed: look again at the last two rounds, and at
        # any round still without a record, on every state
        recent = sorted(self.rounds)[-2:]
        for key in sorted(self.rounds):
            if not self.rounds[key] or key in recent:
                found = self.board.fetch(Commitment, *key)
                self.rounds[key].update({author: c.loss for author, c in found.items()})  # type: ignore[attr-defined]

    def curve(self, trainer: bytes | None = None) -> list[float]:
        """Every committed loss in round order (of one trainer if given)."""
        return [loss for key in sorted(self.rounds) for author, loss in sorted(self.rounds[key].items())
                if trainer is None or author == trainer.hex()]

    def close(self) -> None:
        self.dht.shutdown()


BACKENDS = pytest.mark.parametrize("backend", ["tcp", "solana"])


@pytest.mark.slow
@BACKENDS
def test_full_lifecycle_over_two_epochs(tmp_path: Path, backend: str) -> None:
    """On the Solana backend nobody runs a ticker: the clients tick the program themselves."""
    swarm = launch(tmp_path, tiny(rounds=4, steps=8), ["head", "body1", "tail"], backend=backend)
    committed = CommittedLosses(swarm)
    try:
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 240, committed))
        seen = phases_in_order(history)
        epoch = [Phase.Warmup] + [Phase.RoundTrain, Phase.RoundWitness] * 4 + [Phase.Cooldown]
        assert seen[-len(epoch) * 2 - 2:] == epoch + [Phase.WaitingForMembers] + epoch + [Phase.Finished], seen
        final = history[-1]
        assert final.step == 8 and final.epoch == 2
        assert any(s.round.revealed for s in history), "no witness revealed its secret for the next seed"
        curve = committed.curve()
        assert len(curve) == 8, curve
        assert sum(curve[-2:]) / 2 < sum(curve[:2]) / 2 - 0.3, f"the loss did not go down: {curve}"
        checkpoints = sorted((tmp_path / "checkpoints" / "it").glob("epoch-*/*.safetensors"))
        assert [p.name for p in checkpoints] == ["body1.safetensors", "head.safetensors", "tail.safetensors"] * 2
        status = subprocess.run([sys.executable, "-m", "client.cli", "status", *swarm.target, "--run-id", "it",
                                 "--initial-peer", swarm.peer], capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stderr
        assert "Finished" in status.stdout and f"last loss: {curve[-1]:.4f} (epoch 1, round 4)" in status.stdout
        assert re.search(r"^workers in the DHT: head=\d+ body1=\d+ tail=\d+$", status.stdout, re.M), status.stdout
        refused = [name for name in swarm.procs if "is not the run's dataset" in swarm.log_text(name)]
        assert not refused, f"the head or tail refused an honest trainer's tokens: {refused}"
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        committed.close()
        swarm.stop()


@pytest.mark.slow
@BACKENDS
def test_killed_client_is_removed_by_health_checks_and_the_run_goes_on(tmp_path: Path, backend: str) -> None:
    swarm = launch(tmp_path, tiny(min_clients=4, rounds=30, steps=30), ["head", "body1", "body1", "tail"],
                   backend=backend)
    victim = bytes(load_keypair(tmp_path / "keys" / "worker2-body1.json").pubkey())
    assert victim != bytes(load_keypair(tmp_path / "keys" / "worker1-body1.json").pubkey())
    killed_at: list[int] = []

    def kill_once(state: CoordinatorState) -> None:
        # Not while it witnesses: a witness killed between its commitment to the next seed and its reveal leaves as
        # a withholder at the round's end (tests/program/test_election_conformance.py), before any health check.
        if (not killed_at and state.phase == Phase.RoundTrain and state.step >= 2
                and victim not in derived.witnesses(state)):
            swarm.kill("worker2-body1")  # its stage peer, worker1-body1, carries on
            killed_at.append(state.step)

    try:
        history = asyncio.run(watch(
            swarm, lambda s: bool(killed_at) and s.client_index(victim) is None and s.step >= killed_at[0] + 4,
            240, kill_once))
        final = history[-1]
        assert final.phase in (Phase.RoundTrain, Phase.RoundWitness) and final.epoch == 0
        assert len(final.clients) == 4 and final.client_index(victim) is None
        marked = [s for s in history if s.client_index(victim) is not None
                  and s.clients[s.client_index(victim)].health.name == "Unhealthy"]
        assert marked, "the victim left without a health check"
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()


@pytest.mark.slow
def test_a_stage_that_empties_ends_the_epoch(tmp_path: Path) -> None:
    swarm = launch(tmp_path, tiny(rounds=30, steps=30, train_time=4), ["head", "body1", "tail"])
    killed: list[int] = []

    def kill_tail(state: CoordinatorState) -> None:
        if not killed and state.phase == Phase.RoundTrain and state.step >= 1:
            swarm.kill("worker2-tail")
            killed.append(state.step)

    try:
        history = asyncio.run(watch(swarm, lambda s: bool(killed) and s.phase == Phase.WaitingForMembers, 240,
                                    kill_tail))
        cooldowns = [s for s in history if s.phase == Phase.Cooldown]
        assert cooldowns and cooldowns[0].step < 30, "the epoch should end early, not after its 30 rounds"
        waiting = history[-1]
        # The dead tail may still be queued: it leaves the epoch only once a health check names it, and the
        # epoch can end first. Its trainer, stalled without a tail, proved its presence and stays.
        assert waiting.epoch == 1 and waiting.clients == []
        assert {0, 1} <= {p.stage for p in waiting.pending if p.role == Role.Worker}
        assert any(p.role == Role.Trainer for p in waiting.pending)
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()


@pytest.mark.slow
def test_a_replacement_for_an_emptied_stage_starts_from_its_snapshot(tmp_path: Path) -> None:
    """The only body1 worker is killed mid-epoch. The trainer, stalled on the empty stage, keeps proving its
    presence: nobody but the dead worker is removed, and the others wait, queued, for the next epoch. The
    epoch's checkpoint lacks body1, and no peer holds it; a new body1 worker starts from the newest of the
    snapshots the dead one saved every 2 steps, not from the run's seed. No step of any worker takes more
    samples than the global batch (the stalled round's microbatches count nowhere)."""
    swarm = launch(tmp_path, tiny(rounds=30, steps=30, train_time=4), ["head", "body1", "tail"],
                   extra=("--snapshot-every", "2"))
    snapshots = tmp_path / "checkpoints" / "it" / "snapshots"
    survivors = {bytes(load_keypair(tmp_path / "keys" / f"{name}.json").pubkey())
                 for name in ("worker0-head", "worker2-tail", "trainer0")}
    killed: list[int] = []

    def kill_body1(state: CoordinatorState) -> None:
        if not killed and state.phase == Phase.RoundTrain and list(snapshots.glob("step-*/body1.safetensors")):
            swarm.kill("worker1-body1")
            killed.append(state.step)

    try:
        history = asyncio.run(watch(swarm, lambda s: bool(killed) and s.phase == Phase.WaitingForMembers, 240,
                                    kill_body1))
        assert survivors <= {p.id for p in history[-1].pending}, "the trainer and the other workers stay queued"
        key = swarm.start_client("replacement-body1", "worker", "body1", extra=("--snapshot-every", "2"))
        replacement = bytes(load_keypair(key).pubkey())
        # The dead worker may still be queued (the epoch can end before a health check names it): then one more
        # epoch starts with it, and ends once it is checked out, before the replacement is admitted.
        history += asyncio.run(watch(swarm, lambda s: s.phase == Phase.RoundTrain and s.round.height >= 2
                                     and s.client_index(replacement) is not None, 300))
        removed = {c.id for s in history for c in s.clients if c.health.name != "Healthy"}
        assert not removed & survivors, "a client other than the dead body1 worker was health-checked"
        assert all(survivors <= {c.id for c in s.clients} for s in history if s.phase == Phase.RoundTrain)
        loaded = re.search(r"stage body1 loaded from local:\S+/snapshots/step-(\d+)/body1\.safetensors \(step (\d+);",
                           swarm.log_text("replacement-body1"))
        assert loaded, "the replacement did not start from a snapshot"
        # A worker steps within a round, before the coordinator counts it: the snapshot can be one step ahead.
        assert 2 <= int(loaded[1]) == int(loaded[2]) <= killed[0] + 1
        steps = [int(n) for name in swarm.procs if "worker" in name or "replacement" in name
                 for n in re.findall(r"stepped on (\d+) samples", swarm.log_text(name))]
        assert steps and max(steps) <= 16, f"a step took more samples than the global batch of 16: {steps}"
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()


@pytest.mark.slow
def test_a_joiner_mid_round_waits_for_the_next_epoch(tmp_path: Path) -> None:
    # Epoch 0 must outlast the late trainer's start (importing torch, joining the DHT, authenticating): its four
    # rounds of about a second each on loopback did not on a clean CI machine, so it has twelve, and the late
    # trainer starts as soon as the epoch's members are fixed (Warmup), not at its first round.
    swarm = launch(tmp_path, tiny(rounds=12, steps=24), ["head", "body1", "tail"])
    late: list[bytes] = []

    def join_late(state: CoordinatorState) -> None:
        if not late and state.phase in (Phase.Warmup, Phase.RoundTrain) and state.epoch == 0:
            key = swarm.start_client("late-trainer", "trainer")
            late.append(bytes(load_keypair(key).pubkey()))

    try:
        history = asyncio.run(watch(swarm, lambda s: s.epoch == 1 and s.phase == Phase.RoundTrain, 240,
                                    join_late))
        in_epoch0 = [s for s in history if s.epoch == 0 and s.pending_index(late[0]) is not None]
        assert in_epoch0, "the late joiner never showed up as pending"
        assert all(s.client_index(late[0]) is None for s in history if s.epoch == 0)
        assert history[-1].client_index(late[0]) is not None
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()


@pytest.mark.slow
def test_server_killed_and_restarted_resumes_the_run(tmp_path: Path) -> None:
    swarm = launch(tmp_path, tiny(rounds=4, steps=8), ["head", "body1", "tail"])
    try:
        before = asyncio.run(watch(swarm, lambda s: s.phase == Phase.RoundTrain and s.step >= 2, 240))[-1]
        swarm.kill("server")
        time.sleep(1)
        swarm.start_server()
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 240))
        resumed = history[0]
        assert resumed.nonce >= before.nonce and resumed.step >= before.step
        assert {c.id for c in resumed.clients} == {c.id for c in before.clients}
        assert history[-1].step == 8
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()


@pytest.mark.slow
def test_workers_checkpoint_to_the_hub_and_cooldown_ends_when_every_stage_is_saved(tmp_path: Path) -> None:
    hub = FakeHub().start()
    try:
        swarm = Swarm(tmp_path, tiny(rounds=2, steps=4).replace("cooldown_time = 5", "cooldown_time = 600"))
        swarm.start_server()
        swarm.start_dht()
        hub_args = ("--hub-repo", "org/run", "--hf-token", "token", "--hf-endpoint", hub.url)
        swarm.start_client("trainer", "trainer")
        for stage in ("head", "body1", "tail"):
            swarm.start_client(f"worker-{stage}", "worker", stage, extra=hub_args)
        history = asyncio.run(watch(swarm, lambda s: s.epoch == 1 and s.phase == Phase.RoundTrain, 240))
        cooldown = next(s for s in history if s.phase == Phase.Cooldown)
        saved = next(s for s in history if all(cp.saved for cp in s.checkpoints[:3]))
        assert {(cp.kind.name, cp.repo, cp.revision) for cp in saved.checkpoints[:3]} == {("Hub", "org/run", "epoch-0")}
        left = next(s for s in history if s.epoch == 1)
        assert left.phase_start - cooldown.phase_start < 60, "a complete checkpoint ends Cooldown early"
        assert {f for (repo, rev, f) in hub.files if (repo, rev) == ("org/run", "epoch-0")} == {
            f"{stage}{suffix}" for stage in ("head", "body1", "tail")
            for suffix in (".safetensors", ".optim.pt", ".json")}
    except (AssertionError, TimeoutError, RuntimeError, StopIteration) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()
        hub.shutdown()


def test_a_swarm_in_a_relative_directory_starts_its_coordinator(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's default directory is relative; its processes run inside it, so every path must be absolute."""
    monkeypatch.chdir(tmp_path)
    swarm = Swarm(Path("runs/demo"), tiny())
    try:
        swarm.start_server()
        assert swarm.procs["server"].poll() is None
    finally:
        swarm.stop()
