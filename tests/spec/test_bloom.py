"""Witness filters: pybloom-live's bits, the raw-bit membership check, and their size at capacity."""

from __future__ import annotations

import random

import pytest
from pybloom_live import BloomFilter

from coordinator_program.facts import config_facts, fits_in_transaction
from coordinator_program.spec import limits
from coordinator_program.spec.bloom import (
    build_filter,
    compute_key,
    contains_raw,
    filter_from_bytes,
    part_count,
    participant_key,
    proof_parts,
)
from coordinator_program.spec.config import Config, predicted_false_positive_rate
from coordinator_program.spec.filter_sizing import bloom_params, filter_capacity

RATE = 0.0009
CAPACITY = filter_capacity(limits.MAX_CLIENTS)
SLICES, BITS = bloom_params(CAPACITY, RATE)
FULL = Config(max_clients=limits.MAX_CLIENTS, bloom_slices=SLICES, bloom_bits_per_slice=BITS, min_clients=4)


def keys(rng: random.Random, n: int) -> list[str]:
    return [participant_key(rng.randbytes(32)) for _ in range(n)]


def test_filter_bits_are_pybloom_lives() -> None:
    rng = random.Random(1)
    members = keys(rng, CAPACITY)
    reference = BloomFilter(CAPACITY, RATE)
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
    raw = build_filter(FULL, keys(rng, CAPACITY))
    probes = 40_000
    hits = sum(contains_raw(raw, k, SLICES, BITS) for k in keys(rng, probes))
    predicted = predicted_false_positive_rate(FULL, CAPACITY)
    assert predicted <= 0.001, "the default rate keeps a full part's filter at most 0.1% false positives"
    assert hits / probes <= 0.0015, "measured: 0.1% and sampling noise (the benchmark measures 400,000 probes)"
    assert abs(hits - predicted * probes) < 5 * (predicted * probes) ** 0.5 + 3


def test_a_proof_of_a_full_run_comes_in_parts_each_holding_only_its_own_clients() -> None:
    rng = random.Random(4)
    clients = [rng.randbytes(32) for _ in range(limits.MAX_CLIENTS)]
    worked = set(clients[::3])
    parts = proof_parts(FULL, clients, clients[:-1], worked, {c: rng.randbytes(32) for c in clients[::3]})
    assert len(parts) == part_count(limits.MAX_CLIENTS) == limits.MAX_PARTS
    strays = 0
    for i, client in enumerate(clients):
        own = parts[i // limits.PART_CLIENTS][0]
        other = parts[(i // limits.PART_CLIENTS + 1) % len(parts)][0]
        assert contains_raw(own, participant_key(client), SLICES, BITS) or i == len(clients) - 1
        assert contains_raw(own, compute_key(client), SLICES, BITS) or client not in worked
        strays += contains_raw(other, participant_key(client), SLICES, BITS)
    assert not contains_raw(parts[-1][0], participant_key(clients[-1]), SLICES, BITS)
    assert strays <= 8, "a part's filter holds its own clients only (false positives at ~0.1% aside)"
    assert all(len(p) == len(b) == FULL.bloom_bytes for p, b in parts)


def test_witness_proof_part_at_full_capacity_fits_one_transaction() -> None:
    facts = config_facts(FULL)
    assert facts.bloom_bytes <= limits.MAX_BLOOM_BYTES
    assert fits_in_transaction(facts) and facts.witness_transaction_bytes <= limits.SOLANA_TX_LIMIT


def test_filter_from_bytes_rejects_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="bytes"):
        filter_from_bytes(FULL, b"\0" * (FULL.bloom_bytes + 1))
