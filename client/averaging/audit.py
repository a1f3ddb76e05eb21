"""Reductions anyone can check: what senders and reducers sign, what a groupmate checks, and what convicts a reducer.

In hivemind's butterfly all-reduce each peer reduces one shard of the vector (``robust``) and returns the result
of each of its parts to every sender. The senders check only that a part is finite and within the bound an honest
average can have, so a reducer returning anything else than ``robust_mean`` of what it received would move its
shard of every groupmate's tensors, round after round, unseen. BTARD-SGD (Gorbunov et al., ICML 2022) catches such
reducers by checking their work against signed inputs. This is that check, for this project's reducer:

- **signed inputs**: each sender signs every part it sends (``input_message``: the averager's prefix, the
  all-reduce's group id, the reducer's peer id, the part's index, its digest and its weight). A reducer refuses a
  part whose signature does not hold, as it refuses one with another weight than declared (it bans the sender);
- **signed results**: the reducer returns each averaged part with a ``Statement`` it signs: the inputs it reduced
  (each sender's key, digest, weight and signature, in the order it reduced them) and the digest of the result;
- **checked by every sender**: a sender takes a part back only with a statement signed by the reducer's key that
  lists its own input as it sent it and the digest of the part it came with (``statement_refusal``). A refusal
  there proves nothing to anyone else (a garbled stream, or a reducer that banned this sender), so it fails that
  reducer alone, as a part above the bound does; but a statement signed by the reducer that lists an input whose
  own signature does not hold is a forgery, and the statement alone convicts its signer (``proven_liar``);
- **audited at random**: after a round, each sender asks each other reducer, with probability ``rate`` drawn
  privately, for the inputs of one part chosen at random, and recomputes ``robust_mean``. The reducer has signed
  every statement before it learns which of them is audited, so a reducer lying in any part of r rounds' results
  escapes a groupmate with probability at most (1 − rate / parts)^r, and all its groupmates together far less;
- **evidence** (``evidence`` / ``proven_liar``): the statement, the inputs and the result of one part. Checking it
  needs nothing but the reducer's key: its signature holds over the statement, and either an input's signature
  does not, or the inputs and the result match their digests and ``robust_mean`` of the inputs is not the result
  (within ``TOLERANCE`` of the inputs' magnitude, for machines whose float64 sums differ in their last bits).
  An honest reducer signs only statements that are true, so there is no evidence against it, whoever assembles it.

What this does not catch: a reducer that leaves an honest sender's input out (it claims the sender went silent,
and a sender cannot prove what the reducer received). The sender whose input is missing refuses the part, but
the others take it; with one input fewer the group may be down to two, where the reduction is the weighted mean
(``robust``), so such a reducer's pull on its own shard is what a liar's is in a pair, bounded by the weight it
may claim.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from solders.keypair import Keypair

from client.averaging.robust import robust_mean
from client.identity import is_hex, verify

_INPUT = "psyswarm.averaging.input"
_RESULT = "psyswarm.averaging.result"
TOLERANCE = 1e-5
"""How far, relative to the largest input element, a recomputed part may differ from the result and still be true."""
MAX_INPUTS = 64
"""The most inputs a statement may list (hivemind's groups here are a stage's few workers)."""
MAX_PART_BYTES = 1 << 20
"""The largest serialized part evidence may carry (this project's averagers send parts of 64 KiB)."""


def part_digest(serialized: bytes) -> bytes:
    """What a signature says of a part: the SHA-256 of the part as serialized on the wire."""
    return hashlib.sha256(serialized).digest()


@dataclass(frozen=True)
class Place:
    """Which part of which reduction: the averager's prefix (run, stage, kind), the all-reduce's group id, the
    reducer's libp2p peer id and the part's index within the reducer's shard."""

    prefix: str
    group: bytes
    reducer: bytes
    part: int

    def input_message(self, digest: bytes, weight: float) -> bytes:
        """What a sender signs for its input to this part."""
        return msgpack.packb([_INPUT, self.prefix, self.group, self.reducer, self.part, digest, float(weight)])


@dataclass(frozen=True)
class Entry:
    """One input as a reducer lists it: the sender's key, the part's digest, its weight and the sender's signature."""

    key: bytes
    digest: bytes
    weight: float
    signature: bytes

    def holds(self, place: Place) -> bool:
        """Whether the sender's signature holds over this input to ``place``."""
        return verify(self.key, place.input_message(self.digest, self.weight), self.signature)


def signed_entry(keypair: Keypair, place: Place, serialized: bytes, weight: float) -> Entry:
    """A sender's own input to ``place``, signed."""
    digest = part_digest(serialized)
    signature = bytes(keypair.sign_message(place.input_message(digest, weight)))
    return Entry(bytes(keypair.pubkey()), digest, float(weight), signature)


@dataclass(frozen=True)
class Statement:
    """A reducer's word on one part: these inputs, reduced, gave the part of digest ``result``."""

    entries: tuple[Entry, ...]
    result: bytes
    signature: bytes

    def message(self, place: Place) -> bytes:
        return msgpack.packb([_RESULT, place.prefix, place.group, place.reducer, place.part, self.result,
                              [[e.key, e.digest, e.weight, e.signature] for e in self.entries]])

    def signed_by(self, key: bytes, place: Place) -> bool:
        return verify(key, self.message(place), self.signature)

    def to_bytes(self) -> bytes:
        return msgpack.packb([[[e.key, e.digest, e.weight, e.signature] for e in self.entries], self.result,
                              self.signature])

    @classmethod
    def from_bytes(cls, data: bytes) -> Statement:
        """A statement from a reducer's bytes; ``ValueError`` for anything malformed."""
        try:
            raw = msgpack.unpackb(data, max_array_len=MAX_INPUTS, max_bin_len=64, max_str_len=0, max_map_len=0)
        except Exception as exc:  # a peer's bytes: any malformation is a refusal, never a crash
            raise ValueError(f"unreadable statement ({type(exc).__name__})") from None
        if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], list)
                and _is_bytes(raw[1], 32) and _is_bytes(raw[2], 64)):
            raise ValueError("a statement is [inputs, result digest, signature]")
        entries = []
        for item in raw[0]:
            if not (isinstance(item, list) and len(item) == 4 and _is_bytes(item[0], 32) and _is_bytes(item[1], 32)
                    and isinstance(item[2], float) and math.isfinite(item[2]) and _is_bytes(item[3], 64)):
                raise ValueError("a statement's input is [key, digest, weight, signature]")
            entries.append(Entry(*item))
        return cls(tuple(entries), raw[1], raw[2])


def _is_bytes(value: object, length: int) -> bool:
    return isinstance(value, bytes) and len(value) == length


def make_statement(keypair: Keypair, place: Place, entries: Sequence[Entry], result: bytes) -> Statement:
    """The reducer's signed statement that ``entries`` reduced to the serialized part ``result``."""
    unsigned = Statement(tuple(entries), part_digest(result), b"")
    return Statement(unsigned.entries, unsigned.result, bytes(keypair.sign_message(unsigned.message(place))))


def statement_refusal(statement: Statement, place: Place, reducer_key: bytes, result: bytes, own: Entry) -> str:
    """Why a sender may not take back ``result`` (the serialized part) with ``statement``, or "": the reducer's
    key signed it, it names ``result``'s digest, and it lists ``own`` (this sender's input) exactly once, as sent."""
    if not statement.signed_by(reducer_key, place):
        return "its statement is not signed by its key"
    if statement.result != part_digest(result):
        return "its statement names another result"
    if [e for e in statement.entries if e.key == own.key] != [own]:
        return "its statement does not list this peer's input as it was sent"
    return ""


def forged(statement: Statement, place: Place) -> bool:
    """Whether a statement lists an input its sender did not sign (or one sender twice): a reducer's forgery."""
    return len({e.key for e in statement.entries}) != len(statement.entries) or not all(
        e.holds(place) for e in statement.entries)


def recomputation_refusal(statement: Statement, inputs: Sequence[bytes], result: bytes) -> str:
    """Why the reducer's ``result`` is not ``robust_mean`` of ``inputs`` (the serialized parts its statement lists,
    in its order), or "" if it is, within ``TOLERANCE``. ``ValueError`` where the inputs or the result are not the
    ones the statement names, or cannot be read: then nothing is proven."""
    if len(inputs) != len(statement.entries) or not statement.entries:
        raise ValueError("the inputs are not the statement's")
    if any(part_digest(data) != e.digest for data, e in zip(inputs, statement.entries, strict=True)):
        raise ValueError("an input is not the one the statement names")
    if part_digest(result) != statement.result:
        raise ValueError("the result is not the one the statement names")
    parts = [_tensor(data) for data in inputs]
    returned = _tensor(result)
    if any(p.shape != returned.shape for p in parts):
        raise ValueError("the inputs and the result differ in shape")
    expected = robust_mean(parts, [e.weight for e in statement.entries])
    if not torch.isfinite(expected).all():
        raise ValueError("no input has a positive weight")  # the reducer then returns nothing to check
    scale = max(float(p.abs().max()) for p in parts) if returned.numel() else 0.0
    if not torch.isfinite(returned).all():
        return "the result is not finite"
    difference = float((returned.double() - expected.double()).abs().max()) if returned.numel() else 0.0
    if difference > TOLERANCE * max(scale, 1e-30):
        return f"the result departs from the robust mean of its inputs by {difference:.3g} (inputs up to {scale:.3g})"
    return ""


def _tensor(serialized: bytes) -> torch.Tensor:
    """A part from its wire form, read only if it is an uncompressed float32 part of at most ``MAX_PART_BYTES``."""
    if len(serialized) > MAX_PART_BYTES:
        raise ValueError("a part is larger than any this project sends")
    try:
        proto = runtime_pb2.Tensor.FromString(serialized)
    except Exception:  # noqa: BLE001 - untrusted bytes
        raise ValueError("a part is not a serialized tensor") from None
    if proto.compression != runtime_pb2.CompressionType.NONE or proto.dtype != "float32":
        raise ValueError("a part is not an uncompressed float32 tensor")
    if math.prod(proto.size) * 4 != len(proto.buffer):
        raise ValueError("a part's size does not match its buffer")
    return deserialize_torch_tensor(proto)


def evidence(place: Place, reducer_key: bytes, statement: Statement, inputs: Sequence[bytes],
             result: bytes) -> dict[str, Any]:
    """One part's statement, inputs and result as an accusation carries them (JSON: keys and ids in hex, parts in
    base64, a third the size of hex for what is most of the evidence)."""
    return {"reduction": {"prefix": place.prefix, "group": place.group.hex(), "reducer": place.reducer.hex(),
                          "part": place.part, "key": reducer_key.hex(), "statement": statement.to_bytes().hex(),
                          "inputs": [base64.b64encode(data).decode() for data in inputs],
                          "result": base64.b64encode(result).decode()}}


def proven_liar(item: object) -> tuple[bytes, str] | None:
    """The reducer's key and its prefix if ``item`` (``evidence``) proves that key signed a false statement; None
    where it proves nothing. The caller checks that the key belonged where the prefix says."""
    body = item.get("reduction") if isinstance(item, dict) and len(item) == 1 else None
    if not (isinstance(body, dict) and set(body) == {"prefix", "group", "reducer", "part", "key", "statement",
                                                     "inputs", "result"}):
        return None
    prefix, part, key, inputs = body["prefix"], body["part"], body["key"], body["inputs"]
    if not (isinstance(prefix, str) and len(prefix) <= 256 and isinstance(part, int) and not isinstance(part, bool)
            and 0 <= part < 1 << 32 and is_hex(key, 32) and isinstance(inputs, list) and len(inputs) <= MAX_INPUTS):
        return None
    try:
        place = Place(prefix, _hex(body["group"]), _hex(body["reducer"]), part)
        statement = Statement.from_bytes(_hex(body["statement"]))
        if not statement.signed_by(bytes.fromhex(key), place):
            return None
        if forged(statement, place):
            return bytes.fromhex(key), prefix
        lie = recomputation_refusal(statement, [_b64(data) for data in inputs], _b64(body["result"]))
    except ValueError:
        return None
    return (bytes.fromhex(key), prefix) if lie else None


def _hex(value: object) -> bytes:
    if not (isinstance(value, str) and len(value) <= 4 * MAX_PART_BYTES):
        raise ValueError("not hex")
    return bytes.fromhex(value)


def _b64(value: object) -> bytes:
    if not (isinstance(value, str) and len(value) <= 2 * MAX_PART_BYTES):
        raise ValueError("not base64")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
