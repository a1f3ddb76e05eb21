"""Training data for the pipeline: datasets come from ``client.data`` (sample index → tokens, the same on every
machine); this module cuts a trainer's share into microbatches and keeps the names the pipeline has always used.
"""

from __future__ import annotations

from collections.abc import Sequence

from client.data import STDLIB_SOURCE, ByteDataset, files_corpus, stdlib_corpus
from client.data import open_byte_dataset as open_dataset  # ``["stdlib"]`` or local text, as bytes

__all__ = ["STDLIB_SOURCE", "ByteDataset", "files_corpus", "microbatches", "open_dataset", "stdlib_corpus"]


def microbatches(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` sample indices (the last may be shorter): a pipeline pass each."""
    if size < 1:
        raise ValueError("microbatch size must be at least 1")
    items = list(indices)
    return [items[i : i + size] for i in range(0, len(items), size)]
