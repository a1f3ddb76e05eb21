"""Witness filters: pybloom-live's bits, the raw-bit membership check, and their size at capacity."""

from __future__ import annotations

import random

import pytest
from pybloom_live import BloomFilter

from coordinator_program.facts import config_facts, fits_in_transaction
from coordinator_program.spec import limits
from coordinator_program.spec.bloom import build_filter, contains_raw, filter_from_bytes, participant_key
from coordinator_program.spec.config import Config, bloom_params, predicted_false_positive_rate

RATE = 0.0009
SLICES, BITS = bloom_params(limits.MAX_CLIENTS, RATE)
FULL = Config(max_clients=limits.MAX_CLIENTS, bloom_slices=SLICES, bloom_bits_per_slice=BITS, min_clients=4)


def keys(rng: random.Random, n: int) -> list[str]:
    return [participant_key(rng.randbytes(32)) for _ in range(n)]


def test_filter_bits_are_pybloom_lives() -> None:
    rng = random.Random(1)
    members = keys(rng, limits.MAX_CLIENTS)
    reference = BloomFilter(limits.MAX_CLIENTS, RATE)
    for k in members:
        reference.add(k)
    assert build_filter(FULL, members) == reference.bitarray.tobytes()


def test_raw_membership_agrees_with_pybloom_live() -> None:
    rng = random.Random(2)
    members = keys(rng, 200)
    raw = build_filter(FULL, members)
    bloom = filter_from_bytes(FULL, raw)
    probes = members + keys(rng, 5000)
    assert all(contains_raw(raw, k, SLICES, BITS) == (k in bloom) for k in probes)
    assert all(contains_raw(raw, k, SLICES, BITS) for k in members)


def test_false_positive_rate_at_capacity_is_as_predicted() -> None:
    rng = random.Random(3)
    raw = build_filter(FULL, keys(rng, limits.MAX_CLIENTS))
    probes = 20_000
    hits = sum(contains_raw(raw, k, SLICES, BITS) for k in keys(rng, probes))
    predicted = predicted_false_positive_rate(FULL, limits.MAX_CLIENTS)
    assert predicted <= 0.01
    assert hits / probes <= 0.01
    assert abs(hits - predicted * probes) < 5 * (predicted * probes) ** 0.5 + 3


def test_witness_proof_at_full_capacity_fits_one_transaction() -> None:
    facts = config_facts(FULL)
    assert facts.bloom_bytes <= limits.MAX_BLOOM_BYTES
    assert fits_in_transaction(facts) and facts.witness_transaction_bytes <= limits.SOLANA_TX_LIMIT


def test_filter_from_bytes_rejects_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="bytes"):
        filter_from_bytes(FULL, b"\0" * (FULL.bloom_bytes + 1))
