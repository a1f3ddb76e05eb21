"""hivemind's helper processes ignore Ctrl+C and SIGTERM (sent to the whole process group) and stop only when
their host shuts them down, so a stopping client prints no tracebacks from half-killed helpers; and they die
with a host that is killed outright, p2pd included, so nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch


def signal_from_elsewhere(pid: int, signum: int) -> None:
    """Send ``signum`` to ``pid`` from another process, as a shell's stop of the whole group does."""
    subprocess.run([sys.executable, "-c", f"import os; os.kill({pid}, {int(signum)})"], check=True)


def test_the_dht_node_and_the_averager_ignore_stop_signals_until_shut_down(make_averager) -> None:
    averager = make_averager([("w", torch.zeros(4))])
    helpers = [averager.averager, averager.averager.dht]
    for helper in helpers:
        signal_from_elsewhere(helper.pid, signal.SIGINT)
        signal_from_elsewhere(helper.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert all(helper.is_alive() for helper in helpers)
    averager.shutdown()
    averager.averager.dht.shutdown()
    deadline = time.monotonic() + 10
    while any(helper.is_alive() for helper in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(helper.is_alive() for helper in helpers)


def test_a_helper_ends_on_its_hosts_sigterm_as_hivemind_sends_past_the_shutdown_grace() -> None:
    from client.pipeline.discovery import start_dht

    node = start_dht()
    try:
        signal_from_elsewhere(node.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert node.is_alive(), "a SIGTERM from another process (a stop sent to the group) ended the helper"
        node.terminate()  # what hivemind's shutdown does when the helper overruns its grace
        node.join(5)
        assert not node.is_alive(), "the host's own SIGTERM did not end its helper"
    finally:
        if node.is_alive():
            node.kill()


FORGETFUL_HOST = """
from client.pipeline.discovery import start_dht
node = start_dht()
print("ready", flush=True)
"""


def test_a_host_that_never_shut_its_helper_down_still_exits() -> None:
    """multiprocessing's exit hook sends SIGTERM to every daemonic child still running, then waits for each: a
    helper deaf to it held the host (a whole CI run, until its time limit) for ever."""
    host = subprocess.Popen([sys.executable, "-c", FORGETFUL_HOST], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert host.stdout.readline().strip() == "ready"
        assert host.wait(timeout=20) == 0
    finally:
        if host.poll() is None:
            for pid in descendants(host.pid):
                os.kill(pid, signal.SIGKILL)
            host.kill()
            host.wait()


def test_the_host_still_receives_stop_signals() -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        from client.pipeline.discovery import start_dht

        start_dht().shutdown()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]


HOST = """
import sys, time, torch
from solders.keypair import Keypair
from client.averaging.membership import Membership, Roster
from client.averaging.sparta import SpartaAverager
from client.pipeline.discovery import start_dht
from tests.averagers import FAST

averager = SpartaAverager([("w", torch.zeros(4))], start_dht(), run_id="pdeath", stage="head", partitions=1,
                          seed=0, settings=FAST, membership=Membership(Keypair(), lambda: Roster(0, frozenset())))
print("ready", flush=True)
time.sleep(600)
"""


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_helpers_and_p2pd_die_when_their_host_is_killed() -> None:
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[1])
    try:
        assert host.stdout.readline().strip() == "ready"
        helpers = descendants(host.pid)
        names = {open(f"/proc/{pid}/comm").read().strip() for pid in helpers}
        assert "p2pd" in names and len(helpers) >= 3, f"expected the DHT node, its p2pd and the averager: {names}"
    finally:
        host.kill()
        host.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in helpers if alive(pid)], "helpers outlived their SIGKILLed host"
