"""Everything a round's seed decides: the witnesses and the data each trainer trains on.

Both follow from the seed alone through SHA-256, so every client and the on-chain program (which has the
``sol_sha256`` syscall but no floating point) compute the same answer. Draws use rejection sampling, so
every index is equally likely, and witnesses come from a partial Fisher-Yates shuffle, which needs
``witness_nodes`` draws rather than a full shuffle of every client.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

WITNESS_DOMAIN = b"psyswarm:witness"
DATA_DOMAIN = b"psyswarm:data"
_U64 = 2**64


def seed_from_clock(unix_timestamp: int, slot: int) -> int:
    """The on-chain round seed: the first 8 bytes of sha256(timestamp ‖ slot), little-endian.

    Predictable by whoever ticks, as in Psyche; a centralised server passes a random u64 instead.
    """
    digest = hashlib.sha256(struct.pack("<qQ", unix_timestamp, slot)).digest()
    return int.from_bytes(digest[:8], "little")


def random_words(seed: int, domain: bytes) -> Iterator[int]:
    """An endless stream of u64 words: block j is sha256(domain ‖ seed_le64 ‖ j_le32), cut in four."""
    block = 0
    prefix = domain + struct.pack("<Q", seed)
    while True:
        digest = hashlib.sha256(prefix + struct.pack("<I", block)).digest()
        yield from struct.unpack("<4Q", digest)
        block += 1


def uniform_below(words: Iterator[int], bound: int) -> int:
    """An unbiased integer in [0, bound): words at or above the largest multiple of ``bound`` are redrawn."""
    if bound < 1:
        raise ValueError("bound must be positive")
    limit = _U64 - (_U64 % bound)
    for word in words:
        if word < limit:
            return word % bound
    raise AssertionError("unreachable: the word stream is endless")


def shuffled_prefix(seed: int, domain: bytes, n: int, k: int) -> list[int]:
    """The first ``k`` positions of a Fisher-Yates shuffle of range(n), drawn from the seed."""
    order = list(range(n))
    words = random_words(seed, domain)
    for i in range(min(k, n)):
        j = i + uniform_below(words, n - i)
        order[i], order[j] = order[j], order[i]
    return order[:min(k, n)]


def elect_witnesses(seed: int, num_clients: int, witness_nodes: int) -> list[int]:
    """Client indices of the round's witnesses, in election order (a witness's slot is its position)."""
    return shuffled_prefix(seed, WITNESS_DOMAIN, num_clients, witness_nodes)


def effective_quorum(witness_quorum: int, elected: int) -> int:
    """Proofs needed to settle a round: the configured quorum, capped by how many witnesses exist."""
    return min(witness_quorum, elected)


@dataclass(frozen=True)
class Assignment:
    """A trainer's share of a round's global batch: sample indices [start, end)."""

    client: bytes
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def assign_data(seed: int, trainers: Sequence[bytes], data_index: int, global_batch_size: int) -> list[Assignment]:
    """Split the round's samples [data_index, data_index + global_batch_size) among the trainers.

    The trainers are shuffled by the seed, then take contiguous ranges in that order; the first
    ``global_batch_size % len(trainers)`` of them take one sample more. Who gets the larger share, and
    which part of the data, thus rotates fairly from round to round.
    """
    if not trainers:
        return []
    order = shuffled_prefix(seed, DATA_DOMAIN, len(trainers), len(trainers))
    base, extra = divmod(global_batch_size, len(trainers))
    out = []
    start = data_index
    for rank, index in enumerate(order):
        size = base + (1 if rank < extra else 0)
        out.append(Assignment(trainers[index], start, start + size))
        start += size
    return out
