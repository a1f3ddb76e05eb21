"""How large a witness's participant filter is: its slices and bits for a part's keys at a run's error rate, and
the largest run whose filters still fit a witness transaction (``limits.MAX_BLOOM_BYTES``). The filters themselves
are ``bloom``; ``config`` sizes a run's with these when a ``state.toml`` is read.
"""

from __future__ import annotations

from coordinator_program.spec import limits
from coordinator_program.spec.errors import InvalidConfig


def bloom_params(capacity: int, error_rate: float) -> tuple[int, int]:
    """(slices, bits per slice) that pybloom-live's ``BloomFilter(capacity, error_rate)`` uses."""
    if not 0 < error_rate < 1:
        raise InvalidConfig("bloom_error_rate: must be between 0 and 1")
    from pybloom_live import BloomFilter

    bloom = BloomFilter(capacity, error_rate)
    return bloom.num_slices, bloom.bits_per_slice


KEYS_PER_CLIENT = 2
"""A witness's participant filter holds each client's participant key and, for counted work, its compute key."""


def filter_capacity(max_clients: int) -> int:
    """Keys a part's participant filter is sized for: every client of a full part (``limits.PART_CLIENTS``, or
    all of a smaller run) present and credited for compute."""
    return KEYS_PER_CLIENT * min(max_clients, limits.PART_CLIENTS)


def largest_max_clients(error_rate: float) -> int:
    """The most clients whose part filters still fit a witness transaction at ``error_rate``: any run size once a
    full part fits."""
    fits = [n for n in range(1, limits.PART_CLIENTS + 1)
            if filter_bytes(*bloom_params(filter_capacity(n), error_rate)) <= limits.MAX_BLOOM_BYTES]
    if fits and fits[-1] == limits.PART_CLIENTS:
        return limits.MAX_CLIENTS
    return max(fits, default=0)


def filter_bytes(slices: int, bits_per_slice: int) -> int:
    """pybloom-live's bit array of ``slices`` × ``bits_per_slice`` bits, in whole bytes."""
    return (slices * bits_per_slice + 7) // 8
