"""One hivemind averaging round driven from the host process, bounded by timeouts: what SPARTA's parameter
rounds and the per-step gradient rounds share.

hivemind's averager runs in its own process; the host sends it a step through a pipe and waits on a future.
The host must never wait forever: that process may die (a SIGKILL, an OOM) or wedge holding the shared
buffers' lock, and training has to go on either way. So every wait here polls the process's liveness and
ends at a deadline of the round's own timeouts plus a grace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any

from client.averaging.stage_averager import StageAverager

GRACE = 5.0  # seconds beyond a round's own timeouts before the host gives up on the averaging process
POLL = 0.25  # seconds between checks that the averaging process is still alive


class Wedged(RuntimeError):
    """hivemind's averaging process kept the shared buffers locked past every timeout of a round."""


@contextmanager
def holding(lock: Any, timeout: float) -> Iterator[None]:
    """Hold ``lock`` (the averager's lock over its shared buffers), raising ``Wedged`` after ``timeout`` s."""
    if not lock.acquire(timeout=timeout):
        raise Wedged(f"the averaging process held its buffers for over {timeout:.0f} s")
    try:
        yield
    finally:
        lock.release()


def run_round(averager: StageAverager, pipe: threading.Lock, index: int, gather: dict[str, Any], weight: float, *,
              matchmaking_timeout: float, allreduce_timeout: float,
              on_control: Callable[[Any], None] = lambda _: None) -> tuple[dict[Any, dict[str, Any]], str | None]:
    """Run one step of ``averager`` declaring ``gather`` (which must hold ``round`` and ``weight``), with no retry.

    Returns (gathered round data by admitted peer, failure reason or None): empty when no groupmate was
    admitted (``averager.last_refused`` says how many were dropped). ``pipe`` serialises the host's use of
    hivemind's control pipe; ``on_control`` receives the step's control (its ``stage`` tells monitoring where
    the round is).
    """
    with pipe:
        gather = averager.prepare_round(index, gather)
        control = averager.step(gather=gather, weight=float(weight), timeout=matchmaking_timeout,
                                allow_retries=False, wait=False)
    on_control(control)
    deadline = time.monotonic() + matchmaking_timeout + allreduce_timeout + GRACE
    while True:
        try:
            gathered = control.result(timeout=POLL)
            break
        except FutureTimeout:
            if not averager.is_alive():
                return {}, "the averaging process died"
            if time.monotonic() > deadline:
                control.cancel()
                return {}, "the round overran its timeouts and was cancelled"
        except Exception as exc:  # hivemind reports every failure of a round as an exception of its own
            if averager.last_group_size == 0:
                return {}, f"no group formed within {matchmaking_timeout:g} s"
            return {}, f"all-reduce failed: {exc}"
    if not isinstance(gathered, dict):
        return {}, "the averager returned no group data"
    return gathered, None
