"""The TCP backend's wire protocol, shared by the server and the client adapter.

A frame is a 4-byte big-endian length and a payload of at most ``MAX_FRAME`` bytes. A payload is one
message: a type byte and a fixed binary body. The coordinator itself travels in the same bytes as the
Solana account (zlib-compressed when sent whole, as byte-range patches when it changes), and client
requests carry the same instruction bytes the Solana program takes, signed by the client's ed25519 key.

Session: the server sends ``Challenge``; the client answers ``Hello`` with its public key and a signature
over the challenge; the server answers ``Welcome`` and the full state, then a ``StatePatch`` whenever the
coordinator changes. Each ``Request`` carries a sequence number, strictly increasing per connection, and a
signature over (challenge, sequence, instruction), so a captured request cannot be replayed, in this
connection or another. The server sends ``Ping`` to a connection that has been quiet and closes one that
stays quiet; the client answers ``Pong``, so a client that only follows the state stays connected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import zlib
from typing import ClassVar

MAX_FRAME = 1 << 20
"""Largest payload a client accepts; the whole state compresses to a few KiB."""
MAX_REQUEST_FRAME = 4096
"""Largest payload the server accepts: a request carries one instruction, which fits a Solana transaction
(1,232 bytes), and its signatures. The server refuses a longer frame as soon as its header arrives, before
holding any of it."""
MAX_STATE_BYTES = 1 << 20
"""Largest decompressed state a client accepts (the account is about 49 KB)."""

AUTH_DOMAIN = b"psyswarm-auth-v1"
REQUEST_DOMAIN = b"psyswarm-request-v1"
JOIN_AUTHORIZATION_DOMAIN = b"psyswarm-join-authorization-v1"
CHALLENGE_BYTES = 32
"""A ``Challenge``'s nonce: its length is fixed, so a request's instruction starts at a fixed offset."""


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol; the message says what was wrong."""


def frame_length(header: bytes, limit: int) -> int:
    """The payload length a frame's 4-byte header announces, refused when over ``limit``."""
    (length,) = struct.unpack(">I", header)
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the {limit}-byte limit")
    return length


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """Read one frame; EOF between frames raises ``asyncio.IncompleteReadError``."""
    return await reader.readexactly(frame_length(await reader.readexactly(4), MAX_FRAME))


def frame(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"payload of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit")
    return struct.pack(">I", len(payload)) + payload


class _Cursor:
    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ProtocolError(f"{self.what}: truncated")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def u32(self) -> int:
        return struct.unpack(">I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(">Q", self.take(8))[0]

    def blob(self) -> bytes:
        return self.take(self.u32())

    def rest(self) -> bytes:
        return self.take(len(self.data) - self.pos)

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.what}: {len(self.data) - self.pos} unexpected trailing bytes")


def _blob(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


class Message:
    TYPE: ClassVar[int]

    def body(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def parse(cls, cur: _Cursor) -> Message:
        raise NotImplementedError

    def encode(self) -> bytes:
        return bytes([self.TYPE]) + self.body()


@dataclasses.dataclass(frozen=True)
class Challenge(Message):
    """Server → client, first: a fresh random value the client signs, and the run served."""

    nonce: bytes
    run_id: str
    TYPE = 0x01

    def body(self) -> bytes:
        return self.nonce + _blob(self.run_id.encode())

    @classmethod
    def parse(cls, cur: _Cursor) -> Challenge:
        nonce = cur.take(32)
        return cls(nonce, cur.blob().decode(errors="replace"))


@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """Client → server: its identity and a signature over the challenge."""

    pubkey: bytes
    signature: bytes
    TYPE = 0x81

    def body(self) -> bytes:
        return self.pubkey + self.signature

    @classmethod
    def parse(cls, cur: _Cursor) -> Hello:
        return cls(cur.take(32), cur.take(64))


def auth_message(challenge: bytes) -> bytes:
    return AUTH_DOMAIN + challenge


class _Bare(Message):
    """A message whose type says it all: no body."""

    def body(self) -> bytes:
        return b""

    @classmethod
    def parse(cls, cur: _Cursor) -> _Bare:
        return cls()


@dataclasses.dataclass(frozen=True)
class Welcome(_Bare):
    """Server → client: authentication succeeded."""

    TYPE = 0x02


@dataclasses.dataclass(frozen=True)
class FullState(Message):
    """Server → client: the whole account, zlib-compressed (it is mostly zeros)."""

    nonce: int
    compressed: bytes
    TYPE = 0x10

    @classmethod
    def of(cls, nonce: int, account: bytes) -> FullState:
        return cls(nonce, zlib.compress(account, 6))

    def account(self) -> bytes:
        inflater = zlib.decompressobj()
        try:
            data = inflater.decompress(self.compressed, MAX_STATE_BYTES)
        except zlib.error as exc:
            raise ProtocolError(f"state: not zlib data ({exc})") from None
        if inflater.unconsumed_tail:
            raise ProtocolError(f"state: more than {MAX_STATE_BYTES} bytes")
        return data

    def body(self) -> bytes:
        return struct.pack(">Q", self.nonce) + self.compressed

    @classmethod
    def parse(cls, cur: _Cursor) -> FullState:
        return cls(cur.u64(), cur.rest())


@dataclasses.dataclass(frozen=True)
class StatePatch(Message):
    """Server → client: the byte ranges that changed between two states (nonce ``base`` → ``nonce``)."""

    base: int
    nonce: int
    patches: tuple[tuple[int, bytes], ...]
    TYPE = 0x11

    def body(self) -> bytes:
        out = bytearray(struct.pack(">QQI", self.base, self.nonce, len(self.patches)))
        for offset, data in self.patches:
            out += struct.pack(">I", offset) + _blob(data)
        return bytes(out)

    @classmethod
    def parse(cls, cur: _Cursor) -> StatePatch:
        base, nonce, count = cur.u64(), cur.u64(), cur.u32()
        if count > MAX_FRAME // 8:
            raise ProtocolError("patch: too many ranges")
        return cls(base, nonce, tuple((cur.u32(), cur.blob()) for _ in range(count)))

    def apply(self, account: bytes) -> bytes:
        out = bytearray(account)
        for offset, data in self.patches:
            if offset + len(data) > len(out):
                raise ProtocolError("patch: range beyond the state")
            out[offset:offset + len(data)] = data
        return bytes(out)


def account_nonce(account: bytes) -> int:
    """The nonce an encoded coordinator account holds, after its 8-byte discriminator: what a patch starts from."""
    return int.from_bytes(account[8:16], "little")


def diff(old: bytes, new: bytes, block: int = 32, span: int = 2048) -> tuple[tuple[int, bytes], ...]:
    """Byte ranges of ``new`` that differ from ``old``, compared in blocks and merged when adjacent.

    Spans of ``span`` bytes are compared first and only those that differ block by block: a change touches a few
    spans of the 120 KB account, so this takes a tenth of the time of comparing every block, with the same result.
    """
    if len(old) != len(new):
        return ((0, new),)
    ranges: list[list[int]] = []
    for start in (s + b for s in range(0, len(new), span) if old[s:s + span] != new[s:s + span]
                  for b in range(0, min(span, len(new) - s), block)):
        if old[start:start + block] != new[start:start + block]:
            end = min(start + block, len(new))
            if ranges and ranges[-1][1] == start:
                ranges[-1][1] = end
            else:
                ranges.append([start, end])
    return tuple((s, new[s:e]) for s, e in ranges)


@dataclasses.dataclass(frozen=True)
class Request(Message):
    """Client → server: one coordinator instruction, signed; ``authorizer`` co-signs a join on a gated run."""

    sequence: int
    instruction: bytes
    signature: bytes
    authorizer: bytes = b""
    authorizer_signature: bytes = b""
    TYPE = 0x82

    def body(self) -> bytes:
        return (struct.pack(">Q", self.sequence) + _blob(self.instruction) + self.signature
                + _blob(self.authorizer + self.authorizer_signature))

    @classmethod
    def parse(cls, cur: _Cursor) -> Request:
        sequence = cur.u64()
        instruction = cur.blob()
        signature = cur.take(64)
        co = cur.blob()
        if len(co) not in (0, 96):
            raise ProtocolError("request: a co-signature is a 32-byte key and a 64-byte signature")
        return cls(sequence, instruction, signature, co[:32], co[32:])


def request_message(challenge: bytes, sequence: int, instruction: bytes) -> bytes:
    """What a request's signatures cover: binding it to this connection and this position in it."""
    return REQUEST_DOMAIN + challenge + struct.pack(">Q", sequence) + instruction


def join_authorization(joiner: bytes, request: bytes) -> bytes:
    """What a run's join authority co-signs: the joiner's key and its ``request_message``. The request alone
    names no key (its challenge is the connection's), so a countersignature over it could be carried to a
    connection of another key; over this, it admits only the key it was given for."""
    return JOIN_AUTHORIZATION_DOMAIN + joiner + request


def split_join_authorization(message: bytes) -> tuple[bytes, bytes] | None:
    """The (joiner key, instruction) a ``join_authorization`` message carries; None when it is not one."""
    head = len(JOIN_AUTHORIZATION_DOMAIN)
    joiner, request = message[head:head + 32], message[head + 32:]
    instruction_at = len(REQUEST_DOMAIN) + CHALLENGE_BYTES + 8
    if (not message.startswith(JOIN_AUTHORIZATION_DOMAIN) or len(joiner) != 32
            or not request.startswith(REQUEST_DOMAIN) or len(request) < instruction_at):
        return None
    return joiner, request[instruction_at:]


REPLY_OK = 0
REPLY_BAD_SIGNATURE = 1
REPLY_REPLAY = 2
REPLY_MALFORMED = 3
"""Codes of requests the server refuses before the coordinator sees them; a coordinator rejection carries
the error's own code (6000 and up), the same number the Solana program returns."""
REPLY_NOT_STORED = 4
"""The coordinator accepted the request but the server could not store the result, so nothing changed:
the server acknowledges only what it has stored. The request may be sent again."""


@dataclasses.dataclass(frozen=True)
class Reply(Message):
    """Server → client: the outcome of the request with ``sequence``; code 0 means applied."""

    sequence: int
    code: int
    message: str
    TYPE = 0x20

    def body(self) -> bytes:
        return struct.pack(">QI", self.sequence, self.code) + _blob(self.message.encode())

    @classmethod
    def parse(cls, cur: _Cursor) -> Reply:
        sequence, code = cur.u64(), cur.u32()
        return cls(sequence, code, cur.blob().decode(errors="replace"))


@dataclasses.dataclass(frozen=True)
class Fatal(Message):
    """Server → client, before closing: why the connection ends (bad auth, protocol violation)."""

    message: str
    TYPE = 0x21

    def body(self) -> bytes:
        return self.message.encode()

    @classmethod
    def parse(cls, cur: _Cursor) -> Fatal:
        return cls(cur.rest().decode(errors="replace"))


@dataclasses.dataclass(frozen=True)
class Ping(_Bare):
    """Server → client: the connection has been quiet; answer ``Pong`` or be closed as idle."""

    TYPE = 0x03


@dataclasses.dataclass(frozen=True)
class Pong(_Bare):
    """Client → server: the answer to ``Ping``; the client is still there."""

    TYPE = 0x83


MESSAGES: dict[int, type[Message]] = {m.TYPE: m for m in (Challenge, Hello, Welcome, FullState, StatePatch,
                                                          Request, Reply, Fatal, Ping, Pong)}


def decode(payload: bytes) -> Message:
    """Parse one payload; anything malformed raises ``ProtocolError`` naming the problem."""
    if not payload:
        raise ProtocolError("empty message")
    cls = MESSAGES.get(payload[0])
    if cls is None:
        raise ProtocolError(f"unknown message type 0x{payload[0]:02x}")
    cur = _Cursor(payload[1:], cls.__name__)
    message = cls.parse(cur)
    cur.end()
    return message
