"""Fault tolerance of SPARTA in a running swarm: a worker whose averaging keeps failing withdraws from the run,
and the run goes on with its stage peer (seeds/fault-tolerance.txt: "contributors that consistently fail are
removed from the swarm"; "a peer failure is fatal only if an entire pipeline stage empties")."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest

from client.identity import load_keypair
from client.swarm.launcher import Swarm
from coordinator_program.spec.instructions import Withdraw, decode_instruction
from coordinator_program.spec.state import Phase
from local_backend.store import RunStore
from tests.integration.test_join_flow import wait_for_line
from tests.integration.test_swarm import TINY, fail_with_logs, watch

AVERAGE_EVERY_STEP = """
sparta_every = 1
sparta_partitions = 2
"""


def python_children(pid: int) -> list[int]:
    """The forked Python helpers of a process (hivemind's DHT node first, then the averager), oldest first."""
    # Each thread lists the children it forked, and the client forks its helpers from worker threads.
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    exe = os.readlink(f"/proc/{pid}/exe")
    return sorted(int(c) for c in children if os.path.exists(f"/proc/{c}") and os.readlink(f"/proc/{c}/exe") == exe)


@pytest.mark.slow
def test_a_worker_whose_averaging_keeps_failing_withdraws_and_the_run_goes_on(tmp_path: Path) -> None:
    # One epoch of 6 rounds, so that the run must go on within it once a worker has left; min_clients = 4,
    # so that losing one of the 5 clients does not end the epoch.
    swarm = Swarm(tmp_path, TINY.format(min_clients=4, rounds=6, steps=6, train_time=20) + AVERAGE_EVERY_STEP)
    try:
        swarm.start_server()
        swarm.start_dht()
        swarm.start_client("trainer", "trainer")
        for name, stage in (("head-a", "head"), ("body1", "body1")):
            swarm.start_client(name, "worker", stage)
        broken_key = swarm.start_client("head-b", "worker", "head")
        broken_id = bytes(load_keypair(broken_key).pubkey())
        # The tail completes the pipeline: start it once the others are queued, so all five enter epoch 0.
        asyncio.run(watch(swarm, lambda s: len(s.pending) >= 4, 120))
        swarm.start_client("tail", "worker", "tail")
        wait_for_line(swarm, "head-b", "serving stage head", timeout=180)
        helpers = python_children(swarm.procs["head-b"].pid)
        assert len(helpers) == 2, helpers  # the DHT node and the averager
        os.kill(helpers[-1], signal.SIGKILL)  # its averaging process dies; its worker keeps serving batches

        asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 300))
        assert swarm.procs["head-b"].wait(30) == 1
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        swarm.stop()

    broken, healthy = swarm.log_text("head-b"), swarm.log_text("head-a")
    assert broken.count("(the averaging process is not running)") >= 3, broken[-3000:]
    assert "3 averaging rounds failed in a row" in broken and "left the run:" in broken
    # The coordinator's own log, not a follower's sample: a withdrawn client leaves the list at the next round's
    # start, often in the same second, so a follower can miss the state that shows it Withdrawn.
    store = RunStore(tmp_path / "run.sqlite")
    try:
        withdrawals = [op for op in store.operations()
                       if bytes(op[1]) == broken_id and isinstance(decode_instruction(bytes(op[2])), Withdraw)]
    finally:
        store.close()
    assert withdrawals, "the coordinator never recorded the worker's withdrawal"
    # Its peer was never blamed: rounds without a group do not count against it, and it trained every one of
    # the run's 6 steps (in epoch 0, or in epoch 1 if a round the leaver was elected to witness ended it).
    assert "withdrew" not in healthy, healthy[-3000:]
    assert len(re.findall(r"round \d+\.\d+: stepped on", healthy)) == 6, healthy[-3000:]
