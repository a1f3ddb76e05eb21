"""The coordinator reached through the local TCP backend (``psyswarm serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from solders.keypair import Keypair

from client.backends.base import Backend, BackendError
from coordinator_program.spec.errors import BY_CODE
from coordinator_program.spec.instructions import Instruction, JoinRun
from coordinator_program.spec.state import decode_state
from local_backend import protocol as p

log = logging.getLogger("psyswarm.tcp")

REQUEST_TIMEOUT = 30.0


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port), with a message that says what a good address looks like."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BackendError(f"--server must be HOST:PORT, like 127.0.0.1:7070, not {address!r}")
    return host, int(port)


class TcpBackend(Backend):
    """Authenticates with the client's keypair, follows the state, and sends signed instructions."""

    ticks_itself = True

    def __init__(self, address: str, keypair: Keypair, *, authorizer: Keypair | None = None) -> None:
        super().__init__()
        self.host, self.port = parse_address(address)
        self.keypair, self.authorizer = keypair, authorizer
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._challenge = b""
        self._sequence = 0
        self._replies: dict[int, asyncio.Future[p.Reply]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._account = b""
        self._fatal: str | None = None
        self.bytes_received = 0

    @property
    def identity(self) -> bytes:
        return bytes(self.keypair.pubkey())

    async def connect(self, timeout: float = 10.0) -> None:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=p.MAX_FRAME + 8), timeout)
        except (OSError, TimeoutError) as exc:
            raise BackendError(f"cannot reach the coordinator at {self.host}:{self.port} ({exc}); is "
                               "`psyswarm serve` running there?") from None
        challenge = await self._expect(p.Challenge, timeout)
        self._challenge = challenge.nonce
        signature = bytes(self.keypair.sign_message(p.auth_message(challenge.nonce)))
        self._send(p.Hello(self.identity, signature))
        await self._expect(p.Welcome, timeout)
        full = await self._expect(p.FullState, timeout)
        self._account = full.account()
        await self._publish(decode_state(self._account))
        self._listener = asyncio.create_task(self._listen())

    async def _expect(self, kind: type[p.Message], timeout: float) -> p.Message:
        assert self._reader is not None
        try:
            payload = await asyncio.wait_for(p.read_frame(self._reader), timeout)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            raise BackendError(f"the coordinator at {self.host}:{self.port} closed the handshake ({exc!r})") from None
        self.bytes_received += len(payload) + 4
        message = p.decode(payload)
        if isinstance(message, p.Fatal):
            raise BackendError(f"the coordinator refused the connection: {message.message}")
        if not isinstance(message, kind):
            raise BackendError(f"protocol error: expected {kind.__name__}, got {type(message).__name__}")
        return message

    def _send(self, message: p.Message) -> None:
        if self._writer is None or self._writer.is_closing():
            raise BackendError("not connected to the coordinator")
        self._writer.write(p.frame(message.encode()))

    async def _listen(self) -> None:
        assert self._reader is not None
        try:
            while True:
                payload = await p.read_frame(self._reader)
                self.bytes_received += len(payload) + 4
                await self._on_message(p.decode(payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            await self._mark_closed(self._fatal or "the coordinator closed the connection")
        except p.ProtocolError as exc:
            await self._mark_closed(f"protocol error from the coordinator: {exc}")
        finally:
            await self._mark_closed(self._fatal or "the connection to the coordinator was closed")
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(BackendError(self.closed_reason or "connection lost"))
            self._replies.clear()

    async def _on_message(self, message: p.Message) -> None:
        if isinstance(message, p.StatePatch):
            held = p.account_nonce(self._account)
            if message.base != held:  # the server sends a follower that fell behind the whole state instead
                raise p.ProtocolError(f"a patch from nonce {message.base}, but this client holds nonce {held}")
            self._account = message.apply(self._account)
            await self._publish(decode_state(self._account))
        elif isinstance(message, p.FullState):
            self._account = message.account()
            await self._publish(decode_state(self._account))
        elif isinstance(message, p.Reply):
            future = self._replies.pop(message.sequence, None)
            if future is not None and not future.done():
                future.set_result(message)
            elif message.code:
                log.warning("coordinator: %s", message.message)
        elif isinstance(message, p.Ping):  # the server closes a connection that stays quiet
            with contextlib.suppress(BackendError):  # closing already
                self._send(p.Pong())
        elif isinstance(message, p.Fatal):
            self._fatal = f"the coordinator closed the connection: {message.message}"
        else:
            raise p.ProtocolError(f"unexpected {type(message).__name__} from the server")

    @property
    def connected(self) -> bool:
        return self._listener is not None and not self._listener.done()

    async def submit(self, ix: Instruction) -> None:
        if not self.connected:
            raise BackendError(self.closed_reason or "not connected to the coordinator")
        self._sequence += 1
        data = ix.encode()
        signed = p.request_message(self._challenge, self._sequence, data)
        co_key, co_sig = b"", b""
        if self.authorizer is not None and isinstance(ix, JoinRun):  # the join authority admits this key only
            co_key = bytes(self.authorizer.pubkey())
            co_sig = bytes(self.authorizer.sign_message(p.join_authorization(self.identity, signed)))
        future: asyncio.Future[p.Reply] = asyncio.get_running_loop().create_future()
        self._replies[self._sequence] = future
        self._send(p.Request(self._sequence, data, bytes(self.keypair.sign_message(signed)), co_key, co_sig))
        reply = await asyncio.wait_for(future, REQUEST_TIMEOUT)
        if reply.code == p.REPLY_OK:
            return
        error = BY_CODE.get(reply.code)
        if error is not None:
            raise error(reply.message.partition(": ")[2] or reply.message)
        raise BackendError(reply.message)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()

