"""Robust aggregation of each part of a butterfly all-reduce: one CenteredClip step from the coordinate median.

In hivemind's butterfly all-reduce every peer reduces one part of the vector: it receives that part from every
sender with the sender's weight and returns their weighted mean. A mean follows its largest input without
bound, so one groupmate (a roster member: strangers never get this far, ``membership``) could move the stage
anywhere by sending a large part or claiming a large weight. BTARD-SGD (Gorbunov et al., ICML 2022) replaces
the mean of each part by CenteredClip; this reducer does the same, in the form that keeps an honest group's
result the weighted mean:

    weights   w_i > 0 only (weight-0 peers are syncing: they receive and add nothing), each capped at the upper
              median of the weights, so nobody outweighs the middle member by claiming more samples;
    centre    m = the coordinate-wise median of the parts;
    radius    τ = κ · the lower median of the distances ‖x_i − m‖ (κ = ``KAPPA``);
    result    r = m + Σ ω_i · clip_τ(x_i − m),  ω_i = w_i / Σ w,  clip_τ(v) = v · min(1, τ / ‖v‖).

When no part is farther than τ from m, r = Σ ω_i x_i exactly: an honest group whose members are alike gets
its weighted mean, save that a weight above the upper median counts as the upper median (the benchmarks
measure what clipping costs when members are not alike).

The bound, for one liar b among k ≥ 3 positive-weight senders of a part (H: the honest ones):

- every coordinate of m lies between the smallest and largest honest value of that coordinate (a median of k
  values, at most one of them a liar's, has an honest value on each side);
- at least two distances are no smaller than the lower median, one of them honest, so τ ≤ κ · D_H, where
  D_H = max over H of ‖x_i − m‖: the liar cannot widen the radius beyond the honest spread;
- hence ‖r − m‖ ≤ τ ≤ κ·D_H, and the liar's own term moves r by at most ω_b·τ, where ω_b ≤ w_max(H) /
  (Σ_H w + w_max(H)) because of the cap (1/k when the honest weigh alike).

So one member of a group of three or more cannot move the stage further than κ times the honest members' own
disagreement, whatever it sends and whatever weight it claims. With k = 2 positive-weight senders there is no
majority to tell the liar by, and the cap binds nobody: the result is the weighted mean, a group of two trusts
both. What bounds a liar there is the weight it may claim: no more than ``max_weight``, what its role can
honestly have done (a round's global batch for gradients; 1 in SPARTA, where replicas weigh alike), and
every part it sends must carry the weight it declared (``membership``, ``stage_averager``); so its weight is
ω_b ≤ max_weight / (max_weight + w_h), w_h the honest member's. Capping the larger weight at the smaller would
halve a liar's pull but weigh honest pairs' unequal samples equally, the commonest honest case (two workers
per stage). With k = 1 it is that part.

The reducer that applies this inside hivemind's all-reduce, and the checks on what other reducers return, are
``client.averaging.runner``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

KAPPA = 2.0  # the clipping radius in lower-median distances; above 1 so that alike honest members are not clipped


def robust_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], kappa: float = KAPPA) -> torch.Tensor:
    """One part's aggregate as described in the module docstring (NaN everywhere when no weight is positive,
    as hivemind's mean gives: the caller keeps its local values there)."""
    return robust_means(parts, weights, max(parts[0].numel(), 1), kappa)


def robust_means(parts: Sequence[torch.Tensor], weights: Sequence[float], block: int,
                 kappa: float = KAPPA) -> torch.Tensor:
    """``robust_mean`` of each ``block`` of consecutive values of the parts (the last block may be shorter), all at
    once: each block has its own median, radius and clipping."""
    kept = [(part, float(w)) for part, w in zip(parts, weights, strict=True) if w > 0 and math.isfinite(w)]
    if not kept:
        return torch.full_like(parts[0], math.nan)
    ordered = sorted(w for _, w in kept)
    cap = ordered[len(ordered) // 2]
    capped = [min(w, cap) for _, w in kept]
    stack = torch.stack([part.reshape(-1).to(torch.float64) for part, _ in kept])  # in float64: parts that agree
    omega = torch.tensor(capped, dtype=torch.float64)  # average to themselves, not to an ulp beside them
    omega /= omega.sum()
    if len(kept) < 3:  # no majority to tell a liar by: the (capped) weighted mean
        result = (stack * omega[:, None]).sum(0)
    else:
        size = stack.shape[1]
        whole = size // block * block
        result = torch.cat([_clipped(stack[:, :whole].reshape(len(kept), -1, block), omega, kappa).reshape(-1),
                            _clipped(stack[:, whole:].reshape(len(kept), 1, -1), omega, kappa).reshape(-1)])
    return result.to(parts[0].dtype).reshape(parts[0].shape)


def _clipped(stack: torch.Tensor, omega: torch.Tensor, kappa: float) -> torch.Tensor:
    """The aggregate of each block of ``stack`` (senders × blocks × values): centre, radius and clipping per block."""
    centre = _median(stack)
    offsets = stack - centre
    distances = torch.linalg.vector_norm(offsets, dim=2)  # senders × blocks
    radius = kappa * distances.sort(dim=0).values[(len(stack) - 1) // 2]
    scale = torch.where(distances > radius, radius / distances.clamp_min(1e-300), torch.ones_like(distances))
    return centre + (offsets * (omega[:, None] * scale)[..., None]).sum(0)


def _median(stack: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise (lower) median of the rows; for three rows by min and max, several times faster
    than a sort and the common group size."""
    if len(stack) == 3:
        a, b, c = stack
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    return stack.median(dim=0).values
