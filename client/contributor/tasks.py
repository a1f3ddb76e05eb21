"""The contributor's background work: tasks it spawns beside following the state, loops it keeps alive.

Nothing a single loop meets (a peer's malformed record, a proof the coordinator refuses in an unexpected way) may
stop another loop, or the client: each loop is supervised on its own and restarted after a growing backoff. Only
work that ends this client's part in the run (``client.contributor.errors``) stops it, through ``on_end``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from client.backends.base import BackendError
from client.contributor.errors import Ending
from coordinator_program.spec.errors import CoordinatorError

log = logging.getLogger("psyswarm.client")

POLL_INTERVAL = 0.5
SUPERVISOR_BACKOFF = (0.5, 5.0)
"""Seconds a failed background loop waits before it restarts: the first wait, and the longest."""


class TaskSet:
    """The asyncio tasks a contributor runs in the background, until ``stop``.

    A task that raises ``CannotContribute`` or ``ContributorRemoved`` hands it to ``on_end``; any other failure is
    logged, with ``where`` the run stood, and forgotten: the next state will ask for the work again if it matters.
    """

    def __init__(self, where: Callable[[], str], on_end: Callable[[Ending], None]) -> None:
        self._where: Callable[[], str] = where
        self._on_end: Callable[[Ending], None] = on_end
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None:
        """Run ``coro`` as a task of this set."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def supervise(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop`` as a task of this set, restarted whenever it fails (``_supervised``)."""
        self.spawn(self._supervised(name, loop), name)

    def stop(self) -> None:
        """Cancel every task still running."""
        for task in list(self._tasks):
            task.cancel()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if isinstance(exc, Ending):
            self._on_end(exc)
            return
        log.error("background work %s failed (%s): %r", task.get_name(), self._where(), exc, exc_info=exc)

    async def _supervised(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop`` until it returns; if it raises, log why, with where the run stood, and restart it after
        a backoff that grows while it keeps failing quickly."""
        first, longest = SUPERVISOR_BACKOFF
        delay = first / 2
        while True:
            started = time.monotonic()
            try:
                await loop()
                return
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure; the log says what it was
                delay = first if time.monotonic() - started > longest else min(delay * 2, longest)
                log.exception("%s failed (%s); restarting it in %.1f s", name, self._where(), delay)
            await asyncio.sleep(delay)


async def poll(step: Callable[[], Awaitable[None]]) -> None:
    """Run ``step`` every POLL_INTERVAL; the coordinator or the network being briefly away is routine."""
    while True:
        await asyncio.sleep(POLL_INTERVAL)
        try:
            await step()
        except (BackendError, CoordinatorError, OSError) as exc:
            log.debug("background: %s", exc)
