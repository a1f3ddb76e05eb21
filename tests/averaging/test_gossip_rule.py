"""PowerGossip's pure rules (``client.averaging.gossip_rule``): the parts mixed in turn, the signs, and the bound."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.averaging.gossip_rule import MOVE_BOUND, VECTOR_SLICES, bounded, part_size, sign, vector_part


def test_the_pair_members_send_opposite_signs() -> None:
    assert (sign(True), sign(False)) == (1, -1)


@given(st.integers(min_value=1, max_value=500), st.integers(min_value=0, max_value=10_000))
def test_every_element_is_mixed_once_in_every_run_of_slices(numel: int, start: int) -> None:
    seen = torch.zeros(numel, dtype=torch.int64)
    for index in range(start, start + VECTOR_SLICES):
        part = vector_part(numel, index)
        assert len(range(*part.indices(numel))) <= part_size(numel)
        seen[part] += 1
    assert bool((seen == 1).all())


def test_a_move_within_the_bound_is_kept_and_a_larger_one_shortened_to_it() -> None:
    own = torch.full((4,), 0.5)  # norm 1
    small = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert bounded(small, own) == (small, False)
    large = torch.tensor([30.0, 40.0, 0.0, 0.0])  # norm 50
    moved, cut = bounded(large, own)
    assert cut and float(moved.norm()) == pytest.approx(MOVE_BOUND * 1.0)
    assert torch.allclose(moved / moved.norm(), large / large.norm())  # its direction kept


def test_a_replica_that_did_not_train_is_not_moved_and_a_non_finite_move_is_dropped() -> None:
    assert torch.equal(bounded(torch.ones(3), torch.zeros(3))[0], torch.zeros(3))
    moved, cut = bounded(torch.tensor([1.0, math.nan]), torch.ones(2), math.inf)
    assert cut and torch.equal(moved, torch.zeros(2))


@settings(max_examples=200)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=16), st.one_of(st.just(0.0), st.floats(1e-6, 1e3)),
       st.one_of(st.just(0.0), st.floats(1e-3, 10)))  # float32 values: no changes near its smallest normal numbers
def test_no_move_exceeds_the_bound(values: list[float], scale: float, bound: float) -> None:
    move = torch.tensor(values)
    own = torch.full_like(move, scale)
    moved, _ = bounded(move, own, bound)
    size, limit = (float(torch.linalg.vector_norm(t, dtype=torch.float64)) for t in (moved, own))
    assert size <= bound * limit * (1 + 1e-5)
