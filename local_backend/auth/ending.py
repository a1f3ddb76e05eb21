"""How a slot ends and is freed (the auth service's ``SlotEnding`` part): a slot ends when its holder leaves or
its lease lapses; it is freed only once no join countersigned for it can still be accepted (its deadlines past,
with the coordinator's clock allowed to lag by ``clock_margin``) and the coordinator has confirmed its key gone
(``release.release_ended``), or at once past its deadlines for a service that does not tell a coordinator."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from local_backend.auth.slots import Slot, SlotStore
from local_backend.store import StoreError

log = logging.getLogger("psyswarm.auth")


class SlotEnding:
    """The ending of slots, for ``AuthService``: its slots, store, lock, clock and settings."""

    _slots: dict[str, Slot]
    _store: SlotStore
    _lock: threading.Lock
    clock: Callable[[], float]
    integration_seconds: float
    tells_coordinator: bool
    clock_margin: float

    def due_releases(self) -> list[Slot]:
        """The ended slots whose countersigned joins are all past their deadline, once the leases that lapsed while
        no one asked anything have ended too: those whose keys the coordinator may now be told to withdraw
        (``release.release_ended``)."""
        with self._lock:
            now = self.clock()
            self._in_transaction(lambda: self._expire(now))
            return [slot for slot in self._slots.values() if self._releasable(slot, now)]

    def released(self, slot: Slot) -> bool:
        """The coordinator confirmed that ``slot``'s key is gone: free the slot (False if it was freed already)."""
        with self._lock:
            return self._in_transaction(lambda: self._slots.get(slot.peer) is slot and self._free(slot))

    def _expire(self, now: float) -> None:
        for slot in list(self._slots.values()):
            if slot.ended is None and slot.expires <= now:
                self._end(slot, now, "expired")
            elif slot.ended is None and slot.integrating_since is not None and (
                    now - slot.integrating_since > self.integration_seconds):
                slot.integrating_since, slot.synced = None, True  # gave it its time; stop holding the queue
                self._store.put(slot)
        if not self.tells_coordinator:
            for slot in [s for s in self._slots.values() if self._releasable(s, now)]:
                self._free(slot)

    def _end(self, slot: Slot, now: float, why: str) -> None:
        slot.ended, slot.integrating_since = now, None
        self._store.put(slot)
        log.info("slot %d of %s %s; freed once the coordinator lets its key go", slot.index, slot.contributor, why)

    def _releasable(self, slot: Slot, now: float) -> bool:
        """An ended slot none of whose countersigned joins can still be accepted, whichever clock is behind."""
        return slot.ended is not None and now > slot.countersigned_until + self.clock_margin

    def _free(self, slot: Slot) -> bool:
        del self._slots[slot.peer]
        self._store.drop(slot.peer)
        log.info("slot %d of %s is free: its key has left the coordinator", slot.index, slot.contributor)
        return True

    def _in_transaction(self, change: Callable[[], Any]) -> Any:
        """``change`` in one transaction of the store (the lock held); the slots as committed if it fails."""
        try:
            with self._store.transaction():
                return change()
        except StoreError:
            self._reload_slots()
            raise

    def _reload_slots(self) -> None:
        """Back to the slots last committed, after a change that was not."""
        self._slots = self._store.slots()
