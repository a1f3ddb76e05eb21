"""A worker SIGKILLed in the middle of a PowerSGD gradient all-reduce (issue #15's fault test).

Three worker processes of one stage train a small model with the pipeline's own optimizer, averaging their
gradients with PowerSGD (rank 2) before every step. In round STALL the victim stops inside the round, after
phase P and before sending anything in phase Q, and the test SIGKILLs its whole process there. The survivors
are then waiting on it in the middle of phase Q: they drop it (banned sender, failed reducer), step with the
partial result, stay finite, keep error-feedback buffers identical to those from before the failed round, and
go on training as a group of two.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from solders.keypair import Keypair
from torch import nn

from client.averaging.gradients import GradAveraging, GradientAverager, GradientProcess, GradientSettings
from client.averaging.membership import Membership, Roster
from client.averaging.sparta import AveragingStatus, SpartaSettings

ROUNDS = 6
STALL = 2
SETTINGS = GradientSettings(GradAveraging.POWERSGD, rank=2, timeouts=SpartaSettings(
    min_matchmaking_time=2.0, request_timeout=1.0, matchmaking_timeout=6.0, allreduce_timeout=15.0,
    chunk_timeout=5.0, target_group_size=3))  # room for a loaded machine's peers


class _Stalling(GradientProcess):
    """Stops for good when it reaches phase Q of round STALL, after leaving a file that says so."""

    stalled_file = ""

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):  # type: ignore[no-untyped-def]
        if self._round.value == STALL and group_id is not None and group_id.endswith(b"PHASE_Q"):
            Path(self.stalled_file).write_text("stalled")
            await asyncio.sleep(3600)
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)


_Stalling.__name__ = GradientProcess.__name__  # hivemind names its RPC handlers after the class


def worker_key(index: int) -> Keypair:
    """Each worker's key, known to all three: they are the stage's roster."""
    return Keypair.from_seed(bytes([index + 1]) * 32)


def digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors)).hexdigest()


def wait_for_all(ready_dir: Path, index: int) -> None:
    """Start round 0 together: a worker whose imports and DHT took seconds longer than its peers' would miss their
    first group (min_matchmaking_time is 1 s), and the rounds the test reads as of three would be of two."""
    (ready_dir / f"ready-{index}").touch()
    deadline = time.monotonic() + 120
    while len(list(ready_dir.glob("ready-*"))) < 3:
        if time.monotonic() > deadline:
            raise SystemExit(f"worker {index}: its peers never started")
        time.sleep(0.01)


def worker(index: int, peers: list[str], run_id: str, stalled_file: str | None, ready_dir: str) -> None:
    """One worker process: its own DHT node, averager and data; reports each round as a JSON line."""
    from client.pipeline.discovery import start_dht
    from client.pipeline.optim import OptimizerConfig, StageOptimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every worker starts from the same parameters, as a stage's replicas do
    model = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 8))
    optimizer = StageOptimizer(model, "body1", 3, OptimizerConfig(lr=1e-2))
    generator = torch.Generator().manual_seed(100 + index)  # its own data
    inputs, targets = torch.randn(64, 16, generator=generator), torch.randn(64, 8, generator=generator)
    dht = start_dht(peers)
    cls = GradientAverager
    if stalled_file is not None:
        cls = type("Victim", (GradientAverager,), {"process_class": type(
            "GradientProcess", (_Stalling,), {"stalled_file": stalled_file})})
    roster = Roster(0, frozenset(bytes(worker_key(i).pubkey()) for i in range(3)))
    averager = cls(list(model.named_parameters()), dht, run_id=run_id, stage="body1", seed=0, settings=SETTINGS,
                   membership=Membership(worker_key(index), lambda: roster))
    results: list[Any] = []

    def exchange(grads: list[torch.Tensor], samples: int) -> int:
        result = averager.average(grads, samples, len(results), float(samples))
        results.append(result)
        return result.samples

    optimizer.gradient_exchange = exchange
    wait_for_all(Path(ready_dir), index)
    for round_ in range(ROUNDS):
        before = digest(averager.errors)
        loss = nn.functional.mse_loss(model(inputs), targets)
        (loss * len(inputs)).backward()
        loss = float(loss)  # gradient sums, as a worker accumulates them
        stats = optimizer.step(len(inputs))
        result = results[-1]
        report = dataclasses.asdict(result) | {
            "status": result.status.value, "errors_before": before, "errors_after": digest(averager.errors),
            "backup": digest(averager.backup), "loss": loss, "applied": stats.applied,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}
        print(json.dumps({"round": round_, **report}), flush=True)
    averager.shutdown()
    dht.shutdown()


def start_worker(index: int, peers: list[str], run_id: str, stalled_file: Path | None,
                 ready_dir: Path) -> subprocess.Popen:
    code = (f"from tests.integration.test_gradient_faults import worker; "
            f"worker({index}, {peers!r}, {run_id!r}, {str(stalled_file) if stalled_file else None!r}, "
            f"{str(ready_dir)!r})")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=Path(__file__).resolve().parents[2])


def collect(proc: subprocess.Popen, into: dict[int, dict[str, Any]]) -> threading.Thread:
    """Read a worker's round reports as they come (a thread, so that the test can act meanwhile)."""

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                report = json.loads(line)
                into[report["round"]] = report

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_survivors_of_a_worker_killed_mid_allreduce_step_and_keep_their_error_feedback(
        dht, tmp_path: Path) -> None:
    peers = [str(a) for a in dht.get_visible_maddrs()]
    run_id = f"faults-{uuid.uuid4().hex[:8]}"
    stalled = tmp_path / "stalled"
    procs = [start_worker(i, peers, run_id, stalled if i == 2 else None, tmp_path) for i in range(3)]
    reports: dict[int, dict[int, dict[str, Any]]] = {0: {}, 1: {}}
    readers = [collect(procs[i], reports[i]) for i in reports]
    victim: dict[int, dict[str, Any]] = {}
    collect(procs[2], victim)
    try:
        deadline = time.monotonic() + 240
        while not stalled.exists():
            assert time.monotonic() < deadline and procs[2].poll() is None, \
                f"the victim never reached phase Q: {victim}"
            time.sleep(0.02)
        os.kill(procs[2].pid, signal.SIGKILL)  # the whole worker; its hivemind helpers follow their parent
        assert procs[2].wait(timeout=10) == -signal.SIGKILL
        for reader in readers:
            reader.join(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
    assert all(len(r) == ROUNDS for r in reports.values()), f"the survivors stopped training: {reports}"

    for survivor in reports.values():
        assert all(r["finite"] and r["applied"] for r in survivor.values())
        for round_ in range(STALL):  # all three averaged, and error feedback moved
            r = survivor[round_]
            assert (r["status"], r["group_size"], r["complete"]) == (AveragingStatus.AVERAGED.value, 3, True)
            assert r["errors_after"] != r["errors_before"]
        failed = survivor[STALL]  # the partial result: averaged without the victim's phase Q
        assert (failed["status"], failed["group_size"], failed["complete"]) == (
            AveragingStatus.AVERAGED.value, 3, False)
        assert failed["errors_after"] == failed["errors_before"] == failed["backup"]
        after = [survivor[round_] for round_ in range(STALL + 1, ROUNDS)]  # training goes on, the two of them
        for r in after:  # a pair's round that loses a part under load keeps its error feedback, as above
            assert (r["status"], r["group_size"]) == (AveragingStatus.AVERAGED.value, 2)
            if r["complete"]:
                assert r["errors_after"] != r["errors_before"]
            else:
                assert r["errors_after"] == r["errors_before"] == r["backup"]
        assert any(r["complete"] for r in after), "the two survivors never completed a round together"
        assert survivor[ROUNDS - 1]["loss"] < survivor[0]["loss"]
