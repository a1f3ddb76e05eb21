"""Telling the coordinator that slots ended: ``Releaser`` runs ``AuthService.release_ended`` every ``period``
seconds on a thread of its own, so an ended slot's key leaves the coordinator even while no one asks the
service anything, and a coordinator that cannot be reached is asked again until it confirms (the ended slots
are in the store, so a restart forgets none)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from local_backend.auth.rules import AuthService

log = logging.getLogger("psyswarm.auth")

Release = Callable[[list[bytes]], set[bytes]]
"""Has the coordinator withdraw keys (the join authority's ``release_slot``), all of them over one connection:
returns the keys the coordinator confirmed hold no live slot (withdrawn now, or gone already); raises anything
when it could not be asked at all."""

PERIOD = 5.0  # seconds between passes over the ended slots


def release_ended(service: AuthService, release: Release) -> int:
    """Have the coordinator withdraw the keys of the ended slots that are due, in one ``release``, and free each
    slot whose key it confirms; the others stay ended, to be tried on the next pass. How many were freed."""
    due = service.due_releases()
    if not due:
        return 0
    try:
        confirmed = release([bytes.fromhex(slot.peer) for slot in due])  # no lock held: it waits on the coordinator
    except Exception as exc:
        log.warning("could not tell the coordinator that %d slot(s) ended: %s; trying again", len(due), exc)
        return 0
    return sum(service.released(slot) for slot in due if bytes.fromhex(slot.peer) in confirmed)


class Releaser:
    """Sends the coordinator the end of every ended slot that is due, until ``stop``."""

    def __init__(self, service: AuthService, release: Release, period: float = PERIOD) -> None:
        self.service, self.release, self.period = service, release, period
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="auth-releaser", daemon=True)

    def start(self) -> Releaser:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.period):
            try:
                release_ended(self.service, self.release)
            except Exception:  # a store that failed: the ended slots stay, and the next pass tries again
                log.exception("could not go over the ended slots")
