"""What the TCP server lets its peers hold, and how it holds them to it.

Anyone with a fresh keypair can log in, so no peer is trusted with the server's memory, file descriptors or
log:

- Connections: at most ``max_connections`` logged in, a quarter as many more logging in, all within the
  process's open-file limit, and at most ``max_per_identity`` per key. When a pool is full, a newcomer takes
  the place of the oldest connection that may give way: a login in progress, or a logged-in connection of a
  key that is not in the run. A flood can then neither lock a newcomer out nor push a run's member out.
- Time: a login must finish within ``login_timeout``; a logged-in connection from which no whole frame has
  come for ``idle_timeout`` is closed. The server pings a connection quiet for half that and a client that
  only follows the state answers, so following is never idle.
- Bytes: a frame's header is checked as soon as it arrives (``protocol.MAX_REQUEST_FRAME``); reading from a
  connection pauses once it has sent a frame's worth the server has not processed, and a connection holding
  over ``MAX_HELD`` such bytes is closed; past ``max_buffered`` bytes held in all, the connections holding
  the most are closed. A follower whose connection holds ``FALLEN_BEHIND`` bytes of the server's messages it has
  not read gets no more patches; once it has read them it gets the whole state, then patches again, so a slow
  follower costs the server one state's worth of memory at most and still ends up holding the current state. A
  connection that lets ``MAX_UNSENT`` bytes pile up even so (replies it does not read) is cut off.
- Log: each kind of event writes a few lines per period and counts the rest into one line. When accept
  fails (out of file descriptors), the server waits before trying again, longer each time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Iterator

from local_backend import protocol as p
from local_backend.logs import LogThrottle
from local_backend.open_files import open_file_limit

log = logging.getLogger("psyswarm.server")

PAUSE_AT = p.MAX_REQUEST_FRAME + 4
"""Unprocessed bytes at which the server stops reading a connection: then its next frame is whole."""
MAX_HELD = 16 * PAUSE_AT
"""Unprocessed bytes one connection may hold: a read can deliver more than ``PAUSE_AT`` at once, but only a
client that sends many frames without waiting for replies gets this far."""
FALLEN_BEHIND = 64 << 10
"""Bytes of the server's messages waiting for a connection at which it gets no more state patches, and below which
(a quarter of it) it gets the whole state and follows by patches again."""
MAX_UNSENT = 256 << 10
"""Bytes of the server's messages that may wait for a slow connection: a whole state and many replies."""
TOO_SLOW = "too slow to follow the run's state"
"""Why a connection that let ``MAX_UNSENT`` bytes pile up was cut off."""
RESERVED_FILES = 32
"""Descriptors kept out of the connection caps: the listener, the database and its journal, the event loop,
the standard streams, a module imported late, and the connection accepted before another gives way."""
FIRST_BACKOFF, LAST_BACKOFF = 0.05, 2.0
"""Seconds to wait after accept fails, doubling from the first to the last while it keeps failing."""
SWEEP_EVERY = 1.0
"""Seconds between looks for idle connections, at most."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server's peers may hold; ``psyswarm serve`` exposes each."""

    max_connections: int = 2048
    """Every client of a full run (1,024) and as many followers again (dashboards, spare connections)."""
    max_per_identity: int = 4
    login_timeout: float = 10.0
    idle_timeout: float = 60.0
    max_buffered: int = 4 << 20

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"{field.name} must be positive, not {getattr(self, field.name)}")

    @property
    def login_slots(self) -> int:
        """Connections that may be logging in at once."""
        return self.max_connections // 4 + 4

    def fitted_to_open_files(self) -> Limits:
        """These limits, with the connection cap lowered to what the process may open once its soft open-file
        limit is raised as far as the hard one allows: past the limit accept fails, and the server serves no
        one."""
        need = self.max_connections + self.login_slots + RESERVED_FILES
        soft = open_file_limit(need)
        if soft >= need:
            return self
        cap = (soft - RESERVED_FILES - 4) * 4 // 5  # so that cap + cap // 4 + 4 fits
        if cap < 1:
            raise ValueError(f"the open-file limit ({soft}) leaves no room for connections: raise it (ulimit -n)")
        log.warning("the open-file limit (%d) allows %d connections, not %d: raise it (ulimit -n) for more",
                    soft, cap, self.max_connections)
        return dataclasses.replace(self, max_connections=cap)


class PeerClosed(Exception):
    """The connection is closed and every whole frame it sent has been taken."""


class Peer(asyncio.Protocol):
    """One client connection: it splits the client's bytes into frames, checks each frame's length as soon as
    its header arrives, and holds no more of the client's bytes than the limits allow."""

    def __init__(self, pool: Peers) -> None:
        self.pool = pool
        self.challenge = secrets.token_bytes(32)
        self.identity = b""
        self.last_sequence = 0
        self.address = "?"
        self.last_heard = time.monotonic()
        self.pinged = False
        self.held = 0
        """Bytes the client sent that the server has not processed, as counted in the pool's total."""
        self.closed = False
        self.behind = False
        """The connection holds ``FALLEN_BEHIND`` bytes the client has not read: it is sent no patches."""
        self.resync: Callable[[], bytes] | None = None
        """What to send once the client has read its backlog: the whole state, as it is by then (a patch was
        skipped)."""
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._whole = 0  # bytes at the front of the buffer that are whole frames
        self._arrived = asyncio.Event()
        self._paused = False

    def __repr__(self) -> str:
        return f"{self.address} ({self.identity.hex()[:8] or 'not logged in'})"

    # --- asyncio.Protocol -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.set_write_buffer_limits(high=FALLEN_BEHIND)
        address = transport.get_extra_info("peername")
        self.address = f"{address[0]}:{address[1]}" if address else "?"

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self._buffer += data
        self._count_held()
        if self.held > MAX_HELD:
            self.close(f"sent over {MAX_HELD} bytes the server had not processed yet: wait for replies")
            return
        try:
            self._find_whole_frames()
        except p.ProtocolError as exc:
            self.close(str(exc))
            return
        if self.held >= PAUSE_AT and not self._paused:
            self._paused = True
            self._transport.pause_reading()
        self._arrived.set()
        self.pool.check_buffered()

    def pause_writing(self) -> None:
        self.behind = True

    def resume_writing(self) -> None:
        """The client has read its backlog: if it missed a patch, it gets the state as it is now."""
        self.behind = False
        resync, self.resync = self.resync, None
        if resync is not None:
            self.send_frame(resync())

    def connection_lost(self, exc: Exception | None) -> None:
        """The client went away: its whole frames may still be taken; an unfinished one is dropped."""
        self.closed = True
        del self._buffer[self._whole:]
        self._count_held()
        self.pool.forget(self)
        self._arrived.set()

    # --- the server's side ------------------------------------------------------------------------------

    async def next_frame(self) -> bytes:
        """The next whole frame's payload; ``PeerClosed`` once the connection is closed and none is left."""
        while not self._whole:
            if self.closed:
                raise PeerClosed
            self._arrived.clear()
            await self._arrived.wait()
        length = int.from_bytes(self._buffer[:4], "big")
        payload = bytes(self._buffer[4:4 + length])
        del self._buffer[:4 + length]
        self._whole -= 4 + length
        self._count_held()
        if self._paused and self.held < PAUSE_AT and not self.closed:
            self._paused = False
            self._transport.resume_reading()
        return payload

    def send(self, message: p.Message) -> None:
        self.send_frame(p.frame(message.encode()))

    def send_frame(self, data: bytes) -> None:
        """Queue bytes for the client; one that lets ``MAX_UNSENT`` of them pile up is not reading, and is cut
        off rather than held."""
        if self.closed or self._transport.is_closing():
            return
        self._transport.write(data)
        if self._transport.get_write_buffer_size() > MAX_UNSENT:
            self.close(TOO_SLOW)

    def close(self, why: str) -> None:
        """Tell the client why, then close; what it sent that the server had not processed is dropped."""
        if self.closed:
            return
        self.pool.throttle(logging.INFO, "closed-connection", "closing %r: %s", self, why)
        if not self._transport.is_closing():
            self._transport.write(p.frame(p.Fatal(why).encode()))
        self.closed = True
        self._buffer.clear()
        self._whole = 0
        self._count_held()
        self.pool.forget(self)
        if self._transport.get_write_buffer_size():
            self._transport.abort()  # the client is not reading: do not hold its backlog until it does
        else:
            self._transport.close()
        self._arrived.set()

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _find_whole_frames(self) -> None:
        """Check each header that has arrived, and mark the frames that are whole (a whole frame counts as
        hearing from the client)."""
        while self._whole + 4 <= len(self._buffer):
            length = p.frame_length(bytes(self._buffer[self._whole:self._whole + 4]), p.MAX_REQUEST_FRAME)
            if self._whole + 4 + length > len(self._buffer):
                return
            self._whole += 4 + length
            self.last_heard, self.pinged = time.monotonic(), False

    def _count_held(self) -> None:
        self.pool.buffered += len(self._buffer) - self.held
        self.held = len(self._buffer)


class Peers:
    """Every connection the server holds, the rules of who gives way when a pool of them is full, and the
    tasks that accept connections and close idle ones."""

    def __init__(self, limits: Limits, throttle: LogThrottle) -> None:
        self.limits, self.throttle = limits, throttle
        self.buffered = 0
        """Bytes held that clients sent and the server has not processed, over every connection."""
        self._logging_in: dict[Peer, None] = {}  # oldest first
        self._logged_in: dict[Peer, None] = {}  # oldest first
        self._sessions: set[asyncio.Task[None]] = set()

    def __iter__(self) -> Iterator[Peer]:
        """The logged-in connections."""
        return iter(list(self._logged_in))

    def __len__(self) -> int:
        return len(self._logged_in)

    def identities(self) -> set[bytes]:
        return {peer.identity for peer in self._logged_in}

    def holds(self, identity: bytes) -> bool:
        return any(peer.identity == identity for peer in self._logged_in)

    def admit(self, peer: Peer, identity: bytes, members: Collection[bytes]) -> bool:
        """Log ``peer`` in as ``identity``, making room as the rules say; False (``peer`` told why and closed)
        when every logged-in connection belongs to a member of the run (``members``)."""
        self._logging_in.pop(peer, None)
        same_key = [other for other in self._logged_in if other.identity == identity]
        if len(same_key) >= self.limits.max_per_identity:
            same_key[0].close(f"a newer connection of this key took its place: a key may hold "
                              f"{self.limits.max_per_identity} connections")
        if len(self._logged_in) >= self.limits.max_connections:
            outsider = next((other for other in self._logged_in if other.identity not in members), None)
            if outsider is None:
                self.throttle(logging.WARNING, "refused-connection", "refused %r: all %d connections belong to "
                              "the run's members", peer, self.limits.max_connections)
                peer.close(f"the server is full: its {self.limits.max_connections} connections are the run's "
                           "members'")
                return False
            outsider.close(f"the server is full ({self.limits.max_connections} connections): the oldest "
                           "connection of a key outside the run gave its place to a newer one")
        peer.identity = identity
        self._logged_in[peer] = None
        return True

    def broadcast(self, data: bytes, resync: Callable[[], bytes]) -> None:
        """Queue ``data`` (one frame, encoded once) for every logged-in connection: the same bytes object written
        to each transport, in one loop with nothing per connection but the write and its checks, for at 1,024
        followers this loop is most of a change's cost. A connection that has fallen behind is skipped and will get
        ``resync()`` once it drains; one that lets ``MAX_UNSENT`` bytes pile up even so is cut off."""
        for peer in list(self._logged_in):  # a close removes a peer from the pool
            transport = peer._transport
            if peer.behind:
                peer.resync = resync
            elif not transport.is_closing():
                transport.write(data)
                if transport.get_write_buffer_size() > MAX_UNSENT:
                    peer.close(TOO_SLOW)

    def forget(self, peer: Peer) -> None:
        self._logging_in.pop(peer, None)
        self._logged_in.pop(peer, None)

    def check_buffered(self) -> None:
        """Past ``max_buffered`` unprocessed bytes in all, close the connections that hold the most."""
        if self.buffered <= self.limits.max_buffered:
            return
        holders = sorted([*self._logging_in, *self._logged_in], key=lambda peer: peer.held, reverse=True)
        for peer in holders:
            if self.buffered <= self.limits.max_buffered:
                return
            peer.close(f"the server holds over {self.limits.max_buffered} bytes its clients sent and it has not "
                       f"processed, and this connection held the most ({peer.held})")

    async def serve(self, listener: socket.socket, session: Callable[[Peer], Awaitable[None]]) -> None:
        """Accept connections on ``listener`` until cancelled, each served by ``session`` in its own task, and
        ping or close the quiet ones; on the way out close them all, and the listener."""
        sweeper = asyncio.create_task(self._sweep())
        try:
            await self._accept(listener, session)
        finally:
            sweeper.cancel()
            listener.close()
            for task in self._sessions:
                task.cancel()
            for peer in [*self._logging_in, *self._logged_in]:
                peer.close("the server is stopping")
            await asyncio.gather(sweeper, *self._sessions, return_exceptions=True)

    async def _accept(self, listener: socket.socket, session: Callable[[Peer], Awaitable[None]]) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.0
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors or memory: retrying at once would spin
                backoff = min(LAST_BACKOFF, max(FIRST_BACKOFF, 2 * backoff))
                self.throttle(logging.WARNING, "accept-failure", "cannot accept connections (%s): trying again "
                              "in %.2f s", exc.strerror or exc, backoff)
                await asyncio.sleep(backoff)
                continue
            backoff = 0.0
            task = asyncio.create_task(self._run(sock, session))
            self._sessions.add(task)
            task.add_done_callback(self._sessions.discard)

    async def _run(self, sock: socket.socket, session: Callable[[Peer], Awaitable[None]]) -> None:
        try:
            _, peer = await asyncio.get_running_loop().connect_accepted_socket(lambda: Peer(self), sock)
        except OSError:
            sock.close()
            return
        self._take_login_slot(peer)
        try:
            await session(peer)
        except Exception:  # a bug must not end the server, nor pass unseen
            self.throttle(logging.ERROR, "failed-session", "serving %r failed", peer, exc_info=True)
        finally:
            peer.close("the server failed to serve this connection")  # a session that ends closes it first

    def _take_login_slot(self, peer: Peer) -> None:
        if len(self._logging_in) >= self.limits.login_slots:
            oldest = next(iter(self._logging_in))
            oldest.close(f"too many logins in progress ({self.limits.login_slots}): the oldest gave its place to a "
                         "newer one")
        self._logging_in[peer] = None

    async def _sweep(self) -> None:
        """Ping each logged-in connection quiet for half the idle timeout, close one quiet for all of it."""
        idle = self.limits.idle_timeout
        while True:
            await asyncio.sleep(min(idle / 4, SWEEP_EVERY))
            now = time.monotonic()
            for peer in list(self._logged_in):
                quiet = now - peer.last_heard
                if quiet >= idle:
                    peer.close(f"nothing came from this connection for {idle:g} s: a client answers the server's "
                               "Ping to stay connected")
                elif quiet >= idle / 2 and not peer.pinged:
                    peer.pinged = True
                    peer.send(p.Ping())
            self.throttle.flush()


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (port 0: any free one)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.create_server(address, family=family, backlog=backlog)
    listener.setblocking(False)
    return listener
