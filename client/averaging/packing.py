"""A phase's tensors laid end to end and cut once per reducer, so that an all-reduce sends a message per peer, not
per tensor.

hivemind's partitioner never joins tensors: each one smaller than a part travels as a part of its own, and here every
part is also signed by its sender, reduced, returned with a statement signed by its reducer, and open to an audit
(``client.averaging.audit``). PowerSGD's factors of a model of a hundred small matrices were a hundred such parts a
phase, their framing a seventh of the bytes. Cut where hivemind's load balancing splits the whole, the pieces land one
on each reducer, and an audit's one part drawn at random is one reducer's whole shard (where it fits in a part).

Nothing of the checks changes: a piece's norm is within the sender's declared norm (that of everything it sends), as
each tensor's was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def piece_sizes(total: int, fractions: Sequence[float]) -> list[int]:
    """The sizes of the pieces ``total`` values are cut into, one per reducer with a share of them, at the very
    pivots hivemind's ``TensorPartContainer`` computes from the same ``fractions`` (so that each piece lands whole on
    its reducer); reducers with no share get no piece."""
    pivots = (np.cumsum(fractions) / np.sum(fractions) * total).astype(np.int64)
    pivots[-1] = total
    sizes = np.diff(pivots, prepend=0)
    return [int(size) for size in sizes if size > 0]


def laid_end_to_end(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` flattened into one float32 vector, in order."""
    return torch.cat([tensor.reshape(-1).to(torch.float32) for tensor in tensors])


def put_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` (laid out as ``laid_end_to_end(tensors)``) back into ``tensors``, in place."""
    for tensor, values in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
        tensor.copy_(values.view(tensor.shape))
