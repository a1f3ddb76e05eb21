"""SPARTA's slices in a compact codec: each travels as its change since the group last averaged it.

A parameter does not survive int8: a block's scale is its largest weight, so half a level is larger than many
optimizer steps. Its change since the last average does: a few steps' worth, which int8 carries within half a level
of that change. So every peer keeps an **anchor**, the value each element took when its partition was last averaged
completely, and sends ``value − anchor`` in the run's codec (``grad_values``); the group's average of those changes,
added to the anchor, is the new value and the new anchor. The bytes of a round fall by the codec's factor (about
4 for int8) and what the average does is the same: each peer ends at the anchor plus the weighted mean change.

That only holds while the group's anchors are the same. Each peer declares the SHA-256 of its anchor for the
round's partition beside its weight (``"anchor"``, sealed like the rest; empty when it holds none); the group sends
changes only when every admitted peer declared the same digest, and otherwise averages the values themselves in
float32, which sets every anchor to the same average again. A peer holds no anchor for a partition until a round
that averaged it completed (every sender heard, every reducer's result kept): at its start, and after a round that
failed part-way, whose shards may have kept local values. A liar declaring another digest costs the group one
float32 round of that partition, the bytes it would have cost without this module, and no accuracy: a change is
reduced (robustly, checked, audited) like any part.

Joiners. A peer that downloads a same-stage peer's state takes that donor's anchors with it (``served_anchors``,
``install_anchors``), so its first cycle of partitions travels in the codec too: without them every group it
joins would average values in float32 for P rounds. The anchors are no part of the state's digest, and they need no
trust: a wrong one only makes the joiner declare another digest than the group, which costs that partition one
float32 round and resets the joiner's anchor to the group's.

The anchor is one float32 copy of the stage's parameters in shared memory, written by the averaging process inside
a round, and by the host only while no round runs (a joiner installing its donor's anchors).
"""

from __future__ import annotations

import ctypes
import hashlib
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID

from client.averaging.stage_averager import StageAverager
from client.averaging.values import GradValues, codec

if TYPE_CHECKING:
    from client.averaging.membership import Declared


@dataclass(frozen=True)
class Anchors:
    """A peer's anchors as served to a joiner: the partitions it holds one for, and one float32 tensor per parameter
    tensor (its values at those partitions' elements are the anchors; the rest are not read)."""

    partitions: tuple[int, ...]
    values: Sequence[torch.Tensor]


class Partitions(Protocol):
    """How a stage's parameters are cut into SPARTA's partitions (``sparta.SpartaMasks``)."""

    partitions: int
    numels: list[int]

    def indices(self, partition: int) -> list[torch.Tensor]: ...


def anchor_digest(anchor: Sequence[torch.Tensor], indices: Sequence[torch.Tensor]) -> str:
    """The SHA-256 (hex) of ``anchor``'s values at ``indices``, tensor by tensor: what a peer declares."""
    digest = hashlib.sha256()
    for values, idx in zip(anchor, indices, strict=True):
        digest.update(values[idx].numpy().tobytes())
    return digest.hexdigest()


class AnchoredAverager(StageAverager):
    """A SPARTA averager whose slices travel as changes since their anchor, in ``values`` (the module docstring);
    in float32 it keeps no anchor and averages values, as every SPARTA peer did before anchors. Every SPARTA peer
    runs this class whatever its codec: hivemind names a peer's handlers after its averager's class."""

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: Any, *, masks: Partitions,
                 values: GradValues = GradValues.FLOAT32, **kwargs: Any) -> None:
        self._masks, self._values = masks, values
        # Shared with the averaging process, which alone writes them, so they must exist before it forks.
        self._anchor = ([] if values == GradValues.FLOAT32 else
                        [torch.zeros(numel, dtype=torch.float32).share_memory_() for numel in masks.numels])
        self._anchored = mp.Array(ctypes.c_bool, masks.partitions, lock=False)
        self._changes = mp.Value(ctypes.c_bool, False, lock=False)  # whether this round's group sends changes
        super().__init__(averaged_tensors, dht, **kwargs)

    # ----- host side -----

    @property
    def anchors(self) -> bool:
        """Whether this peer keeps anchors (its codec is not float32), and so declares one each round."""
        return bool(self._anchor)

    def declared_anchor(self, averaging_index: int) -> str:
        """What this peer declares for the round: its anchor's digest for the round's partition, or "" if none."""
        partition = averaging_index % self._masks.partitions
        if not self._anchored[partition]:
            return ""
        return anchor_digest(self._anchor, self._masks.indices(partition))

    def prepare_round(self, averaging_index: int, declaration: dict[str, Any]) -> dict[str, Any]:
        self._changes.value = False  # until this round's group forms
        return super().prepare_round(averaging_index, declaration)

    def served_anchors(self) -> Anchors | None:
        """The anchors this peer holds, to serve with its state (None when it holds none). Read while the averaging
        process may complete a round: a torn copy only costs the joiner one float32 round of that partition."""
        partitions = tuple(p for p in range(self._masks.partitions) if self._anchored[p])
        if not partitions:
            return None
        return Anchors(partitions, [anchor.clone() for anchor in self._anchor])

    def install_anchors(self, anchors: Anchors) -> None:
        """Take a donor's anchors in place of this peer's own, while no round runs (the caller's to ensure). They
        are checked where it matters, at each round: a wrong one makes this peer's digest differ from the group's."""
        if not self._anchor:
            return
        if len(anchors.values) != len(self._anchor) or any(
                tuple(v.shape) != tuple(a.shape) for v, a in zip(anchors.values, self._anchor, strict=True)):
            raise ValueError("the anchors do not fit this stage's parameters")
        if not all(0 <= p < self._masks.partitions for p in anchors.partitions):
            raise ValueError(f"anchored partitions must be in 0..{self._masks.partitions - 1}")
        for partition in range(self._masks.partitions):
            self._anchored[partition] = False
        for anchor, values in zip(self._anchor, anchors.values, strict=True):
            anchor.copy_(values)
        for partition in anchors.partitions:
            self._anchored[partition] = True

    @property
    def anchor_numels(self) -> tuple[int, ...]:
        """The anchors' sizes, one per parameter tensor; () when this peer keeps none (float32)."""
        return tuple(a.numel() for a in self._anchor)

    @property
    def values_sent(self) -> GradValues:
        """How this round's slice travelled: as changes in the run's codec, or as values in float32 (no group
        formed yet, or its peers did not all declare this peer's anchor)."""
        return self._values if self._changes.value else GradValues.FLOAT32

    # ----- averager process -----

    async def _aggregate_admitted(self, group_info: GroupInfo, admitted: dict[PeerID, Declared],
                                  min_vector_size: int, **kwargs: Any) -> Any:
        """Changes in the run's codec when every admitted peer declared the anchor this peer declared, else values.
        (This peer is admitted, with the declaration its host sealed: the digest is not computed again.)"""
        own = admitted[self.peer_id].body.get("anchor")
        self._changes.value = bool(own) and all(d.body.get("anchor") == own for d in admitted.values())
        self._anchored[int(self._round.value) % self._masks.partitions] = False  # until this round has completed
        return await super()._aggregate_admitted(group_info, admitted, min_vector_size, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        if not self._anchor:
            return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        partition = int(self._round.value) % self._masks.partitions
        indices = self._masks.indices(partition)
        anchors = []  # the slice's anchor, padded like the buffers (the padding stays 0): only to send changes
        if self._changes.value:
            kwargs["compression"] = codec(self._values)
            for tensor, anchor, idx in zip(tensors, self._anchor, indices, strict=True):
                anchors.append(torch.zeros_like(tensor))
                anchors[-1][: len(idx)] = anchor[idx]
                tensor.sub_(anchors[-1])
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        finally:
            for tensor, padded in zip(tensors, anchors, strict=False):  # none when values were sent
                tensor.add_(padded)
        if self._complete(group_info.group_id if group_id is None else group_id):
            for anchor, tensor, idx in zip(self._anchor, tensors, indices, strict=True):
                anchor[idx] = tensor[: len(idx)]
            self._anchored[partition] = True
        return None
