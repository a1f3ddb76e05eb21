"""A worker told to stop (SIGTERM, as Ctrl-C or a service manager sends) leaves cleanly and keeps what it trained:
real server, DHT, workers and trainer on loopback."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from pathlib import Path

import pytest

from client.identity import load_keypair
from coordinator_program.spec.state import Health, Phase
from tests.integration.test_swarm import fail_with_logs, launch, tiny, watch


@pytest.mark.slow
def test_a_sigtermed_worker_withdraws_at_once_and_its_restart_resumes_at_its_step(tmp_path: Path) -> None:
    """Before: the worker stayed listed (Healthy) until the health checks dropped it, the round waited out its
    max_round_train_time with the worker's stage empty, and its restart started the stage from the seed (no
    snapshot is taken before step 10)."""
    swarm = launch(tmp_path, tiny(rounds=20, steps=20, train_time=15), ["head", "body1", "tail"])
    name = "worker1-body1"
    me = bytes(load_keypair(tmp_path / "keys" / f"{name}.json").pubkey())
    try:
        asyncio.run(watch(swarm, lambda s: s.phase == Phase.RoundTrain and s.step >= 3, 240))
        # the coordinator counts a step when its round closes; the worker applies it a moment later
        stepped = re.compile(r"body1\.\S+ step 3:")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not stepped.search(swarm.log_text(name)):
            time.sleep(0.2)
        assert stepped.search(swarm.log_text(name)), swarm.log_text(name)[-3000:]
        proc = swarm.procs[name]
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        def withdrawn(state) -> bool:
            index = state.client_index(me)
            return index is None or state.clients[index].health == Health.Withdrawn

        seen = asyncio.run(watch(swarm, withdrawn, 10))
        assert time.monotonic() - signalled < 8, "the coordinator learned of the leave only from its health checks"
        index = seen[-1].client_index(me)
        assert index is None or seen[-1].clients[index].health == Health.Withdrawn
        withdrawn_at = time.monotonic()  # body1 had no other worker: nothing more can be trained this round
        asyncio.run(watch(swarm, lambda s: s.phase != Phase.RoundTrain, 20))
        assert time.monotonic() - withdrawn_at < 5, "the round waited out max_round_train_time (15 s), its stage empty"
        assert proc.wait(10) == 0
        log = swarm.log_text(name)
        saved = re.search(r"stage body1 saved at step (\d+) under", log)
        assert saved, log[-3000:]
        step = int(saved[1])
        assert step >= 3

        swarm.start_client(name, "worker", "body1")  # the same keypair, the same checkpoint directory
        loaded = re.compile(r"stage body1 loaded from (.*) \(step (\d+);")
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not loaded.search(swarm.log_text(name).split(saved[0])[-1]):
            assert swarm.procs[name].poll() is None, swarm.log_text(name)[-3000:]
            time.sleep(1)
        found = loaded.search(swarm.log_text(name).split(saved[0])[-1])
        assert found, swarm.log_text(name)[-3000:]
        assert "snapshots" in found[1] and int(found[2]) == step, found[0]
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()
