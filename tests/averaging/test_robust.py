"""The robust reduction of one part (``client.averaging.robust.robust_mean``): the bound its docstring derives,
checked over arbitrary liars, and the weighted mean it gives an honest group."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.averaging.robust import KAPPA, robust_mean

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 6), honest=st.integers(2, 5), data=st.data())
def test_one_liar_stays_within_kappa_times_the_honest_spread_of_the_median(size: int, honest: int, data) -> None:
    parts = [torch.tensor(data.draw(st.lists(finite, min_size=size, max_size=size)), dtype=torch.float32)
             for _ in range(honest)]
    liar = torch.tensor(data.draw(st.lists(finite, min_size=size, max_size=size)), dtype=torch.float32)
    weights = [data.draw(st.floats(0.01, 100.0)) for _ in range(honest)]
    claimed = data.draw(st.floats(0.0, 1e30))
    everyone = [*parts, liar]
    result = robust_mean(everyone, [*weights, claimed]).double()
    stack = torch.stack(everyone).double()
    centre = stack.median(0).values if claimed > 0 else torch.stack(parts).double().median(0).values
    low, high = torch.stack(parts).double().min(0).values, torch.stack(parts).double().max(0).values
    assert bool(((centre >= low) & (centre <= high)).all())  # the centre lies among the honest values
    spread = max(float((p.double() - centre).norm()) for p in parts)
    assert float((result - centre).norm()) <= KAPPA * spread * (1 + 1e-5) + 1e-3


def test_an_honest_group_alike_gets_its_capped_weighted_mean_and_weight_zero_adds_nothing() -> None:
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(1000, generator=generator)
    parts = [signal + torch.randn(1000, generator=generator) for _ in range(4)]
    weights = [1.0, 2.0, 3.0, 0.0]  # 3 is above the middle weight: it counts as 2
    expected = (1.0 * parts[0] + 2.0 * parts[1] + 2.0 * parts[2]) / 5.0
    torch.testing.assert_close(robust_mean(parts, weights), expected, rtol=0, atol=1e-5)
    assert bool(torch.isnan(robust_mean(parts, [0.0] * 4)).all())  # no weight: NaN, as hivemind's mean gives


def test_a_claimed_weight_is_capped_at_the_middle_one() -> None:
    parts = [torch.full((3,), 1.0), torch.full((3,), 2.0)]
    assert math.isclose(float(robust_mean(parts, [1.0, 3.0])[0]), 1.75, rel_tol=1e-6)  # of two: as declared
    three = [*parts, torch.full((3,), 3.0)]
    assert math.isclose(float(robust_mean(three, [1.0, 2.0, 1e30])[0]), (1.0 + 4.0 + 6.0) / 5.0, rel_tol=1e-6)
