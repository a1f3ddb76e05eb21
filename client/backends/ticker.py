"""Ticking a coordinator that nobody ticks for the clients: the Solana program, in Psyche's manner.

Every client simulates the tick on its cached state and sends a real one only when the state would change.
With many clients, each sends with probability 2/clients, so a due transition costs about two
transactions rather than one per client; a client whose tick lost the race gets ``NothingToTick``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import random
import time
from collections.abc import Callable

from client.backends.base import Backend, BackendError
from coordinator_program.spec import rules
from coordinator_program.spec.errors import CoordinatorError, NothingToTick
from coordinator_program.spec.state import CoordinatorState

log = logging.getLogger("psyswarm.ticker")

TICK_INTERVAL = 0.5


def tick_due(state: CoordinatorState, now: int) -> bool:
    """Whether a tick at ``now`` would change the state (simulated on a copy)."""
    trial = copy.deepcopy(state)
    try:
        rules.tick(trial, now, 0)
    except CoordinatorError:
        return False
    return True


def send_share(state: CoordinatorState) -> float:
    """The chance that this client sends a due tick: everyone when few, about two senders when many."""
    members = len(state.clients) + len(state.pending)
    return 1.0 if members <= 2 else 2.0 / members


async def tick_when_due(current: Callable[[], Backend], *, interval: float = TICK_INTERVAL,
                        rng: random.Random | None = None, clock: Callable[[], float] = time.time) -> None:
    """Run until cancelled: every ``interval``, tick the coordinator if a transition is due.

    ``current`` returns the backend to use, which may change when a client reconnects."""
    rng = rng or random.Random()
    while True:
        await asyncio.sleep(interval)
        backend = current()
        try:
            state = backend.state
        except BackendError:
            continue
        if not tick_due(state, int(clock())) or rng.random() >= send_share(state):
            continue
        try:
            await backend.tick()
            log.debug("ticked %s", state.phase.name)
        except NothingToTick:
            pass  # another client's tick got there first
        except (CoordinatorError, BackendError) as exc:
            log.debug("tick not sent: %s", exc)
