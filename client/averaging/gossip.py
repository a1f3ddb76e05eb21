"""PowerGossip between the workers of one pipeline stage: their parameters mixed in pairs, a sliver of the bytes.

SPARTA averages a fixed slice of every tensor. PowerGossip (Vogels et al., 2020, by PowerSGD's authors) runs
PowerSGD's power iteration on the difference of two replicas' parameters instead, so each round's bytes go to the
directions in which the two differ most (``tests/benchmarks/bench_seeds.py``: within 1% of one process at under
1/64 of full averaging's bytes at every width measured, closer than SPARTA). A round, for a group of exactly two:

    each member multiplies its values by its sign (+ first in the group's order, − second: ``gossip_rule.sign``),
    so that the mean of the two is their half difference D = (M_first − M_second) / 2, the same for both;
    PowerSGD's two phases (``client.averaging.gradients``) then bring back P̂ P̂ᵀ D for each matrix (P̂: the
    orthonormalised D q, q warm-started when both hold the last complete round's), and D itself for the eighth of
    every other tensor mixed this round (``gossip_rule.vector_part``), with no error feedback;
    the first member moves by −(what came back) and the second by +: both meet on their mean along P̂.

Signed values give both members the very same P̂ and exactly opposite moves, so a codec's rounding never moves the
pair's mean, only how far apart the two stay (the mean of unsigned values, rounded and applied to both, was noise
added to the model every round).

Defences. Everything ``gradients`` checks holds (membership, declared norms, the robust reduction, reducers'
results, audits), and a round runs only in a group of two admitted members each weighing 1: a third member has no
sign, and a weight other than 1 turns the mean into no difference at all. A pair has no majority, though: a liar's
part is half the mean, so it can move an honest member anywhere along the directions mixed. The bound comes from
training (``gossip_rule.bounded``): no round moves a tensor farther than ``MOVE_BOUND`` × this worker's own change
of it since its last mix. A round that does not complete moves nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils.asyncio import enter_asynchronously

from client.averaging import gossip_rule
from client.averaging.gossip_rule import MOVE_BOUND, VECTOR_SLICES, bounded, part_size, vector_part
from client.averaging.gradients import (
    GradientAverager,
    GradientProcess,
    GradientResult,
    GradientSettings,
    round_payload,
)
from client.averaging.membership import Declared, Membership
from client.averaging.powersgd import compressed_shape
from client.averaging.sparta import AveragingResult, AveragingStatus
from client.averaging.values import encoded_bytes

log = logging.getLogger("psyswarm.gossip")

PAIR_WEIGHT = 1.0
"""What each member of a pair weighs: alike, so that the mean of their signed values is their half difference."""


class GossipProcess(GradientProcess):
    """hivemind's averaging process for a pair: the sign from the group's order, then PowerSGD's phases."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sign = mp.Value(ctypes.c_int8, 0, lock=False)  # shared with the process, so created before it forks
        super().__init__(*args, **kwargs)

    def prepare_round(self, averaging_index: int, declaration: dict[str, Any]) -> dict[str, Any]:
        self._sign.value = 0
        return super().prepare_round(averaging_index, declaration)

    @property
    def sign(self) -> int:
        """This member's sign in the last round's pair (0: it ran no all-reduce)."""
        return int(self._sign.value)

    async def _aggregate_admitted(self, group_info: GroupInfo, admitted: dict[PeerID, Declared],
                                  min_vector_size: int, **kwargs: Any) -> Any:
        weights = sorted(declared.weight for declared in admitted.values())
        if group_info.group_size != 2 or weights != [PAIR_WEIGHT, PAIR_WEIGHT]:
            log.warning("gossip round %d: not a pair of weight-1 members (%d admitted, weights %s), skipped",
                        self._round.value, group_info.group_size, weights)
            self._close_group(group_info)
            return {}
        sign = gossip_rule.sign(group_info.peer_ids[0] == self.peer_id)
        async with enter_asynchronously(self.get_tensors()) as tensors:
            for tensor in tensors:
                tensor.mul_(sign)
        self._sign.value = sign
        try:
            return await super()._aggregate_admitted(group_info, admitted, min_vector_size, **kwargs)
        finally:
            for error in self._errors:  # PowerGossip keeps no error feedback: next round's difference holds it
                error.zero_()


def factored(shape: Sequence[int], settings: GradientSettings) -> bool:
    """Whether a round mixes a tensor of ``shape`` through PowerSGD's factors (else an eighth of it at a time)."""
    return compressed_shape(shape, settings.rank, settings.min_compression) is not None


def sent_shapes(shapes: Sequence[Sequence[int]], settings: GradientSettings) -> list[tuple[int, ...]]:
    """The shape of what a round takes of each tensor: a factored matrix whole (its factors travel), any other
    tensor's part (``gossip_rule.vector_part``), padded to the largest."""
    return [tuple(shape) if factored(shape, settings) else (part_size(math.prod(shape)),) for shape in shapes]


@dataclass(frozen=True)
class GossipResult:
    round: GradientResult  # the round as the pair's all-reduces ended
    moved: bool  # whether this worker's parameters moved (only a complete round moves them)
    clipped: int  # tensors whose move the bound shortened (``gossip_rule.bounded``)
    delta_norm: float = 0.0  # L2 norm of the move applied to the parameters

class GossipAverager(GradientAverager):
    """Mixes a stage's parameters with one same-stage peer at a round (host side). Create it before the worker
    serves gRPC: it forks hivemind's averaging process. ``settings``: PowerSGD's (the rank, timeouts, codec); groups
    of two members weighing ``PAIR_WEIGHT`` are imposed."""

    process_class = GossipProcess
    kind = "gossip"
    rounds = "gossip"
    group_size = 2  # the group matchmaking forms (a class attribute so that a test can form a larger one)

    def __init__(self, named_parameters: Sequence[tuple[str, torch.Tensor]], dht: Any, *, run_id: str, stage: str,
                 seed: int, settings: GradientSettings, membership: Membership, bound: float = MOVE_BOUND) -> None:
        pair = dataclasses.replace(settings.timeouts, min_group_size=self.group_size,
                                   target_group_size=self.group_size)
        settings = dataclasses.replace(settings, timeouts=pair, max_weight=PAIR_WEIGHT, round_samples=0)
        self.factored = [factored(p.shape, settings) for _, p in named_parameters]
        sent = sent_shapes([p.shape for _, p in named_parameters], settings)
        packed = [(name, p if is_factored else torch.zeros(shape))
                  for (name, p), is_factored, shape in zip(named_parameters, self.factored, sent, strict=True)]
        super().__init__(packed, dht, run_id=run_id, stage=stage, seed=seed, settings=settings, membership=membership)
        self.bound = bound
        self._anchors = [p.detach().to("cpu", torch.float32).clone() for _, p in named_parameters]
        self.elements = sum(math.prod(shape) for shape in sent)  # what a round mixes: each matrix, vectors' parts
        self.payload_bytes = sum(encoded_bytes(settings.values, count) for phase in round_payload(
            sent, settings, self.group_size) for count in phase)  # what it sends in a round: factors and parts

    def start_from(self, params: Sequence[torch.Tensor]) -> None:
        """Count this worker's own change from ``params`` as they are now (a state it loaded, not trained)."""
        with torch.no_grad():
            for anchor, param in zip(self._anchors, params, strict=True):
                anchor.copy_(param.detach().reshape(anchor.shape).to("cpu", torch.float32))

    def _part(self, i: int, numel: int, index: int) -> slice:
        """The elements of tensor ``i`` (flattened) that round ``index`` mixes: all of a factored matrix."""
        return slice(None) if self.factored[i] else vector_part(numel, index)

    def _packed(self, params: Sequence[torch.Tensor], index: int) -> list[torch.Tensor]:
        """What this worker sends of ``params`` at round ``index``: each factored matrix whole, each other tensor's
        part padded to its buffer (zeros beyond the part: their mean is 0, and no element they stand for moves)."""
        packed = []
        for i, (param, buffer) in enumerate(zip(params, self._buffers, strict=True)):
            value = param.detach().to("cpu", torch.float32)
            if not self.factored[i]:
                part = value.reshape(-1)[self._part(i, param.numel(), index)]
                value = torch.nn.functional.pad(part, (0, buffer.numel() - part.numel()))
            packed.append(value.clone())
        return packed

    def mix(self, params: Sequence[torch.Tensor], index: int, *, peers: int | None = None,
            lock: contextlib.AbstractContextManager | None = None) -> GossipResult:
        """Mix ``params`` (this worker's contiguous tensors, in the order it was built with) with one groupmate's in
        round ``index``; blocks for the round. Each move is added, under ``lock`` (the worker's), to whatever the
        parameters hold then, so an optimizer step taken meanwhile is kept. ``peers``: other workers seen in the
        stage (0: skip)."""
        lock = lock if lock is not None else contextlib.nullcontext()
        with lock, torch.no_grad():
            values = self._packed(params, index)
        result = self.average(values, 1, index, PAIR_WEIGHT, peers=peers)
        sign = self._process.sign
        if result.status != AveragingStatus.AVERAGED or not result.complete or sign == 0:
            return GossipResult(result, moved=False, clipped=0)
        clipped, squared = 0, 0.0
        with lock, torch.no_grad():
            for i, (param, got, anchor) in enumerate(zip(params, values, self._anchors, strict=True)):
                part = self._part(i, param.numel(), index)
                live, then = param.view(-1)[part], anchor.view(-1)[part]
                own_change = live.to("cpu", torch.float32) - then
                move, cut = bounded(-sign * got.reshape(-1)[:live.numel()], own_change, self.bound)
                live += move.to(live.device, live.dtype)
                then.copy_(live.to("cpu", torch.float32))
                clipped += cut
                squared += float(torch.linalg.vector_norm(move, dtype=torch.float64)) ** 2
        if clipped:
            log.info("%s gossip round %d: the bound shortened the move of %d of %d tensors", self.stage, index,
                     clipped, len(params))
        return GossipResult(result, moved=True, clipped=clipped, delta_norm=math.sqrt(squared))

    def report(self, found: GossipResult) -> AveragingResult:
        """``found`` as a stage's parameter-averaging round reports it (SPARTA's form): averaged only if it moved this
        worker; a worker whose own averaging process failed ``max_failures`` times in a row should leave."""
        r = found.round
        status = AveragingStatus.SKIPPED if r.status == AveragingStatus.AVERAGED and not found.moved else r.status
        return AveragingResult(
            averaging_index=r.round, partition=r.round % VECTOR_SLICES, status=status, reason=r.reason,
            weight=r.weight, group_size=r.group_size, refused=r.refused,
            total_weight=float(r.samples) if found.moved else math.nan, elements=self.elements,
            payload_bytes=self.payload_bytes if r.group_size else 0,
            payload_values=self.settings.values if r.group_size else None, delta_norm=found.delta_norm,
            seconds=r.seconds, consecutive_failures=r.consecutive_failures,
            remove=r.consecutive_failures >= self.settings.timeouts.max_failures)
