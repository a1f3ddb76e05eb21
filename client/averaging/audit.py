"""Reductions anyone can check: what senders and reducers sign, what a groupmate checks, and what convicts a reducer.

In hivemind's butterfly all-reduce each peer reduces one shard of the vector (``robust``) and returns the result
of each of its parts to every sender. The senders check only that a part is finite and within the bound an honest
average can have, so a reducer returning anything else than ``robust_mean`` of what it received would move its
shard of every groupmate's tensors, round after round, unseen. BTARD-SGD (Gorbunov et al., ICML 2022) catches such
reducers by checking their work against signed inputs. This is that check, for this project's reducer:

- **signed inputs**: each sender signs every part it sends (``Place.input_message``: the averager's prefix, the
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
- **evidence** (``evidence`` / ``proven_liar``): the statement, and the inputs and the result of one block of the
  part. Checking it needs nothing but the reducer's key: its signature holds over the statement, and either an
  input's signature does not, or the block's inputs and result match their digests and ``robust_mean`` of the
  inputs is not the result (within ``TOLERANCE`` of the inputs' magnitude, for machines whose float64 sums differ
  in their last bits). An honest reducer signs only statements that are true, so there is no evidence against it,
  whoever assembles it.

Why blocks: evidence travels to the witnesses in a DHT record of at most ``records.MAX_RECORD_BYTES``, which every
witness fetches with the round's other records. A part of 16,384 values cannot be carried, k + 1 times over, in that.
So a part is reduced block by block (``BLOCK`` values each: the robust mean of each block, ``reduce_blocks``), and a
part's digest is the root of a Merkle tree over its blocks (``part_digest``): what one sender signs then vouches for
each of its blocks, and one block's inputs and result, each with its path to the root, make the whole evidence (13 KB
in a group of three, 30 KB in a group of eight).

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
import numpy as np
import torch
from solders.keypair import Keypair

from client.averaging.robust import robust_mean, robust_means
from client.averaging.values import BLOCK, GradValues, value_error
from client.identity import is_hex, verify

_INPUT = "psyswarm.averaging.input"
_RESULT = "psyswarm.averaging.result"
TOLERANCE = 1e-5
"""How far, relative to the largest input value of a block, a recomputed block may differ from the result and still be
true."""
MAX_INPUTS = 64
"""The most inputs a statement may list (hivemind's groups here are a stage's few workers)."""
MAX_DEPTH = 10
"""The deepest Merkle tree evidence may open: parts of up to 1,024 blocks (this project's have 32)."""


def _blocks(values: torch.Tensor) -> list[bytes]:
    """A part's values (float32, in order) cut into ``BLOCK``s; the last may be shorter."""
    data = values.detach().to(torch.float32).contiguous().reshape(-1).numpy().tobytes()
    return [data[i:i + BLOCK * 4] for i in range(0, len(data), BLOCK * 4)] or [b""]


def _leaf(block: bytes) -> bytes:
    return hashlib.sha256(b"\0" + block).digest()  # leaves and nodes hashed apart: no node passes for a leaf


def _levels(values: torch.Tensor) -> list[list[bytes]]:
    """The Merkle tree over a part's blocks, leaves first, padded to a power of two with empty blocks' leaves."""
    level = [_leaf(b) for b in _blocks(values)]
    level += [_leaf(b"")] * ((1 << (len(level) - 1).bit_length()) - len(level))
    levels = [level]
    while len(level) > 1:
        level = [hashlib.sha256(b"\1" + level[i] + level[i + 1]).digest() for i in range(0, len(level), 2)]
        levels.append(level)
    return levels


def part_digest(values: torch.Tensor) -> bytes:
    """What a signature says of a part: the root of the Merkle tree over its blocks."""
    return _levels(values)[-1][0]


def _path(values: torch.Tensor, block: int) -> bytes:
    """The siblings from block ``block``'s leaf up to the root, concatenated."""
    return b"".join(level[(block >> depth) ^ 1] for depth, level in enumerate(_levels(values)[:-1]))


def _root_from(block_bytes: bytes, block: int, path: bytes) -> bytes:
    node = _leaf(block_bytes)
    for depth in range(len(path) // 32):
        sibling = path[32 * depth:32 * depth + 32]
        node = hashlib.sha256(b"\1" + (sibling + node if block >> depth & 1 else node + sibling)).digest()
    return node


def reduce_blocks(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """A reducer's result for one part: ``robust_mean`` of each ``BLOCK`` of the senders' parts, in order."""
    return robust_means(parts, weights, BLOCK)


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


def signed_entry(keypair: Keypair, place: Place, values: torch.Tensor, weight: float) -> Entry:
    """A sender's own input to ``place``, signed."""
    digest = part_digest(values)
    signature = bytes(keypair.sign_message(place.input_message(digest, weight)))
    return Entry(bytes(keypair.pubkey()), digest, float(weight), signature)


@dataclass(frozen=True)
class Statement:
    """A reducer's word on one part: these inputs, reduced, gave the part of digest ``result``."""

    entries: tuple[Entry, ...]
    result: bytes
    values: GradValues  # the codec the result travelled in (``values``), whose rounding evidence allows
    signature: bytes

    def message(self, place: Place) -> bytes:
        return msgpack.packb([_RESULT, place.prefix, place.group, place.reducer, place.part, self.result,
                              self.values.code, [[e.key, e.digest, e.weight, e.signature] for e in self.entries]])

    def signed_by(self, key: bytes, place: Place) -> bool:
        return verify(key, self.message(place), self.signature)

    def to_bytes(self) -> bytes:
        return msgpack.packb([[[e.key, e.digest, e.weight, e.signature] for e in self.entries], self.result,
                              self.values.code, self.signature])

    @classmethod
    def from_bytes(cls, data: bytes) -> Statement:
        """A statement from a reducer's bytes; ``ValueError`` for anything malformed."""
        try:
            raw = msgpack.unpackb(data, max_array_len=MAX_INPUTS, max_bin_len=64, max_str_len=0, max_map_len=0)
        except Exception as exc:  # a peer's bytes: any malformation is a refusal, never a crash
            raise ValueError(f"unreadable statement ({type(exc).__name__})") from None
        if not (isinstance(raw, list) and len(raw) == 4 and isinstance(raw[0], list) and _is_bytes(raw[1], 32)
                and _index(raw[2], len(GradValues)) and _is_bytes(raw[3], 64)):
            raise ValueError("a statement is [inputs, result digest, codec, signature]")
        entries = []
        for item in raw[0]:
            if not (isinstance(item, list) and len(item) == 4 and _is_bytes(item[0], 32) and _is_bytes(item[1], 32)
                    and isinstance(item[2], float) and math.isfinite(item[2]) and _is_bytes(item[3], 64)):
                raise ValueError("a statement's input is [key, digest, weight, signature]")
            entries.append(Entry(*item))
        return cls(tuple(entries), raw[1], list(GradValues)[raw[2]], raw[3])


def _is_bytes(value: object, length: int) -> bool:
    return isinstance(value, bytes) and len(value) == length


def make_statement(keypair: Keypair, place: Place, entries: Sequence[Entry], result: torch.Tensor,
                   values: GradValues) -> Statement:
    """The reducer's signed statement that ``entries`` reduced to ``result``, as it travels in ``values``."""
    unsigned = Statement(tuple(entries), part_digest(result), values, b"")
    return Statement(unsigned.entries, unsigned.result, values,
                     bytes(keypair.sign_message(unsigned.message(place))))


def statement_refusal(statement: Statement, place: Place, reducer_key: bytes, result: torch.Tensor,
                      own: Entry, values: GradValues) -> str:
    """Why a sender may not take back ``result`` with ``statement``, or "": the reducer's key signed it, it names
    ``result``'s digest and the run's codec ``values``, and it lists ``own`` (this sender's input) exactly once,
    as sent."""
    if not statement.signed_by(reducer_key, place):
        return "its statement is not signed by its key"
    if statement.result != part_digest(result):
        return "its statement names another result"
    if statement.values != values:
        return f"its statement names the codec {statement.values.value}, not the run's {values.value}"
    if [e for e in statement.entries if e.key == own.key] != [own]:
        return "its statement does not list this peer's input as it was sent"
    return ""


def forged(statement: Statement, place: Place) -> bool:
    """Whether a statement lists an input its sender did not sign (or one sender twice): a reducer's forgery."""
    return len({e.key for e in statement.entries}) != len(statement.entries) or not all(
        e.holds(place) for e in statement.entries)


def false_block(statement: Statement, inputs: Sequence[torch.Tensor], result: torch.Tensor) -> int | None:
    """The first block of ``result`` that is not ``robust_mean`` of that block of ``inputs`` (the parts the statement
    lists, in its order) within ``TOLERANCE``, or None if there is none. ``ValueError`` where the inputs or the
    result are not the ones the statement names: then nothing is proven."""
    if len(inputs) != len(statement.entries) or not statement.entries:
        raise ValueError("the inputs are not the statement's")
    if any(p.shape != result.shape for p in inputs):
        raise ValueError("the inputs and the result differ in shape")
    if any(part_digest(p) != e.digest for p, e in zip(inputs, statement.entries, strict=True)):
        raise ValueError("an input is not the one the statement names")
    if part_digest(result) != statement.result:
        raise ValueError("the result is not the one the statement names")
    weights = [e.weight for e in statement.entries]
    flat, returned = [p.reshape(-1) for p in inputs], result.reshape(-1)
    for index, start in enumerate(range(0, returned.numel(), BLOCK)):
        if _departs([p[start:start + BLOCK] for p in flat], weights, returned[start:start + BLOCK], statement.values):
            return index
    return None


def _departs(inputs: Sequence[torch.Tensor], weights: Sequence[float], result: torch.Tensor,
             values: GradValues) -> bool:
    """Whether ``result`` is farther from ``robust_mean`` of ``inputs`` than float sums on another machine and the
    codec ``values`` can take it: the codec rounds the reducer's own sum, within ``TOLERANCE`` of this one."""
    expected = robust_mean(inputs, weights)
    if not torch.isfinite(expected).all():
        return False  # no input has a positive weight: nothing to hold the result to
    if not torch.isfinite(result).all():
        return True
    float_error = TOLERANCE * max(max(float(p.abs().max()) for p in inputs), 1e-30)
    allowed = float_error + value_error(values, float(expected.abs().max()) + float_error)
    return float((result.double() - expected.double()).abs().max()) > allowed


def evidence(place: Place, reducer_key: bytes, statement: Statement, inputs: Sequence[torch.Tensor] = (),
             result: torch.Tensor | None = None, block: int = 0) -> dict[str, Any]:
    """A statement as an accusation carries it, with block ``block`` of its inputs and result (none for a forgery):
    JSON, keys and ids in hex, blocks and their Merkle paths in base64 (a third the size of hex)."""
    def opened(values: torch.Tensor) -> dict[str, str]:
        return {"path": _b64(_path(values, block)), "values": _b64(_blocks(values)[block])}

    return {"reduction": {"prefix": place.prefix, "group": place.group.hex(), "reducer": place.reducer.hex(),
                          "part": place.part, "key": reducer_key.hex(), "statement": statement.to_bytes().hex(),
                          "block": block, "inputs": [opened(p) for p in inputs],
                          "result": opened(result) if result is not None else None}}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def proven_liar(item: object) -> tuple[bytes, str] | None:
    """The reducer's key and its prefix if ``item`` (``evidence``) proves that key signed a false statement; None
    where it proves nothing. The caller checks that the key belonged where the prefix says."""
    body = item.get("reduction") if isinstance(item, dict) and len(item) == 1 else None
    if not (isinstance(body, dict) and set(body) == {"prefix", "group", "reducer", "part", "key", "statement",
                                                     "block", "inputs", "result"}):
        return None
    prefix, part, key, block, inputs = body["prefix"], body["part"], body["key"], body["block"], body["inputs"]
    if not (isinstance(prefix, str) and len(prefix) <= 256 and _index(part, 1 << 32) and is_hex(key, 32)
            and _index(block, 1 << MAX_DEPTH) and isinstance(inputs, list) and len(inputs) <= MAX_INPUTS):
        return None
    try:
        place = Place(prefix, _hex(body["group"]), _hex(body["reducer"]), part)
        statement = Statement.from_bytes(_hex(body["statement"]))
        if not statement.signed_by(bytes.fromhex(key), place):
            return None
        if forged(statement, place):
            return bytes.fromhex(key), prefix
        if len(inputs) != len(statement.entries):
            return None
        blocks = [_opened(opened, e.digest, block) for opened, e in zip(inputs, statement.entries, strict=True)]
        result = _opened(body["result"], statement.result, block)
    except ValueError:
        return None
    if any(b.shape != result.shape for b in blocks) or not result.numel():
        return None
    departs = _departs(blocks, [e.weight for e in statement.entries], result, statement.values)
    return (bytes.fromhex(key), prefix) if departs else None


def _index(value: object, bound: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < bound


def _opened(opened: object, digest: bytes, block: int) -> torch.Tensor:
    """Block ``block`` of a part of digest ``digest``, from its evidence (``{"path", "values"}``); ``ValueError``
    unless the values and their path lead to the digest."""
    if not (isinstance(opened, dict) and set(opened) == {"path", "values"}):
        raise ValueError("not an opened block")
    path, values = _unb64(opened["path"], 32 * MAX_DEPTH), _unb64(opened["values"], 4 * BLOCK)
    if len(path) % 32 or len(values) % 4 or block >> (len(path) // 32) or _root_from(values, block, path) != digest:
        raise ValueError("the values and their path do not lead to the part's digest")
    return torch.from_numpy(np.frombuffer(values, dtype=np.float32).copy())


def _hex(value: object) -> bytes:
    if not (isinstance(value, str) and len(value) <= 2 * 64 * 1024):
        raise ValueError("not hex")
    return bytes.fromhex(value)


def _unb64(value: object, most: int) -> bytes:
    if not (isinstance(value, str) and len(value) <= 2 * most):
        raise ValueError("not base64")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
