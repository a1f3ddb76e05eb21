"""Sample index → window of ``seq_len + 1`` tokens, the one mapping every dataset kind shares.

A corpus of ``N`` tokens holds ``n = (N - 1) // seq_len`` windows (inputs plus next-token targets, each
window overlapping the next by one token). Index ``i`` maps to window ``(i mod n) · stride mod n`` with a
fixed stride coprime with ``n`` near ``n`` times the golden ratio: a bijection that spreads a contiguous index
range (one trainer's share of a round) over the whole corpus instead of one file, computed from ``n`` alone so
that it is the same on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

_GOLDEN = (math.sqrt(5) - 1) / 2


class SampleDataset(Protocol):
    """What a trainer needs of its data (``ByteDataset`` and ``TokenDataset`` both provide it)."""

    name: str
    fingerprint: str
    seq_len: int
    num_samples: int
    vocab_size: int
    tokenizer_sha256: bytes  # all zeros for byte-level

    def sample(self, index: int) -> torch.Tensor: ...

    def batch(self, indices: Sequence[int]) -> torch.Tensor: ...


def spreading_stride(num_samples: int) -> int:
    """The stride of the index → window bijection: odd, coprime with ``num_samples``."""
    stride = int(num_samples * _GOLDEN) | 1
    while math.gcd(stride, num_samples) != 1:
        stride += 1
    return stride


class WindowedDataset:
    """A token sequence of ``num_tokens`` cut into windows addressed by a wrapping sample index.

    Subclasses say where the tokens are (``read``); the mapping from index to tokens lives here only.
    """

    def __init__(self, num_tokens: int, seq_len: int, *, name: str, fingerprint: str, unit: str = "tokens") -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError("seq_len must be positive")
        self.name = name
        self.seq_len = seq_len
        self.fingerprint = fingerprint
        self.num_samples = (num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"corpus {name!r} has {num_tokens} {unit}, fewer than one sample of {seq_len + 1}")
        self._stride = spreading_stride(self.num_samples)

    def read(self, start: int, count: int) -> torch.Tensor:
        """``count`` tokens from position ``start`` of the corpus, as int64."""
        raise NotImplementedError

    def window(self, index: int) -> int:
        """The corpus window behind ``index`` (indices wrap modulo the number of samples)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"sample index must be a non-negative integer, got {index!r}")
        return (index % self.num_samples) * self._stride % self.num_samples

    def sample(self, index: int) -> torch.Tensor:
        """``seq_len + 1`` tokens (int64): inputs are ``[:-1]``, next-token targets ``[1:]``."""
        return self.read(self.window(index) * self.seq_len, self.seq_len + 1)

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Samples stacked into ``[len(indices), seq_len + 1]``."""
        if not indices:
            raise ValueError("a batch needs at least one sample index")
        return torch.stack([self.sample(i) for i in indices])
