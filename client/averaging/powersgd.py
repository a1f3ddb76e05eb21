"""PowerSGD's pure functions (Vogels et al. 2019; the round: ``client.averaging.gradients``): which gradients it
factors, and the Q every peer of a group starts from when none holds one from a complete round."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch


def compressed_shape(shape: Sequence[int], rank: int, min_compression: float) -> tuple[int, int] | None:
    """The (rows, cols) PowerSGD factors a gradient of ``shape`` as, or None if it is sent in full: vectors,
    and matrices that rank-``rank`` factors would not shrink ``min_compression``-fold. Tensors of more than two
    dimensions are viewed as (first dimension, the rest)."""
    if rank < 1 or len(shape) < 2:
        return None
    rows, cols = int(shape[0]), math.prod(int(s) for s in shape[1:])
    return (rows, cols) if (rows + cols) * rank * min_compression <= rows * cols else None


def seeded_matrix(seed: int, name: str, rows: int, cols: int) -> torch.Tensor:
    """A (rows × cols) float32 matrix uniform in [-1, 1), a pure function of its arguments (SHA-256 in counter
    mode), so that every peer draws the same one whatever its torch version."""
    key = hashlib.sha256(f"psyswarm-powersgd:{seed}:{name}".encode()).digest()
    count = rows * cols
    stream = b"".join(hashlib.sha256(key + i.to_bytes(8, "little")).digest() for i in range(-(-count // 8)))
    words = np.frombuffer(stream, dtype="<u4")[:count].astype(np.float64)
    return torch.from_numpy((words / 2.0**31 - 1.0).astype(np.float32)).reshape(rows, cols)
