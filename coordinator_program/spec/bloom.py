"""Witness bloom filters: pybloom-live's ``BloomFilter``, with parameters fixed by the run's config.

A witness fills a participant filter with every client whose signed round record it verified, and a
batch filter with every verified result commitment. A proof comes in parts, one per ``limits.PART_CLIENTS``
clients by client index (``proof_parts``): part p's filters hold only the keys of p's clients, so every part's
filters are sized for one part's keys (``filter_sizing.filter_capacity``) and fit one transaction whatever the run's
size.
The coordinator (here, and the C program on chain) tests membership from the raw bits alone, recomputing
pybloom-live's bit positions: with 11-16 slices of fewer than 32,768 bits, the positions are the first ``slices``
little-endian u16 words of sha256(sha256(u32 0) ‖ key), each modulo the slice size, slice s starting at bit
s × bits_per_slice, and bit b living in byte b // 8 at mask 1 << (b % 8) (the bit array is little-endian).
"""

from __future__ import annotations

import hashlib
import io
import struct
from collections.abc import Collection, Mapping

from pybloom_live import BloomFilter

from coordinator_program.spec import limits
from coordinator_program.spec.config import Config
from coordinator_program.spec.filter_sizing import filter_capacity

SALT_PREFIX = hashlib.sha256(struct.pack("<I", 0)).digest()
"""The 32 bytes pybloom-live's first salt has absorbed before the key; the program embeds this constant."""


def participant_key(client_id: bytes) -> str:
    """A client's key in a participant filter: its public key in lowercase hex.

    A ``str`` key because pybloom-live hashes ``str(key)`` for anything that is not a string, which for
    bytes would hash their Python repr.
    """
    return client_id.hex()


COMPUTE_KEY_PREFIX = "compute:"
"""What sets a client's compute key apart from its participant key (which is hex alone, so never begins so)."""


def compute_key(client_id: bytes) -> str:
    """A client's key in a participant filter when the witness counted its work this round: a worker's receipts
    verified in a counted commitment, or a trainer's commitment counted. Distinct from ``participant_key``, so
    a witness states presence and work separately in one filter, and the coordinator credits each on a quorum."""
    return COMPUTE_KEY_PREFIX + client_id.hex()


def batch_key(commitment_hash: bytes) -> str:
    """A result commitment's key in a batch filter: the commitment's SHA-256 in lowercase hex."""
    return commitment_hash.hex()


def new_filter(config: Config) -> BloomFilter:
    """An empty pybloom-live filter with exactly the run's slice count and slice size."""
    return filter_from_bytes(config, bytes(config.bloom_bytes))


def filter_from_bytes(config: Config, raw: bytes) -> BloomFilter:
    """Rebuild a pybloom-live filter from its raw bits (pybloom-live's own file format carries the
    parameters, so no private attribute is touched)."""
    if len(raw) != config.bloom_bytes:
        raise ValueError(f"a filter of this run is {config.bloom_bytes} bytes, got {len(raw)}")
    header = struct.pack(BloomFilter.FILE_FMT, 2.0 ** -config.bloom_slices, config.bloom_slices,
                         config.bloom_bits_per_slice, filter_capacity(config.max_clients), 0)
    return BloomFilter.fromfile(io.BytesIO(header + raw))


def filter_bytes(bloom: BloomFilter) -> bytes:
    """The raw bits a witness instruction carries."""
    return bloom.bitarray.tobytes()


def bit_positions(key: str, slices: int, bits_per_slice: int) -> list[int]:
    """Absolute bit positions pybloom-live sets for ``key`` (one per slice)."""
    if not 1 <= slices <= 16:
        raise ValueError("the raw check covers one SHA-256 digest: at most 16 slices")
    words = struct.unpack("<16H", hashlib.sha256(SALT_PREFIX + key.encode()).digest())
    return [s * bits_per_slice + words[s] % bits_per_slice for s in range(slices)]


def contains_raw(raw: bytes, key: str, slices: int, bits_per_slice: int) -> bool:
    """Membership from raw bits alone, as the program tests it."""
    for bit in bit_positions(key, slices, bits_per_slice):
        if not raw[bit >> 3] & (1 << (bit & 7)):
            return False
    return True


def build_filter(config: Config, keys: list[str]) -> bytes:
    """Raw bits of a filter holding ``keys`` (used by witnesses and tests)."""
    bloom = new_filter(config)
    for key in keys:
        bloom.add(key, skip_check=True)
    return filter_bytes(bloom)


def part_count(clients: int) -> int:
    """Parts of a proof for a round of ``clients`` clients (one part at least, so an empty round's proof exists)."""
    return max(1, -(-clients // limits.PART_CLIENTS))


def part_range(part: int, clients: int) -> range:
    """The client indices part ``part`` of a proof covers."""
    return range(part * limits.PART_CLIENTS, min(clients, (part + 1) * limits.PART_CLIENTS))


def proof_parts(config: Config, clients: list[bytes], present: Collection[bytes], computed: Collection[bytes],
                commitments: Mapping[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    """(participant filter, batch filter) of every part of a witness's proof, in part order, for a round whose
    clients are ``clients`` in index order. Part p's participant filter holds the participant key of each of p's
    clients in ``present`` and the compute key of each in ``computed``; its batch filter the hash of each counted
    commitment (``commitments``: trainer -> commitment hash) of p's trainers."""
    present, computed = set(present), set(computed)
    parts = []
    for part in range(part_count(len(clients))):
        members = [clients[i] for i in part_range(part, len(clients))]
        keys = [participant_key(c) for c in members if c in present] + [compute_key(c) for c in members
                                                                         if c in computed]
        batches = [batch_key(commitments[c]) for c in members if c in commitments]
        parts.append((build_filter(config, sorted(keys)), build_filter(config, sorted(batches))))
    return parts
