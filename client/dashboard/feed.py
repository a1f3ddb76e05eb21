"""Following the coordinator for the page: read-only, reconnecting, and never stopped by what a peer sends.

The coordinator state comes through a ``Backend`` (TCP or Solana) opened with a throwaway key: the dashboard
reads, it never signs an instruction. The DHT and the auth service are read on threads (their clients block),
each at its own pace, and a failure of either only blanks its part of the page.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from client.backends.base import Backend, BackendError
from client.dashboard.history import RoundResult
from client.dashboard.view import Timeline, snapshot
from coordinator_program.spec.state import CoordinatorState

log = logging.getLogger("psyswarm.dashboard")

REFRESH_SECONDS = 1.0
"""How often the view is rebuilt (the time left in a phase counts down even when the state does not change)."""
DHT_SECONDS = 2.0
CONTRIBUTORS_SECONDS = 5.0
RETRY_SECONDS = 2.0


@dataclasses.dataclass
class DhtReading:
    """What the run's DHT shows: each stage's announced worker records, and the results of the rounds read."""

    announced: Mapping[str, Sequence[Any]]
    results: Sequence[RoundResult] = ()


def reason_of(exc: BaseException) -> str:
    """A failure as one line, even for exceptions whose message is empty."""
    return (str(exc) or type(exc).__name__).splitlines()[0]


class Feed:
    """The latest view of one run (``view``), kept fresh while ``run()`` runs."""

    def __init__(self, open_backend: Callable[[], Backend], run_id: str, *,
                 read_dht: Callable[[CoordinatorState], DhtReading] | None = None,
                 read_contributors: Callable[[str], dict[str, str]] | None = None,
                 clock: Callable[[], float] = time.time, retry_seconds: float = RETRY_SECONDS) -> None:
        self.open_backend, self.run_id = open_backend, run_id
        self.read_dht, self.read_contributors = read_dht, read_contributors
        self.clock, self.retry_seconds = clock, retry_seconds
        self.timeline = Timeline()
        self.state: CoordinatorState | None = None
        self.announced: Mapping[str, Sequence[Any]] | None = None
        self.contributors: dict[str, str] | None = None
        self.problems: dict[str, str] = {}
        self.view: dict[str, Any] = {"error": "connecting to the coordinator", "problems": {}}

    async def run(self) -> None:
        """Follow the coordinator for ever: on any failure, say so on the page and connect again."""
        while True:
            backend = None
            try:
                backend = self.open_backend()
                await backend.connect()
                if backend.state.run_id != self.run_id:
                    raise BackendError(f"it serves run {backend.state.run_id!r}, not {self.run_id!r} (check --run-id)")
                await self._follow(backend)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever the backend or a peer did, the page says it
                self._unreachable(reason_of(exc))
            finally:
                if backend is not None:
                    with contextlib.suppress(Exception):
                        await backend.close()
            await asyncio.sleep(self.retry_seconds)

    async def _follow(self, backend: Backend) -> None:
        refresher = asyncio.create_task(self._refresh_forever())
        try:
            async for state in backend.updates():
                self.state = state
                self.rebuild()
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher

    async def _refresh_forever(self) -> None:
        last_dht = last_contributors = -float("inf")
        while True:
            now = time.monotonic()
            if self.read_dht is not None and now - last_dht >= DHT_SECONDS:
                last_dht = now
                await self._read("dht", self._read_dht)
            if self.read_contributors is not None and now - last_contributors >= CONTRIBUTORS_SECONDS:
                last_contributors = now
                await self._read("identities", self._read_contributors)
            self.rebuild()
            await asyncio.sleep(REFRESH_SECONDS)

    async def _read(self, part: str, read: Callable[[CoordinatorState], None]) -> None:
        """Run one blocking read on a thread; its failure is shown on the page next to its part."""
        state = self.state
        if state is None:
            return
        try:
            await asyncio.to_thread(read, state)
            self.problems.pop(part, None)
        except Exception as exc:  # noqa: BLE001 - a DHT peer or the auth service failing must not stop the page
            self.problems[part] = reason_of(exc)

    def _read_dht(self, state: CoordinatorState) -> None:
        assert self.read_dht is not None
        reading = self.read_dht(state)
        self.announced = reading.announced
        for result in reading.results:
            self.timeline.record(result)

    def _read_contributors(self, state: CoordinatorState) -> None:
        assert self.read_contributors is not None
        self.contributors = self.read_contributors(state.run_id)

    def rebuild(self) -> None:
        if self.state is None:
            return
        try:
            view = snapshot(self.state, self.clock(), announced=self.announced, timeline=self.timeline,
                            contributors=self.contributors, dht=self.read_dht is not None)
        except Exception as exc:  # noqa: BLE001 - a state the view cannot read must not stop the refreshing
            log.exception("cannot show the coordinator state")
            view = {**self.view, "error": f"cannot show the coordinator state: {reason_of(exc)}"}
        self.view = {**view, "problems": dict(self.problems)}

    def _unreachable(self, reason: str) -> None:
        """Keep the last view, marked: the page shows the reason and that it is retrying."""
        self.view = {**self.view, "error": f"coordinator unreachable: {reason}"}
