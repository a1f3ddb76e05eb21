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

Release = Callable[[bytes], None]
"""Has the coordinator withdraw a key (the join authority's ``release_slot``): returns once the coordinator
confirms the key holds no live slot (withdrawn now, or gone already), raises anything otherwise."""

PERIOD = 5.0  # seconds between passes over the ended slots


def release_ended(service: AuthService, release: Release) -> int:
    """Have the coordinator withdraw the key of every ended slot that is due, and free each slot it confirms; the
    others stay ended, to be tried on the next pass. How many were freed."""
    freed = 0
    for slot in service.due_releases():
        try:
            release(bytes.fromhex(slot.peer))  # no lock held: it waits on the coordinator
        except Exception as exc:
            log.warning("the coordinator has not confirmed the end of slot %d (peer %s…): %s; trying again",
                        slot.index, slot.peer[:8], exc)
            continue
        freed += service.released(slot)
    return freed


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
