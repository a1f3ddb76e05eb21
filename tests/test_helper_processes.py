"""hivemind's helper processes ignore Ctrl+C and SIGTERM (sent to the whole process group) and stop only when
their host shuts them down, so a stopping client prints no tracebacks from half-killed helpers."""

from __future__ import annotations

import os
import signal
import time

import torch


def test_the_dht_node_and_the_averager_ignore_stop_signals_until_shut_down(make_averager) -> None:
    averager = make_averager([("w", torch.zeros(4))])
    helpers = [averager.averager, averager.averager.dht]
    for helper in helpers:
        os.kill(helper.pid, signal.SIGINT)
        os.kill(helper.pid, signal.SIGTERM)
    time.sleep(1.0)
    assert all(helper.is_alive() for helper in helpers)
    averager.shutdown()
    averager.averager.dht.shutdown()
    deadline = time.monotonic() + 10
    while any(helper.is_alive() for helper in helpers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(helper.is_alive() for helper in helpers)


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
