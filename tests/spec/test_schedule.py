"""Learning-rate schedules at their boundaries (step 0, end of warmup, mid-decay, the end and beyond), each value
checked against the formula written out by hand, and their shape as properties."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator_program.spec.config import Model, Schedule
from coordinator_program.spec.schedule import learning_rate

LR = 0.002  # learning_rate_micros 2000
FLOOR = 0.0002
TOTAL = 110
WARMUP = 10


def model(schedule: Schedule, warmup: int = WARMUP, floor_micros: int = 0) -> Model:
    return Model(learning_rate_micros=2000, lr_schedule=schedule, warmup_steps=warmup, lr_floor_micros=floor_micros)


@pytest.mark.parametrize("step", [0, WARMUP - 1, WARMUP, 60, TOTAL - 1, TOTAL, 10 * TOTAL])
def test_constant_is_the_learning_rate_at_every_step(step: int) -> None:
    assert learning_rate(model(Schedule.Constant, warmup=0), TOTAL, step) == LR


@pytest.mark.parametrize(("step", "expected"), [
    (0, LR * 1 / WARMUP),  # the first step already learns
    (4, LR * 5 / WARMUP),
    (WARMUP - 1, LR),  # the last warmup step reaches the peak
    (WARMUP, LR),
    (60, LR),
    (TOTAL, LR),
    (10 * TOTAL, LR),
])
def test_linear_warmup(step: int, expected: float) -> None:
    assert learning_rate(model(Schedule.LinearWarmup), TOTAL, step) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("step", "expected"), [
    (0, LR / WARMUP),
    (WARMUP - 1, LR),
    (WARMUP, LR),  # decay starts from the peak: p = 0
    (WARMUP + 25, FLOOR + (LR - FLOOR) * 0.5 * (1 + math.cos(math.pi * 0.25))),
    (60, FLOOR + (LR - FLOOR) / 2),  # mid-decay: p = 1/2, cos = 0
    (TOTAL - 1, FLOOR + (LR - FLOOR) * 0.5 * (1 + math.cos(math.pi * 99 / 100))),
    (TOTAL, FLOOR),  # the end
    (TOTAL + 1, FLOOR),  # and beyond: the floor, never climbing back
    (10 * TOTAL, FLOOR),
])
def test_warmup_cosine(step: int, expected: float) -> None:
    value = learning_rate(model(Schedule.WarmupCosine, floor_micros=200), TOTAL, step)
    assert value == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_cosine_without_warmup_starts_at_the_peak() -> None:
    assert learning_rate(model(Schedule.WarmupCosine, warmup=0), TOTAL, 0) == LR
    assert learning_rate(model(Schedule.WarmupCosine, warmup=0), TOTAL, TOTAL // 2) == pytest.approx(LR / 2)


def test_a_negative_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        learning_rate(model(Schedule.Constant, warmup=0), TOTAL, -1)


@st.composite
def schedules(draw: st.DrawFn) -> tuple[Model, int]:
    """A valid schedule (as validate_schedule accepts) with its run's total_steps."""
    total = draw(st.integers(1, 10_000))
    lr = draw(st.integers(1, 10**6))
    kind = draw(st.sampled_from(list(Schedule)))
    warmup = {Schedule.Constant: 0, Schedule.LinearWarmup: draw(st.integers(1, total)),
              Schedule.WarmupCosine: draw(st.integers(0, total - 1))}[kind]
    floor = draw(st.integers(0, lr)) if kind == Schedule.WarmupCosine else 0
    return dataclasses.replace(Model(), learning_rate_micros=lr, lr_schedule=kind, warmup_steps=warmup,
                               lr_floor_micros=floor), total


@given(schedules(), st.integers(0, 20_000))
def test_never_above_the_learning_rate_nor_below_the_floor_after_warmup(case: tuple[Model, int], step: int) -> None:
    m, total = case
    lr, floor = m.learning_rate_micros / 1e6, m.lr_floor_micros / 1e6
    value = learning_rate(m, total, step)
    assert 0 < value or (m.lr_schedule == Schedule.WarmupCosine and floor == 0 and step >= m.warmup_steps)
    assert value <= lr * (1 + 1e-12)
    if step >= m.warmup_steps:
        assert value >= floor * (1 - 1e-12)


@given(schedules())
def test_warmup_rises_monotonically_and_decay_never_rises(case: tuple[Model, int]) -> None:
    m, total = case
    values = [learning_rate(m, total, step) for step in range(min(total + 2, 600))]
    warmup, rest = values[:m.warmup_steps], values[m.warmup_steps:]
    assert all(a < b for a, b in zip(warmup, warmup[1:], strict=False)), "warmup rises at every step"
    assert all(b <= a * (1 + 1e-12) for a, b in zip(rest, rest[1:], strict=False)), "after warmup it never rises"
