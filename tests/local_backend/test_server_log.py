"""The server's log counts as `psyswarm status` does: rounds from 1, and a finished run in the last epoch it trained
(it said `round 0` where status said `round 1/N`, and `Finished (epoch 1` where status said `epoch 0, finished`)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.swarm.status import describe
from coordinator_program.spec.config import parse_run_spec
from coordinator_program.spec.state import Phase
from tests.local_backend.test_reconfigure import Clock, server
from tests.local_backend.test_server import pipeline

SPEC = parse_run_spec({
    "run_id": "reconf",
    "config": {"min_clients": 4, "max_clients": 8, "warmup_time": 1, "max_round_train_time": 30,
               "round_witness_time": 1, "cooldown_time": 1, "rounds_per_epoch": 1, "total_steps": 1},
    "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
})


def test_the_server_log_numbers_rounds_and_epochs_as_status_does(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()

    async def main() -> str:
        coordinator = server(tmp_path, SPEC, Keypair(), clock)
        port = await coordinator.start(port=0)
        clients = await pipeline(f"127.0.0.1:{port}")
        await clients[0].wait_for(lambda s: s.phase == Phase.Warmup, 10)
        while coordinator.state.phase != Phase.Finished:
            clock.now += 60
            await coordinator.tick_once()
        status = describe(coordinator.state, clock.now)
        for c in clients:
            await c.close()
        await coordinator.stop()
        return status

    with caplog.at_level(logging.INFO, logger="psyswarm.server"):
        status = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("phase ")]
    assert any("-> RoundTrain (epoch 0, round 1/1, step 0/1" in line for line in lines), lines
    finished = next(line for line in lines if "-> Finished" in line)
    epoch = re.search(r"epoch (\d+)", finished)[1]
    assert f"epoch {epoch}, finished" in status, (finished, status)
