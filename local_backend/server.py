"""The centralised backend: an asyncio TCP server that owns one coordinator.

It runs the Python specification directly, ticks it every ``TICK_INTERVAL`` seconds from its own clock,
authenticates every connection by challenge and response, applies the signed instructions clients send,
persists every change before announcing it, and sends each subscriber the byte ranges that changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from solders.keypair import Keypair

from client.identity import verify
from coordinator_program import rules
from coordinator_program.config import RunSpec
from coordinator_program.errors import CoordinatorError, MalformedInstruction, NothingToTick
from coordinator_program.instructions import (
    CloseRun,
    SetPaused,
    Tick,
    Update,
    Withdraw,
    apply,
    decode_instruction,
)
from coordinator_program.state import CoordinatorState, Health, Phase, decode_state, encode_state
from local_backend import protocol as p
from local_backend.store import RunStore

log = logging.getLogger("psyswarm.server")

TICK_INTERVAL = 0.5
HELLO_TIMEOUT = 10.0
MAX_BUFFERED = 4 << 20
"""A subscriber that lets this much unsent data pile up is too slow to follow the run and is dropped."""


@dataclass(eq=False)
class Connection:
    writer: asyncio.StreamWriter
    challenge: bytes
    identity: bytes = b""
    last_sequence: int = 0
    peer: str = ""

    def send(self, message: p.Message) -> None:
        self.writer.write(p.frame(message.encode()))


class CoordinatorServer:
    """Owns one run's coordinator: applies requests, ticks, persists and broadcasts."""

    def __init__(self, spec: RunSpec, store: RunStore, authority: Keypair,
                 clock: Callable[[], float] = time.time) -> None:
        self.spec, self.store, self.authority, self.clock = spec, store, authority, clock
        self.connections: set[Connection] = set()
        self.state = self._load_or_create()
        self.account = encode_state(self.state)  # what subscribers hold
        self._committed = self.account  # what the store holds: encoded once per change, sent from here
        self._server: asyncio.base_events.Server | None = None
        self._ticker: asyncio.Task[None] | None = None

    # --- the coordinator ------------------------------------------------------------------------------

    def _now(self) -> int:
        return int(self.clock())

    def _load_or_create(self) -> CoordinatorState:
        stored = self.store.load(self.spec.run_id)
        if stored is not None:
            state = decode_state(stored)
            log.info("resumed run %r from %s: %s, epoch %d, step %d", state.run_id, self.store.path,
                     state.phase.name, state.epoch, state.step)
            return state
        me = bytes(self.authority.pubkey())
        state = rules.init_coordinator(self.spec.run_id, me, bytes(32))
        self._persist(state, me, Update(self.spec.config, self.spec.model, self.spec.checkpoint).encode(),
                      lambda: rules.update(state, me, self.spec.config, self.spec.model, self.spec.checkpoint))
        self._persist(state, me, SetPaused(False).encode(), lambda: rules.set_paused(state, me, False))
        self._persist(state, me, Tick().encode(), lambda: rules.tick(state, self._now(), secrets.randbits(64)))
        log.info("created run %r in %s", state.run_id, self.store.path)
        return state

    def _persist(self, state: CoordinatorState, signer: bytes, instruction: bytes, change: Callable[[], None]) -> None:
        change()
        self._commit(state, signer, instruction)

    def _commit(self, state: CoordinatorState, signer: bytes, instruction: bytes) -> None:
        """Store an accepted change with the state it produced, encoding that state once."""
        self._committed = encode_state(state)
        self.store.save(state.run_id, state.nonce, self._committed, signer, instruction)

    def submit(self, signer: bytes, instruction: bytes, authorizer: bytes | None = None) -> None:
        """Apply one instruction from an authenticated signer, then tick; persist and broadcast the result.

        Raises ``CoordinatorError`` (the state untouched) when the coordinator rejects it.
        """
        ix = decode_instruction(instruction)
        if isinstance(ix, CloseRun):
            raise MalformedInstruction("close_run returns an on-chain run's rent, and a run on this server has no "
                                       "rent to return: stop the server to end the run")
        phase = self.state.phase
        apply(self.state, ix, signer, self._now(), secrets.randbits(64), authorizer)
        self._commit(self.state, signer, instruction)
        log.info("%s from %s accepted", ix.NAME, signer.hex()[:8])
        self._try_tick()
        self._announce(phase)

    def _try_tick(self) -> bool:
        """Tick once, with random entropy for any seed it draws; True when the state changed."""
        withdrew = self._withdraw_disconnected_joiners()
        try:
            rules.tick(self.state, self._now(), secrets.randbits(64))
        except NothingToTick:
            return withdrew
        except CoordinatorError as exc:  # finished or uninitialised: nothing will ever be due
            log.debug("tick: %s", exc)
            return withdrew
        self._commit(self.state, bytes(self.authority.pubkey()), Tick().encode())
        return True

    def _withdraw_disconnected_joiners(self) -> bool:
        """While the run waits for members, withdraw every queued joiner with no live connection, before a
        tick can admit it; True when it withdrew any.

        ``_on_disconnect`` withdraws a joiner whose connection closes, but a client whose connection closes
        mid-round stays in the epoch (its witnesses judge it), and the epoch's end queues every client still
        Healthy again, connected or not (as does a restart, which finds the queue with no one connected).
        Only WaitingForMembers admits, so sweeping right before each of its ticks admits no one absent.
        """
        if self.state.phase != Phase.WaitingForMembers:
            return False
        live = {conn.identity for conn in self.connections if conn.identity}
        absent = [joiner.id for joiner in self.state.pending if joiner.id not in live]
        for who in absent:
            rules.withdraw(self.state, who)
            self._commit(self.state, who, Withdraw().encode())
            log.info("%s is queued but not connected and was withdrawn", who.hex()[:8])
        return bool(absent)

    def tick_once(self) -> None:
        phase = self.state.phase
        if self._try_tick():
            self._announce(phase)

    def _announce(self, previous_phase: Phase) -> None:
        s = self.state
        if s.phase != previous_phase:
            log.info("phase %s -> %s (epoch %d, round %d, step %d, %d clients, %d pending)",
                     previous_phase.name, s.phase.name, s.epoch, s.round.height, s.step, len(s.clients),
                     len(s.pending))
        self._broadcast()

    def _broadcast(self) -> None:
        new = self._committed
        if new == self.account:
            return
        old_nonce = int.from_bytes(self.account[8:16], "little")
        message = p.StatePatch(old_nonce, self.state.nonce, p.diff(self.account, new))
        self.account = new
        data = p.frame(message.encode())
        for conn in list(self.connections):
            if not conn.identity:
                continue
            transport = conn.writer.transport
            if transport.is_closing() or transport.get_write_buffer_size() > MAX_BUFFERED:
                self._drop(conn, "too slow to follow the run's state")
                continue
            conn.writer.write(data)

    # --- connections ----------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 7070) -> int:
        """Listen and start ticking; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, host, port, limit=p.MAX_FRAME + 8)
        self._ticker = asyncio.create_task(self._tick_loop())
        bound = self._server.sockets[0].getsockname()[1]
        log.info("serving run %r on %s:%d", self.state.run_id, host, bound)
        return bound

    async def stop(self) -> None:
        if self._ticker:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._server:
            self._server.close()
            for conn in list(self.connections):
                conn.writer.close()
            await self._server.wait_closed()
        self.store.close()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL)
            try:
                self.tick_once()
            except Exception:  # a bug must not stop the run's clock; it is logged with its trace
                log.exception("tick failed")

    def _drop(self, conn: Connection, why: str) -> None:
        with contextlib.suppress(Exception):
            conn.send(p.Fatal(why))
        conn.writer.close()
        self.connections.discard(conn)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        conn = Connection(writer, secrets.token_bytes(32), peer=f"{peer[0]}:{peer[1]}" if peer else "?")
        self.connections.add(conn)
        try:
            conn.send(p.Challenge(conn.challenge, self.state.run_id))
            await self._authenticate(conn, reader)
            conn.send(p.Welcome())
            conn.send(p.FullState.of(self.state.nonce, self.account))
            while True:
                payload = await p.read_frame(reader)
                self._on_message(conn, payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except p.ProtocolError as exc:
            log.info("dropping %s: %s", conn.peer, exc)
            self._drop(conn, str(exc))
        except TimeoutError:
            self._drop(conn, f"no Hello within {HELLO_TIMEOUT:.0f} s")
        finally:
            self.connections.discard(conn)
            writer.close()
            self._on_disconnect(conn)

    async def _authenticate(self, conn: Connection, reader: asyncio.StreamReader) -> None:
        payload = await asyncio.wait_for(p.read_frame(reader), HELLO_TIMEOUT)
        hello = p.decode(payload)
        if not isinstance(hello, p.Hello):
            raise p.ProtocolError("authenticate first: the first message must be Hello")
        if not verify(hello.pubkey, p.auth_message(conn.challenge), hello.signature):
            raise p.ProtocolError("authentication failed: the signature does not match the key")
        conn.identity = hello.pubkey
        log.info("%s authenticated as %s", conn.peer, hello.pubkey.hex()[:8])

    def _on_message(self, conn: Connection, payload: bytes) -> None:
        try:
            message = p.decode(payload)
        except p.ProtocolError as exc:
            conn.send(p.Reply(0, p.REPLY_MALFORMED, f"malformed message: {exc}"))
            return
        if not isinstance(message, p.Request):
            raise p.ProtocolError(f"unexpected {type(message).__name__} from a client")
        conn.send(self._on_request(conn, message))

    def _on_request(self, conn: Connection, req: p.Request) -> p.Reply:
        signed = p.request_message(conn.challenge, req.sequence, req.instruction)
        if req.sequence <= conn.last_sequence:
            return p.Reply(req.sequence, p.REPLY_REPLAY, f"replayed request: sequence {req.sequence} is not "
                           f"above {conn.last_sequence}")
        if not verify(conn.identity, signed, req.signature):
            return p.Reply(req.sequence, p.REPLY_BAD_SIGNATURE, "the request's signature does not match your key")
        authorizer = None
        if req.authorizer:
            if not verify(req.authorizer, signed, req.authorizer_signature):
                return p.Reply(req.sequence, p.REPLY_BAD_SIGNATURE, "the co-signature does not match its key")
            authorizer = req.authorizer
        conn.last_sequence = req.sequence
        try:
            self.submit(conn.identity, req.instruction, authorizer)
        except CoordinatorError as exc:
            # A tick with nothing due is routine (every client may tick); other rejections are worth a line.
            level = logging.DEBUG if isinstance(exc, NothingToTick) else logging.INFO
            log.log(level, "request from %s rejected: %s", conn.identity.hex()[:8], exc)
            return p.Reply(req.sequence, exc.code, f"{type(exc).__name__}: {exc.detail}")
        return p.Reply(req.sequence, p.REPLY_OK, "applied")

    def _on_disconnect(self, conn: Connection) -> None:
        """A joiner whose last connection closes leaves the queue, and drops out of a warmup, as the seed's
        centralised backend does; during rounds a silent client is left to the health checks."""
        who = conn.identity
        if not who or any(c.identity == who for c in self.connections):
            return
        s = self.state
        index = s.client_index(who)
        leaving = s.pending_index(who) is not None or (
            index is not None and s.phase == Phase.Warmup and s.clients[index].health == Health.Healthy)
        if leaving:
            with contextlib.suppress(CoordinatorError):
                self.submit(who, Withdraw().encode())
                log.info("%s disconnected and was withdrawn", who.hex()[:8])
