"""A coordinated swarm whose head stage has two workers mixing their parameters by PowerGossip (``gossip_rank``):
the run finishes, and every round after a step is a pair's gossip round that moved both, in place of SPARTA's."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from coordinator_program.spec.state import Phase
from tests.integration.test_swarm import fail_with_logs, launch, tiny, watch

GOSSIP_EVERY_STEP = """
sparta_every = 1
gossip_rank = 2
grad_values = "int8"
"""


@pytest.mark.slow
def test_a_stage_s_two_workers_gossip_every_step_and_the_run_finishes(tmp_path: Path) -> None:
    swarm = launch(tmp_path, tiny(min_clients=5, rounds=4, steps=4) + GOSSIP_EVERY_STEP,
                   ["head", "head", "body1", "tail"])
    try:
        asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 300))
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()
    for name in ("worker0-head", "worker1-head"):
        log = swarm.log_text(name)
        averaged = re.findall(r"head gossip round (\d+): averaged, group of 2", log)
        assert len(averaged) >= 3, log[-3000:]  # a round may miss its partner on a loaded machine
        assert "averaging round" not in log, "a SPARTA round ran in a gossip run"
