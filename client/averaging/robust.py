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

Each part a peer receives back from another reducer is checked too (``RobustRunner``): a part that is not
finite, or above the bound the caller knows an honest average cannot exceed, fails that reducer alone.

Results travel as the averages themselves, where hivemind sends each sender its delta (average − its own part)
to add back: in floating point x + (a − x) is not always a, so peers adding deltas to different parts end a
round a few ulps apart, and Adam's normalisation turns ulps in small gradients into differences of 1e-5 within
steps. Taking the reducer's average as it is keeps same-stage replicas that average every step bit-identical,
which is what the checked results (activations by digest) and the replicas' state digests compare.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor

KAPPA = 2.0  # the clipping radius in lower-median distances; above 1 so that alike honest members are not clipped


def robust_mean(parts: Sequence[torch.Tensor], weights: Sequence[float], kappa: float = KAPPA) -> torch.Tensor:
    """One part's aggregate as described in the module docstring (NaN everywhere when no weight is positive,
    as hivemind's mean gives: the caller keeps its local values there)."""
    kept = [(part, float(w)) for part, w in zip(parts, weights, strict=True) if w > 0 and math.isfinite(w)]
    if not kept:
        return torch.full_like(parts[0], math.nan)
    ordered = sorted(w for _, w in kept)
    cap = ordered[len(ordered) // 2]
    capped = [min(w, cap) for _, w in kept]
    stack = torch.stack([part.to(torch.float64) for part, _ in kept])  # in float64: parts that agree average
    omega = torch.tensor(capped, dtype=torch.float64)  # to themselves, not to an ulp beside them
    omega /= omega.sum()
    shape = (-1,) + (1,) * (stack.dim() - 1)
    if len(kept) < 3:  # no majority to tell a liar by: the (capped) weighted mean
        return (stack * omega.view(shape)).sum(0).to(parts[0].dtype)
    centre = _median(stack)
    offsets = stack - centre
    distances = torch.linalg.vector_norm(offsets.reshape(len(kept), -1), dim=1)
    radius = kappa * distances.sort().values[(len(kept) - 1) // 2]
    scale = torch.where(distances > radius, radius / distances.clamp_min(1e-300), torch.ones_like(distances))
    return (centre + (offsets * (omega * scale).view(shape)).sum(0)).to(parts[0].dtype)


def _median(stack: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise (lower) median of the rows; for three rows by min and max, several times faster
    than a sort and the common group size."""
    if len(stack) == 3:
        a, b, c = stack
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    return stack.median(dim=0).values


class _Parts:
    """Stands where ``TensorPartReducer`` keeps its running sum: collects (part, weight) and, where the
    reducer divides the sum by the total weight, returns ``robust_mean`` of what it collected."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> _Parts:
        self.parts.append(part.clone())
        self.weights.append(float(alpha))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        return robust_mean(self.parts, self.weights)


class RobustReducer(TensorPartReducer):
    """hivemind's reducer (its senders, bans and part order) with ``robust_mean`` in place of the mean."""

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Parts()


class RobustRunner(AllReduceRunner):
    """hivemind's all-reduce runner reducing its part with ``RobustReducer``, returning averages rather than
    deltas (module docstring), and checking each part another reducer returns: a part that is not finite or
    has an L2 norm above ``result_bound`` (what the caller knows an honest average of that part cannot exceed)
    fails that reducer, as if it had gone silent — hivemind then keeps the reducer's shard (this part and its
    later ones) at the local values and counts it in ``failed_size``, and every other reducer's shard of the
    same tensors is still averaged. A part equal to the local one (the filler for a failed reducer) is always
    taken. The runner yields each tensor's averaged values, not a delta to add."""

    def __init__(self, *, result_bound: float = math.inf, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tensor_part_reducer = RobustReducer(tuple(part.shape for part in self.parts_for_local_averaging),
                                                 len(self.sender_peer_ids))
        container = self.tensor_part_container
        container.return_deltas = False  # a failed reducer's shard is filled with the local parts, not zeros
        own = self.ordered_peer_ids.index(self.peer_id)
        register = container.register_processed_part

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            # hivemind's container keeps each reducer's input parts until it finishes
            local = container._input_parts_by_peer[peer_index][part_index][0]
            if peer_index != own and not torch.equal(part, local):
                norm = float(torch.linalg.vector_norm(part, dtype=torch.float64))
                if not norm <= result_bound:  # also refuses NaN and infinity
                    raise AllreduceException(f"reducer {self.ordered_peer_ids[peer_index]} returned part "
                                             f"{part_index} of norm {norm:.3g}, above {result_bound:.3g}")
            register(peer_index, part_index, part)

        container.register_processed_part = register_checked  # type: ignore[method-assign]

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """This peer's own shard: reduced here, the average registered as it is (other reducers' shards: as
        hivemind receives them, registered by ``register_checked``)."""
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                      weight=self.weight)
            self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
        return None

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        """hivemind's reducer loop for one sender, answering each part with the average itself."""
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                    lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                    stream, max_prefetch=self.tensor_part_container.prefetch):
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                              weight=weight)
                    part_index += 1
                except BannedException:
                    break  # this sender was banned: nothing more of it is reduced
                serialized = await loop.run_in_executor(None, serialize_torch_tensor, averaged, part_compression)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
