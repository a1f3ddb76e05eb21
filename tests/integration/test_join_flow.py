"""The contributor join flow end to end: `join-run --auth-url` through authorization, a stale snapshot, the
join queue, sync phases 1 and 2, SPARTA averaging with the stage's peer, then full participation.

Real processes on loopback: the TCP coordinator, a DHT bootstrap, the auth service, workers and a trainer;
the Hugging Face Hub (token identities and the snapshot files) is the one stand-in (tests.fake_hub)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
from solders.keypair import Keypair

from client.identity import save_keypair
from client.pipeline.model import ModelConfig, build_stage
from client.swarm.launcher import Swarm
from coordinator_program.spec.state import Phase
from tests.fake_hub import FakeHub
from tests.integration.test_swarm import TINY, fail_with_logs, watch

SYNCED = """
sparta_every = 1
sparta_partitions = 2
max_allowed_stale = 1
sync_phase1_steps = 1
sync_phase2_steps = 1
"""

SNAPSHOT = ("org/snapshots", "main")
STEPS = 12  # 6 epochs of 2 rounds: room for the joiner to be admitted late, sync for 2 steps, then train
TOKENS = {"token-alice": "alice", "token-bob": "bob", "token-carol": "carol"}


def publish_stale_snapshot(hub: FakeHub) -> None:
    """The auth service's periodic snapshot of the head stage, taken at step 0: the seed's parameters."""
    config = ModelConfig(n_layers=3, d_model=32, n_heads=2, seq_len=32, num_stages=3, seed=0)
    hub.publish(SNAPSHOT[0], "head.safetensors", safetensors.torch.save(build_stage(config, "head").state_dict()),
                SNAPSHOT[1])
    hub.publish(SNAPSHOT[0], "head.json", json.dumps({"step": 0}).encode(), SNAPSHOT[1])


def join_args(url: str, hub: FakeHub, token: str) -> tuple[str, ...]:
    return ("--auth-url", url, "--hf-token", token, "--hf-endpoint", hub.url)


def cli(swarm: Swarm, *args: str) -> subprocess.CompletedProcess:
    """Run one CLI command to completion in the swarm's directory."""
    return subprocess.run([sys.executable, "-m", "client.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=swarm.workdir)


def wait_for_line(swarm: Swarm, name: str, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in swarm.log_text(name):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not log {text!r} within {timeout:.0f} s")
        time.sleep(0.2)


def keypair(path: Path) -> Path:
    save_keypair(Keypair(), path)
    return path


def rounds_stepped(log: str) -> dict[tuple[int, int], int]:
    """Samples each round's optimizer step took, from a worker's log."""
    found = re.findall(r"round (\d+)\.(\d+): stepped on (\d+) samples", log)
    return {(int(e), int(h)): int(n) for e, h, n in found}


@pytest.mark.slow
def test_a_contributor_joins_through_auth_syncs_from_a_stale_snapshot_and_averages(tmp_path: Path) -> None:
    hub = FakeHub().start()
    hub.users.update(TOKENS)
    publish_stale_snapshot(hub)
    toml = TINY.format(min_clients=4, rounds=2, steps=STEPS, train_time=20) + SYNCED
    swarm = Swarm(tmp_path, toml, auth_service=True)  # the coordinator admits only joins the service countersigns
    try:
        swarm.start_server()
        swarm.start_dht()
        url = swarm.start_auth(stages=3, capacity=5, hf_endpoint=hub.url, snapshot=SNAPSHOT)

        # Step 1, refused: a bad token, before anything else happens.
        bad = cli(swarm, "join-run", *swarm.target, "--run-id", "it", "--role", "worker", "--initial-peer",
                  swarm.peer, "--keypair", str(keypair(tmp_path / "bad.json")), *join_args(url, hub, "not-a-token"))
        assert bad.returncode == 1 and "token was rejected" in bad.stderr, bad.stderr[-2000:]

        # alice runs the trainer and two workers (one contributor, three slots); bob runs the third worker.
        swarm.start_client("trainer", "trainer", extra=join_args(url, hub, "token-alice"))
        for name, token in (("worker-a", "token-alice"), ("worker-b", "token-alice"), ("worker-c", "token-bob")):
            swarm.start_client(name, "worker", extra=join_args(url, hub, token))
        asyncio.run(watch(swarm, lambda s: s.phase == Phase.Warmup, 180))

        # carol joins mid-epoch: queued until the next epoch; the least occupied stage is head, and the only
        # snapshot of it is from step 0: at least 2 steps behind with max_allowed_stale = 1, so she syncs.
        swarm.start_client("joiner", "worker", extra=join_args(url, hub, "token-carol"))
        wait_for_line(swarm, "joiner", "[AUTH]")
        # The swarm is full now (5 slots taken): a sixth process is rejected at authorization.
        full = cli(swarm, "join-run", *swarm.target, "--run-id", "it", "--role", "trainer", "--initial-peer",
                   swarm.peer, "--keypair", str(keypair(tmp_path / "sixth.json")), *join_args(url, hub, "token-bob"))
        asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 400))
        joiner = swarm.log_text("joiner")
        lines = [line for line in joiner.splitlines() if line.startswith(("[SYNC]", "[AUTH]"))]
        proofs = [m for n in swarm.procs for m in re.findall(r"round proof sent for (\d+)\.(\d+): (\d+) participants",
                                                             swarm.log_text(n))]
        head = next(n for n in ("worker-a", "worker-b", "worker-c") if "stage head" in swarm.log_text(n))
        peer_log = swarm.log_text(head)
    except (AssertionError, TimeoutError, RuntimeError, StopIteration) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()
        hub.shutdown()

    assert full.returncode == 1 and "join rejected" in full.stderr, full.stderr[-2000:]
    # Step 1: one line confirms the slot and the stage; alice's processes are one contributor.
    assert re.search(r"\[AUTH\] Authorized as carol: slot \d of 5 in run it, stage head$", lines[0]), lines
    alice = [swarm.log_text(n) for n in ("trainer", "worker-a", "worker-b")]
    assert any("other process(es) under this identity" in text for text in alice)
    # Steps 2 and 4-6: the stale snapshot, then the seed's lines with the real N and E, in order.
    start = int(re.search(r"loaded from hub:org/snapshots@main/head.safetensors \(step 0; the swarm is at step (\d+)\)",
                          joiner).group(1))
    assert 2 <= start <= STEPS - 4, f"admitted at step {start}: too late to sync and then train"
    assert lines[1:] == [
        "[SYNC] Synchronising weights with peers. Node won't process batches in this phase.",
        f"[SYNC] This phase will last 1 steps (until local epoch {start + 1}).",
        "[SYNC] Synchronising optimizer state. Node is now processing batches, but doesn't contribute to weight "
        "averaging yet.",
        f"[SYNC] This phase will last 1 steps (until local epoch {start + 2}).",
        "[SYNC] Sync complete. Node is now fully contributing to training.",
    ]
    # Phase 1: trainers skip the joiner, so its first round stepped on nothing; once active, it works.
    stepped = rounds_stepped(joiner)
    first = min(stepped)
    assert stepped[first] == 0, stepped
    assert sum(stepped.values()) > 0, stepped
    # Presence is credited from phase 1: the witnesses counted all 5 clients in the joiner's phase-1 round.
    assert max(int(n) for e, h, n in proofs if (int(e), int(h)) == first) == 5, proofs
    # SPARTA: the head's two workers averaged (the joiner with weight 0 while syncing).
    assert re.search(r"head averaging round \d+ \(partition \d\): averaged, group of 2", peer_log), peer_log[-3000:]
    assert re.search(r"head averaging round \d+ \(partition \d\): averaged, group of 2", joiner), joiner[-3000:]
