"""The learning rate of every optimizer step, from the run's on-chain model description.

Every worker of a stage must step with the same rate, so the formula lives in the specification beside the
fields it reads (``Model.lr_schedule``, ``warmup_steps``, ``learning_rate_micros``, ``lr_floor_micros``) and the
run's ``total_steps``; ``validate_schedule`` has already made those fit each other.
"""

from __future__ import annotations

import math

from coordinator_program.spec.config import Model, Schedule

MICROS = 1_000_000


def learning_rate(model: Model, total_steps: int, step: int) -> float:
    """The rate of optimizer step ``step`` (0-based) of a run of ``total_steps`` steps.

    - Constant: the learning rate throughout.
    - LinearWarmup: lr·(step+1)/warmup_steps while step < warmup_steps (never 0, so the first step learns),
      then lr.
    - WarmupCosine: the same warmup, then a half cosine from lr down to the floor, reached at total_steps and
      kept beyond (a run resumed past its end keeps the floor rather than climbing back).
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    peak = model.learning_rate_micros / MICROS
    if model.lr_schedule == Schedule.Constant:
        return peak
    if step < model.warmup_steps:
        return peak * (step + 1) / model.warmup_steps
    if model.lr_schedule == Schedule.LinearWarmup:
        return peak
    floor = model.lr_floor_micros / MICROS
    if step >= total_steps:
        return floor
    progress = min(1.0, (step - model.warmup_steps) / (total_steps - model.warmup_steps))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
