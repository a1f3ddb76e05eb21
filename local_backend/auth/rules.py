"""The auth service's rules (``AuthService``): who gets a slot and which stage, the join queue, leases, and
which joins the run's join authority countersigns for whom.

Slots: a join needs a free slot (a full swarm rejects it outright; there is no waiting list) and gets the least
occupied stage. One identity (Hub user) holds at most ``max_slots_per_token`` slots, each process (each peer key)
its own. Slots are leases: a client renews its slot by joining again, and one not renewed within
``lease_seconds`` frees itself.

Pacing (the join queue): at most ``max_integrating`` admitted peers integrate (download state, sync) at once;
the others wait in join order, keeping their slots. Only the service moves the queue: it admits the peer at
the head when it asks and there is room, and a peer may report itself synced only once admitted (a waiting
peer that reports is refused, so none can skip the queue), or stops integrating after ``integration_seconds``
so a joiner that crashed does not hold the queue.

Ending (the cap the coordinator enforces): a slot that ends (its holder leaves, its lease lapses) is not free
yet. The coordinator keeps one live key per slot (the join carries the slot) and admits no countersigned join
past its deadline (at most ``COUNTERSIGN_SECONDS`` ahead), so the service waits until every join it countersigned
for the slot is past its deadline, then has the coordinator withdraw the slot's key (``release_slot``, sent by
``release.Releaser`` until the coordinator confirms) and only then frees the slot. Until then the slot still
counts toward its contributor's cap and the swarm's capacity, so a contributor's keys in the coordinator never
outnumber its cap, whatever the order of grants, leaves and lapses.

Each request is one transaction of the slot store: its nonce is spent, old slots expire and the change is
applied together, and the answer leaves only once it commits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from solders.keypair import Keypair
from solders.pubkey import Pubkey

from coordinator_program.onchain.program_id import PROGRAM_ID
from coordinator_program.spec import limits
from coordinator_program.spec.instructions import JoinRun
from local_backend.auth.countersign import check_join, join_to_countersign, message_bytes
from local_backend.auth.ending import SlotEnding
from local_backend.auth.failures import AuthFailure, bad_request
from local_backend.auth.protocol import MAX_CLOCK_SKEW, ROLES, canonical, token_sha256
from local_backend.auth.requests import SignedRequest, check_signed
from local_backend.auth.slots import (
    NONCES_PER_ADDRESS,
    NONCES_PER_TOKEN,
    Slot,
    SlotStore,
    admitted,
    drop_misfits,
    free_index,
    held_by,
    integrating,
    least_occupied_stage,
    waiting,
)
from local_backend.store import StoreError

log = logging.getLogger("psyswarm.auth")

GRANTS_KEPT = 1024  # keys the contributor map remembers (the newest granted); a ledger holds 256
COUNTERSIGN_SECONDS = 120.0  # the furthest deadline a countersigned join may carry
CLOCK_MARGIN = MAX_CLOCK_SKEW  # how far the coordinator's clock may lag this service's



def _token_mismatch() -> AuthFailure:
    return AuthFailure(HTTPStatus.UNAUTHORIZED, "token_mismatch",
                       "the request is signed for another Hugging Face token than the one its slot is held under")


@dataclass
class AuthService(SlotEnding):
    """Slot, stage and queue bookkeeping for one run; thread-safe. ``identify`` maps a token to a user name;
    ``db`` is the SQLite file that keeps the slots (``":memory:"`` keeps nothing across restarts)."""

    run_id: str
    num_stages: int
    capacity: int
    identify: Callable[[str], str]
    max_slots_per_token: int
    db: str | Path
    keypair: Keypair = field(default_factory=Keypair)
    lease_seconds: float = 600.0
    max_integrating: int = 1
    integration_seconds: float = 900.0
    checkpoint: dict[str, str] | None = None
    clock: Callable[[], float] = time.time
    nonces_per_token: int = NONCES_PER_TOKEN
    nonces_per_address: int = NONCES_PER_ADDRESS
    grants_kept: int = GRANTS_KEPT  # never fewer than ``capacity``: every live slot stays mapped
    program_id: Pubkey = PROGRAM_ID  # the coordinator program whose joins it countersigns on Solana
    tells_coordinator: bool = True  # False (tests of this service alone): an ended slot frees once its joins expire
    clock_margin: float = CLOCK_MARGIN  # how far the coordinator's clock may lag this one
    publish_contributors: bool = False  # whether anyone may read which Hub user holds which key

    def __post_init__(self) -> None:
        if (self.num_stages < 2 or not 1 <= self.capacity < limits.NO_SLOT or self.lease_seconds <= 0
                or self.max_integrating < 0 or self.max_slots_per_token < 1 or min(self.nonces_per_token,
                                                                                    self.nonces_per_address) < 1):
            raise ValueError(f"need num_stages >= 2, 1 <= capacity < {limits.NO_SLOT}, max_slots_per_token >= 1, "
                             "lease_seconds > 0, max_integrating >= 0, nonces_per_token >= 1, nonces_per_address >= 1")
        self._store = SlotStore(self.db, self.run_id)
        self._lock = threading.Lock()
        self._slots = self._store.slots()
        drop_misfits(self._store, self._slots, self.num_stages, self.capacity)

    # --- requests ---

    def join(self, token: str, request: Any, address: str = "") -> dict[str, Any]:
        """Grant (or renew) the requesting peer's slot; the signed grant is the answer."""
        signed = check_signed(request, "join", self.run_id, self.clock())
        role = signed.fields["role"]
        if role not in ROLES:
            raise bad_request(f"role must be one of {ROLES}, not {role!r}")
        if signed.token_sha256 != token_sha256(token):
            raise AuthFailure(HTTPStatus.UNAUTHORIZED, "token_mismatch",
                              "the request is signed for another Hugging Face token than the one it was sent with")
        contributor = self.identify(token)  # outside the lock: it may call the Hub
        grant = self._apply(signed, lambda now: self._grant(signed, contributor, now), address=address, holder=False)
        signature = bytes(self.keypair.sign_message(canonical(grant))).hex()
        return {"grant": grant, "signature": signature, "service": bytes(self.keypair.pubkey()).hex()}

    def queue(self, request: Any) -> dict[str, Any]:
        """The peer's place in the join queue: 0 and ``admitted`` means go and sync now, 1 is next in line."""
        signed = check_signed(request, "queue", self.run_id, self.clock())
        return self._apply(signed, lambda now: self._place(self._renew(self._own(signed), now), now))

    def synced(self, request: Any) -> dict[str, Any]:
        """The peer finished its sync phases: the next queued joiner may integrate. Only an admitted peer may
        say so: from a waiting one it would be a way past the queue."""
        signed = check_signed(request, "synced", self.run_id, self.clock())
        return self._apply(signed, lambda now: self._mark_synced(self._own(signed), now))

    def leave(self, request: Any) -> dict[str, Any]:
        signed = check_signed(request, "leave", self.run_id, self.clock())
        try:
            return self._apply(signed, lambda now: self._release(signed, now))
        except AuthFailure as refusal:
            if refusal.code != "no_slot":
                raise
            return {"ok": True}  # nothing to leave: answered, and nothing spent

    def countersign(self, request: Any) -> dict[str, str]:
        """The join authority's signature over ``message``, a join of the requesting peer's own key into this
        run, in the role (and, for a worker, the stage) its slot was granted; the slot must be live."""
        signed = check_signed(request, "countersign", self.run_id, self.clock())
        message = message_bytes(signed.fields["message"])
        joiner, join = join_to_countersign(message, self.keypair.pubkey(), self.program_id, self.run_id)
        self._apply(signed, lambda now: self._check_join(self._own(signed), joiner, join, now))
        return {"signature": bytes(self.keypair.sign_message(message)).hex()}

    def occupancy(self) -> dict[str, Any]:
        """Live slots per stage and contributors (the dashboard's view); needs no authentication."""
        with self._lock:
            now = self.clock()
            slots = [s for s in self._slots.values() if s.ended is None and s.expires > now]
        return {
            "run_id": self.run_id, "capacity": self.capacity, "slots": len(slots),
            "contributors": len({s.contributor for s in slots}),
            "stages": [sum(s.stage == i for s in slots) for i in range(self.num_stages)],
            "trainers": sum(s.role == "trainer" for s in slots),
        }

    def contributors(self, run_id: str) -> dict[str, str]:
        """Which contributor each key granted a slot belongs to, by base58 public key: what lets a leaderboard sum
        one contributor's processes into one score. A key that left stays mapped (its points outlive its slot),
        for the ``grants_kept`` keys granted or renewed last. Only keys and Hub user names leave, never a token or
        its hash. Another run's id gets an empty map (this service knows one run). The map is the operator's to
        publish (``publish_contributors``): it ties keys to people, so it is refused unless published."""
        if not self.publish_contributors:
            raise AuthFailure(HTTPStatus.FORBIDDEN, "contributors_private",
                              "this run's contributor map is private (its operator may publish it with "
                              "`psyswarm auth-service --publish-contributors`)")
        if run_id != self.run_id:
            return {}
        with self._lock:
            return {str(Pubkey.from_bytes(bytes.fromhex(peer))): name for peer, name in self._store.grants()}

    def close(self) -> None:
        with self._lock:
            self._store.close()

    # --- one request, one transaction ---

    def _apply(self, signed: SignedRequest, change: Callable[[float], dict[str, Any]], *, address: str = "",
               holder: bool = True) -> dict[str, Any]:
        """Expire old slots, spend the request's nonce and apply ``change``, all in one transaction; answer only
        once it commits.

        A request that can change nothing spends nothing: with ``holder``, one from a peer holding no live slot
        under its token, or signed before its slot was granted (so no later slot of the peer is open to it). A
        join (``holder`` False) may make a slot, so it spends, within its token's quota and, unless it renews
        a slot the peer holds, its address's; a request past a quota is refused and spends nothing. Otherwise a
        refused request still spends its nonce: it cannot be replayed later, when the refusal may no longer hold.
        """
        refusal: AuthFailure | None = None
        answer: dict[str, Any] = {}
        with self._lock:
            try:
                with self._store.transaction():
                    now = self.clock()
                    self._expire(now)
                    try:
                        self._check_fresh(signed, now, address, holder)
                        self._store.spend_nonce(signed.peer, signed.nonce, signed.time, signed.token_sha256,
                                                address, forget_before=now - MAX_CLOCK_SKEW)
                        answer = change(now)
                    except AuthFailure as failure:
                        refusal = failure
            except StoreError as exc:
                self._reload_slots()
                log.error("the auth service's database failed: %s", exc)
                raise AuthFailure(HTTPStatus.SERVICE_UNAVAILABLE, "storage_unavailable",
                                  "the auth service could not save the request; try again") from None
            except Exception:
                self._reload_slots()
                raise
        if refusal is not None:
            raise refusal
        return answer

    def _check_fresh(self, signed: SignedRequest, now: float, address: str, holder: bool) -> None:
        """Refuse, before its nonce is spent, a replay, a slot holder's request that can change nothing, and a
        request past its token's or address's quota."""
        if self._store.nonce_spent(signed.peer, signed.nonce):
            raise AuthFailure(HTTPStatus.CONFLICT, "replayed_request",
                              "this request's nonce was already used: a request is accepted once")
        slot = self._slots.get(signed.peer)
        if holder:
            self._own(signed)
        elif slot is not None and slot.ended is None and slot.token_sha256 == signed.token_sha256:
            address = ""  # a renewal: charged to the slot's token alone
        by_token, by_address = self._store.nonces_of(signed.token_sha256, address, now - 2 * MAX_CLOCK_SKEW)
        if by_token >= self.nonces_per_token or (address and by_address >= self.nonces_per_address):
            raise AuthFailure(HTTPStatus.TOO_MANY_REQUESTS, "too_many_requests",
                              f"more than {self.nonces_per_token} requests of this token (or "
                              f"{self.nonces_per_address} of this address) in {2 * MAX_CLOCK_SKEW:.0f} s; slow down")

    # --- the changes (under the lock, inside the transaction; each checks before it changes anything) ---

    def _grant(self, signed: SignedRequest, contributor: str, now: float) -> dict[str, Any]:
        role = signed.fields["role"]
        slot = self._slots.get(signed.peer)
        if slot is not None and slot.ended is not None:
            raise AuthFailure(HTTPStatus.CONFLICT, "slot_ending",
                              f"this peer key's slot {slot.index} ended and the coordinator is being told; join "
                              "again in a minute or two (or with a fresh keypair, if its contributor has room)")
        if slot is not None and (slot.contributor, slot.role, slot.token_sha256) != (
                contributor, role, signed.token_sha256):
            raise AuthFailure(HTTPStatus.CONFLICT, "peer_taken",
                              f"this peer key already holds a {slot.role} slot under another token, identity or "
                              "role; use a separate keypair per process")
        if slot is None:
            slot = self._new_slot(signed, contributor, role, now)
        slot.expires = now + self.lease_seconds
        self._store.put(slot)
        self._store.remember_grant(slot.peer, contributor, now, max(self.grants_kept, self.capacity))
        return {
            "run_id": self.run_id, "contributor": contributor, "peer": slot.peer, "role": role,
            "slot": slot.index, "capacity": self.capacity, "stage": slot.stage,
            "num_stages": self.num_stages, "expires": slot.expires,
            "peers_of_contributor": held_by(self._slots.values(), contributor), "checkpoint": self.checkpoint,
        }

    def _new_slot(self, signed: SignedRequest, contributor: str, role: str, now: float) -> Slot:
        held = held_by(self._slots.values(), contributor)
        if held >= self.max_slots_per_token:
            raise AuthFailure(HTTPStatus.FORBIDDEN, "contributor_full",
                              f"{contributor} already holds {held} slots in run {self.run_id}, the most one "
                              f"contributor may hold (max {self.max_slots_per_token} per token); every process "
                              "under a token counts toward it, and a slot that ended counts until the coordinator "
                              "has let its key go: stop one, or wait a minute or two after one left")
        if len(self._slots) >= self.capacity:
            raise AuthFailure(HTTPStatus.SERVICE_UNAVAILABLE, "swarm_full",
                              f"the swarm of run {self.run_id} is full: all {self.capacity} contributor "
                              "slots are taken; try again later")
        slot = Slot(peer=signed.peer, token_sha256=signed.token_sha256, contributor=contributor, role=role,
                    stage=least_occupied_stage(self._slots.values(), self.num_stages) if role == "worker" else -1,
                    index=free_index(self._slots.values(), self.capacity), expires=now, queued_at=now,
                    since=signed.time)
        self._slots[slot.peer] = slot
        log.info("granted slot %d to %s (%s, peer %s…), stage %d", slot.index, contributor, role,
                 slot.peer[:8], slot.stage)
        return slot

    def _own(self, signed: SignedRequest) -> Slot:
        """The requesting peer's slot, asked for under the token it was granted to."""
        slot = self._slots.get(signed.peer)
        if slot is None or slot.ended is not None:
            raise AuthFailure(HTTPStatus.NOT_FOUND, "no_slot", "this peer holds no slot (expired?): join again")
        if slot.token_sha256 != signed.token_sha256:
            raise _token_mismatch()
        if signed.time < slot.since:
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "stale_request",
                              "the request was signed before this peer's slot was granted; send a fresh one")
        return slot

    def _renew(self, slot: Slot, now: float) -> Slot:
        slot.expires = now + self.lease_seconds
        self._store.put(slot)
        return slot

    def _place(self, slot: Slot, now: float) -> dict[str, Any]:
        if admitted(slot, self.max_integrating):
            return self._queue_answer(0, True)
        ahead = waiting(self._slots.values(), self.max_integrating).index(slot)
        if ahead == 0 and integrating(self._slots.values()) < self.max_integrating:
            slot.integrating_since = now
            self._store.put(slot)
            return self._queue_answer(0, True)
        return self._queue_answer(ahead + 1, False)

    def _mark_synced(self, slot: Slot, now: float) -> dict[str, Any]:
        if not admitted(slot, self.max_integrating):
            position = waiting(self._slots.values(), self.max_integrating).index(slot) + 1
            raise AuthFailure(HTTPStatus.CONFLICT, "not_admitted",
                              f"this peer is still waiting in the join queue (position {position}); it may report "
                              "its sync only once the queue has admitted it")
        slot.synced, slot.integrating_since = True, None
        self._renew(slot, now)
        return {"ok": True}

    def _check_join(self, slot: Slot, joiner: bytes, join: JoinRun, now: float) -> dict[str, Any]:
        """A join this slot may have countersigned (``countersign.check_join``); the slot notes its deadline, as it
        may not be freed before it."""
        check_join(slot, joiner, join, self.run_id, now, COUNTERSIGN_SECONDS)
        slot.countersigned_until = max(slot.countersigned_until, float(join.valid_until))
        self._store.put(slot)
        log.info("countersigned the join of slot %d (%s, peer %s…)", slot.index, slot.role, slot.peer[:8])
        return {}

    def _release(self, signed: SignedRequest, now: float) -> dict[str, Any]:
        """The peer leaves its slot (``_apply`` checked that it holds one): it ends (``_end``)."""
        self._end(self._own(signed), now, "left")
        return {"ok": True}

    # --- reading the slots ---

    def _queue_answer(self, position: int, admitted: bool) -> dict[str, Any]:
        return {"position": position, "admitted": admitted, "integrating": integrating(self._slots.values()),
                "max_integrating": self.max_integrating}
