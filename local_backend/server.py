"""The centralised backend: an asyncio TCP server that owns one coordinator.

It runs the Python specification directly, ticks it every ``TICK_INTERVAL`` seconds from its own clock,
authenticates every connection by challenge and response, applies the signed instructions clients send,
persists every change before announcing it, and sends each subscriber the byte ranges that changed.

A change is applied to a copy of the state, stored from a worker thread, and only then adopted and
acknowledged, one change at a time: a write that fails leaves memory and disk as they were, and a slow or
locked database never stalls the connections. What each peer may hold is bounded in ``peers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import secrets
import socket
import time
from collections.abc import Awaitable, Callable

from solders.keypair import Keypair

from coordinator_program.spec import rules
from coordinator_program.spec.config import RunSpec
from coordinator_program.spec.errors import CoordinatorError, MalformedInstruction, NothingToTick
from coordinator_program.spec.instructions import (
    CloseRun,
    Tick,
    Withdraw,
    apply,
    decode_instruction,
)
from coordinator_program.spec.state import CoordinatorState, Health, Phase, encode_state
from local_backend import protocol as p
from local_backend.logs import LogThrottle
from local_backend.peers import Limits, Peer, PeerClosed, Peers, listen
from local_backend.sessions import hello_key, verify_request
from local_backend.startup import APPLICABLE_PHASES, apply_config, differences, open_run, update_instruction
from local_backend.store import RunStore, StoreError

log = logging.getLogger("psyswarm.server")

TICK_INTERVAL = 0.5


def copy_of(state: CoordinatorState) -> CoordinatorState:
    """A deep copy of the state, taken for every change: a pickle round trip of the server's own plain data
    (never bytes from a peer) is three times faster than ``copy.deepcopy``."""
    return pickle.loads(pickle.dumps(state, pickle.HIGHEST_PROTOCOL))


class CoordinatorServer:
    """Owns one run's coordinator: applies requests, ticks, persists and broadcasts."""

    def __init__(self, spec: RunSpec, store: RunStore, authority: Keypair,
                 clock: Callable[[], float] = time.time, *, join_authority: bytes,
                 limits: Limits = Limits()) -> None:
        """``join_authority`` is the key that must countersign every join (the auth service's), or
        ``rules.NO_AUTHORITY`` for a permissionless run: there is no default, the creator chooses."""
        self.spec, self.store, self.authority, self.clock = spec, store, authority, clock
        self.throttle = LogThrottle(log)
        self.peers = Peers(limits, self.throttle)
        self.state, self._next_config = open_run(spec, store, authority, join_authority, self._now)
        self.account = encode_state(self.state)  # what the store and every follower hold
        self._full_state = (b"", b"")  # (account, its FullState frame)
        self._spare: tuple[CoordinatorState, CoordinatorState] | None = None  # (the state, a copy of it)
        self._lock = asyncio.Lock()  # one change at a time
        self._changing: set[asyncio.Task[None]] = set()
        self._serving: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None

    # --- the coordinator ------------------------------------------------------------------------------

    def _now(self) -> int:
        return int(self.clock())

    async def _apply_next_config(self) -> None:
        """Give the run the state.toml's rules once it waits for members; a config the run cannot take then (more
        joiners queued than its ``max_clients``) is dropped with a warning, and the run keeps its rules."""
        config = self._next_config
        if config is None or self.state.phase not in APPLICABLE_PHASES:
            return
        changes = differences("config", self.state.config, config)
        try:
            await self._change(bytes(self.authority.pubkey()), update_instruction(self.state, config),
                               lambda state: apply_config(state, config))
        except CoordinatorError as exc:
            self._next_config = None
            log.warning("the state.toml's rules were not applied, and the run keeps its own: %s", exc)
            return
        self._next_config = None  # a write that failed (StoreError) leaves it for the next tick
        log.info("the state.toml's rules now apply: %s", "; ".join(changes))

    async def submit(self, signer: bytes, instruction: bytes, authorizer: bytes | None = None) -> None:
        """Apply one instruction from an authenticated signer, then tick; store each change, then broadcast.

        Raises ``CoordinatorError`` when the coordinator rejects it and ``StoreError`` when its result cannot
        be stored; either way the state, in memory and on disk, is as it was.
        """
        ix = decode_instruction(instruction)
        if isinstance(ix, CloseRun):
            raise MalformedInstruction("close_run returns an on-chain run's rent, and a run on this server has no "
                                       "rent to return: stop the server to end the run")

        async def apply_then_tick() -> None:
            await self._change(signer, instruction,
                               lambda state: apply(state, ix, signer, self._now(), secrets.randbits(64), authorizer))
            self.throttle(logging.INFO, "accepted-request", "%s from %s accepted", ix.NAME, signer.hex()[:8])
            await self._try_tick()

        await self._serialised(apply_then_tick)

    async def tick_once(self) -> None:
        await self._serialised(self._try_tick)

    async def _serialised(self, change: Callable[[], Awaitable[None]]) -> None:
        """Run ``change`` alone, then log the phase it moved the run to (each change it stores is broadcast as it
        is adopted, ``_change``).

        Changes are applied, stored and adopted one at a time, each to the state the last one left; and one
        whose asker goes away (a closed connection, a stopping server) still runs to its end, so memory never
        falls behind what the store holds.
        """
        async def alone() -> None:
            async with self._lock:
                phase = self.state.phase
                try:
                    await change()
                finally:
                    self._log_phase(phase)

        task = asyncio.ensure_future(alone())
        self._changing.add(task)
        task.add_done_callback(self._settled)
        await asyncio.shield(task)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._changing.discard(task)
        if not task.cancelled():
            task.exception()  # marked as seen: an asker that went away cannot see it, one still there re-raises it

    async def _change(self, signer: bytes, instruction: bytes, change: Callable[[CoordinatorState], None]) -> None:
        """Apply ``change`` to a copy of the state, store the copy from a worker thread, then adopt and broadcast
        it.

        A change the coordinator rejects (``CoordinatorError``) or the store cannot keep (``StoreError``)
        leaves memory and disk as they were, and the event loop serves everyone else while the disk is slow or
        locked. The copy is a spare taken after the last change was sent or refused (``_take_spare``), so that
        copying the 120 KB state does not delay a change's patch. Only under ``self._lock``.
        """
        stored = self.account
        spare, self._spare = self._spare, None
        candidate = spare[1] if spare is not None and spare[0] is self.state else copy_of(self.state)
        try:
            change(candidate)
            account = encode_state(candidate)
            patch = p.StatePatch(p.account_nonce(stored), p.account_nonce(account), p.diff(stored, account)).encode()
            await asyncio.to_thread(self.store.save, candidate.run_id, candidate.nonce, account, signer,
                                    instruction, (stored, patch))
            self.state = candidate
            self._broadcast(account, patch)  # now, not after the tick that follows a request: it waits, the change not
        finally:
            asyncio.get_running_loop().call_soon(self._take_spare)

    def _take_spare(self) -> None:
        """Copy the state for the next change, once this one's patch has gone out (a spare is kept with the state
        it copies, and used only while that is still the state)."""
        if self._spare is None or self._spare[0] is not self.state:
            self._spare = (self.state, copy_of(self.state))

    async def _try_tick(self) -> None:
        """Tick once, with random entropy for any seed it draws. A change the store cannot keep is not applied,
        and the next tick tries again."""
        try:
            try:
                # Asked before anything else: most requests leave nothing due, and the sweep scans every joiner and
                # connection. A round's end credits 128 clients a tick: finish it now rather than a tick interval
                # apart.
                if rules.tick_due(self.state, self._now()):
                    await self._withdraw_disconnected_joiners()
                while rules.tick_due(self.state, now := self._now()):
                    await self._change(bytes(self.authority.pubkey()), Tick().encode(),
                                       lambda state, now=now: rules.tick(state, now, secrets.randbits(64)))
                    if not rules.closing(self.state):
                        break
            finally:
                await self._apply_next_config()
        except NothingToTick:
            pass
        except CoordinatorError as exc:  # finished or uninitialised: nothing will ever be due
            log.debug("tick: %s", exc)
        except StoreError as exc:
            self.throttle(logging.WARNING, "unstored-tick", "the run did not move on: %s", exc)

    async def _withdraw_disconnected_joiners(self) -> None:
        """While the run waits for members, withdraw every queued joiner with no live connection, before a
        tick can admit it.

        ``_on_disconnect`` withdraws a joiner whose connection closes, but a client whose connection closes
        mid-round stays in the epoch (its witnesses judge it), and the epoch's end queues every client still
        Healthy again, connected or not (as does a restart, which finds the queue with no one connected).
        Only WaitingForMembers admits, so sweeping right before each of its ticks admits no one absent; a
        withdrawal that cannot be stored stops the tick.
        """
        if self.state.phase != Phase.WaitingForMembers:
            return
        live = self.peers.identities()
        absent = [joiner.id for joiner in self.state.pending if joiner.id not in live]
        for who in absent:
            await self._change(who, Withdraw().encode(), lambda state, who=who: rules.withdraw(state, who))
            log.info("%s is queued but not connected and was withdrawn", who.hex()[:8])

    def _log_phase(self, previous_phase: Phase) -> None:
        s = self.state
        if s.phase != previous_phase:
            # Counted as `psyswarm status` counts: rounds from 1, and a finished run in the last epoch it trained.
            epoch = s.epoch - 1 if s.phase == Phase.Finished else s.epoch
            in_round = s.phase in (Phase.RoundTrain, Phase.RoundWitness, Phase.Cooldown)
            round_ = f"round {s.round.height + 1}/{s.config.rounds_per_epoch}, " if in_round else ""
            log.info("phase %s -> %s (epoch %d, %sstep %d/%d, %d clients, %d pending)", previous_phase.name,
                     s.phase.name, epoch, round_, s.step, s.config.total_steps, len(s.clients), len(s.pending))

    def _broadcast(self, new: bytes, patch: bytes) -> None:
        """Send every follower ``patch``, the encoded ``StatePatch`` from the account they hold to ``new``: framed
        once, the very same bytes object written to each (``Peers.broadcast``). A follower whose connection has
        fallen behind gets no patch until it drains, then the whole state."""
        self.account = new
        self.peers.broadcast(p.frame(patch), self._full_state_frame)

    def _full_state_frame(self) -> bytes:
        """What subscribers hold, whole: compressed once per change rather than once per login."""
        if self._full_state[0] is not self.account:
            whole = p.FullState.of(p.account_nonce(self.account), self.account)
            self._full_state = (self.account, p.frame(whole.encode()))
        return self._full_state[1]

    def _members(self) -> set[bytes]:
        """The keys in the run, admitted or queued: their connections never give way to a newcomer's."""
        return {client.id for client in self.state.clients} | {joiner.id for joiner in self.state.pending}

    # --- connections ----------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 7070, listener: socket.socket | None = None) -> int:
        """Listen (on ``listener`` if given: ``serve`` binds before it creates anything) and start ticking; returns
        the bound port (useful with port 0)."""
        self.peers.limits = self.peers.limits.fitted_to_open_files()
        listener = listener or listen(host, port)
        bound = listener.getsockname()[1]
        self._serving = asyncio.create_task(self.peers.serve(listener, self._session))
        self._ticker = asyncio.create_task(self._tick_loop())
        log.info("serving run %r on %s:%d", self.state.run_id, host, bound)
        return bound

    async def stop(self) -> None:
        """Stop ticking and serving, let a change being stored finish, then close the store."""
        for task in (self._ticker, self._serving):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.gather(*self._changing, return_exceptions=True)
        await asyncio.to_thread(self.store.close)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            try:
                await self.tick_once()
            except Exception:  # a bug must not stop the run's clock; it is logged with its trace
                self.throttle(logging.ERROR, "failed-tick", "tick failed", exc_info=True)

    async def _session(self, peer: Peer) -> None:
        """One connection: its login, then its messages in order until it closes; then what its leaving means
        for the run (not when the server stops)."""
        try:
            if not await self._log_in(peer):
                return
            peer.send(p.Welcome())
            peer.send_frame(self._full_state_frame())
            while True:
                await self._on_message(peer, await peer.next_frame())
        except PeerClosed:
            pass
        except p.ProtocolError as exc:
            peer.close(str(exc))
        await self._on_disconnect(peer)

    async def _log_in(self, peer: Peer) -> bool:
        """Challenge ``peer`` and admit the key that answers in time; False (``peer`` told why) otherwise."""
        peer.send(p.Challenge(peer.challenge, self.state.run_id))
        try:
            hello = await asyncio.wait_for(peer.next_frame(), self.peers.limits.login_timeout)
        except TimeoutError:
            peer.close(f"no Hello within {self.peers.limits.login_timeout:g} s")
            return False
        key = hello_key(peer.challenge, hello)
        self.throttle(logging.INFO, "login", "%s authenticated as %s", peer.address, key.hex()[:8])
        return self.peers.admit(peer, key, self._members())

    async def _on_message(self, peer: Peer, payload: bytes) -> None:
        try:
            message = p.decode(payload)
        except p.ProtocolError as exc:
            peer.send(p.Reply(0, p.REPLY_MALFORMED, f"malformed message: {exc}"))
            return
        if isinstance(message, p.Pong):
            return  # it arrived: that was the point
        if not isinstance(message, p.Request):
            raise p.ProtocolError(f"unexpected {type(message).__name__} from a client")
        peer.send(await self._on_request(peer, message))

    async def _on_request(self, conn: Peer, req: p.Request) -> p.Reply:
        verified = verify_request(conn.challenge, conn.identity, conn.last_sequence, req)
        if isinstance(verified, p.Reply):
            return verified
        conn.last_sequence = req.sequence
        try:
            await self.submit(conn.identity, verified.instruction, verified.authorizer)
        except CoordinatorError as exc:
            # A tick with nothing due is routine (every client may tick); other rejections are worth a line.
            level = logging.DEBUG if isinstance(exc, NothingToTick) else logging.INFO
            self.throttle(level, "rejected-request", "request from %s rejected: %s", conn.identity.hex()[:8], exc)
            return p.Reply(req.sequence, exc.code, f"{type(exc).__name__}: {exc.detail}")
        except StoreError as exc:
            self.throttle(logging.WARNING, "unstored-request", "request from %s not applied: %s",
                          conn.identity.hex()[:8], exc)
            return p.Reply(req.sequence, p.REPLY_NOT_STORED, f"not applied, for the server could not store it ({exc}): "
                           "send it again")
        return p.Reply(req.sequence, p.REPLY_OK, "applied")

    async def _on_disconnect(self, peer: Peer) -> None:
        """A joiner whose last connection closes leaves the queue, and drops out of a warmup, as the seed's
        centralised backend does; during rounds a silent client is left to the health checks."""
        who = peer.identity
        if not who or self.peers.holds(who):
            return
        s = self.state
        index = s.client_index(who)
        leaving = s.pending_index(who) is not None or (
            index is not None and s.phase == Phase.Warmup and s.clients[index].health == Health.Healthy)
        if not leaving:
            return
        try:
            await self.submit(who, Withdraw().encode())
        except CoordinatorError:
            return
        except StoreError as exc:
            self.throttle(logging.WARNING, "unstored-withdrawal", "%s disconnected and stays: %s", who.hex()[:8], exc)
            return
        log.info("%s disconnected and was withdrawn", who.hex()[:8])
