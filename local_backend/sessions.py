"""What a connection must prove, checked apart from what the server does with it: the key that answered its
challenge, and whether a request is signed by that key (and, for a join, countersigned for it) and new.

Pure functions of a connection's challenge and what it sent, so that every way a peer can lie is refused in one
place, before the coordinator sees the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.identity import verify
from local_backend import protocol as p


def hello_key(challenge: bytes, payload: bytes) -> bytes:
    """The key that signed ``challenge`` in ``payload``, a connection's first message (Hello); ``ProtocolError``
    if it is anything else or its signature does not match."""
    hello = p.decode(payload)
    if not isinstance(hello, p.Hello):
        raise p.ProtocolError("authenticate first: the first message must be Hello")
    if not verify(hello.pubkey, p.auth_message(challenge), hello.signature):
        raise p.ProtocolError("authentication failed: the signature does not match the key")
    return hello.pubkey


@dataclass(frozen=True)
class Verified:
    """A request whose signatures hold: its instruction, and the join authority that countersigned it, if any."""

    instruction: bytes
    authorizer: bytes | None


def verify_request(challenge: bytes, identity: bytes, last_sequence: int, req: p.Request) -> Verified | p.Reply:
    """The request, verified for the connection logged in as ``identity`` with ``challenge``, whose last accepted
    sequence number is ``last_sequence``; or the reply refusing it (a replay, a bad signature or co-signature)."""
    signed = p.request_message(challenge, req.sequence, req.instruction)
    if req.sequence <= last_sequence:
        return p.Reply(req.sequence, p.REPLY_REPLAY, f"replayed request: sequence {req.sequence} is not above "
                       f"{last_sequence}")
    if not verify(identity, signed, req.signature):
        return p.Reply(req.sequence, p.REPLY_BAD_SIGNATURE, "the request's signature does not match your key")
    if not req.authorizer:
        return Verified(req.instruction, None)
    if not verify(req.authorizer, p.join_authorization(identity, signed), req.authorizer_signature):
        return p.Reply(req.sequence, p.REPLY_BAD_SIGNATURE, "the co-signature does not match its key, or was given "
                       "for another key than this connection's")
    return Verified(req.instruction, req.authorizer)
