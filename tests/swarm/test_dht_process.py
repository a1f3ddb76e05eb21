"""``psyswarm dht`` ends promptly when its process group is told to stop, as the launcher and Ctrl-C do."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from client.swarm.launcher import Swarm
from tests.integration.test_swarm import tiny


@pytest.mark.slow
def test_the_bootstrap_node_and_its_helpers_end_within_seconds_of_sigterm(tmp_path: Path) -> None:
    """SIGTERM reaches hivemind's DHT process too, which then cannot answer a shutdown request: the node used to
    wait for it until the launcher's grace ran out and it was killed."""
    swarm = Swarm(tmp_path, tiny())
    try:
        swarm.start_dht()
        time.sleep(6)  # a node that has run a few seconds: hivemind's process is serving by then
        proc = swarm.procs["dht"]
        members = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(members) >= 2, members  # the node, and hivemind's process (and its p2pd)
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
        assert time.monotonic() - started < 5.0
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in members):
            time.sleep(0.1)
        assert not [pid for pid in members if Path(f"/proc/{pid}").exists() and _alive(pid)], members
    finally:
        swarm.stop()


def _alive(pid: str) -> bool:
    """A zombie (ended, not yet reaped by its parent) does not count."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
