"""A trainer's share of a round, cut into microbatches. Datasets themselves come from ``client.data``."""

from __future__ import annotations

from collections.abc import Sequence


def microbatches(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` sample indices (the last may be shorter): a pipeline pass each."""
    if size < 1:
        raise ValueError("microbatch size must be at least 1")
    items = list(indices)
    return [items[i : i + size] for i in range(0, len(items), size)]
