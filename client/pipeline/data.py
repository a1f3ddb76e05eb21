"""Training data as byte tokens, addressed by sample index the same way on every machine.

The coordinator assigns data as lists of index ranges, so a sample index must mean the same token sequence
everywhere. A dataset is one byte string (the corpus) cut into windows of ``seq_len + 1`` bytes (inputs plus
the next-byte targets); index ``i`` maps to window ``(i mod n) · stride mod n`` with a fixed stride coprime
with ``n``, a bijection that spreads a contiguous index range over the whole corpus instead of one file.

The default corpus is the Python standard library's own sources, found at run time so that a demo downloads
nothing. Those sources differ between Python versions, hence ``fingerprint``: a run records it and a
machine whose corpus differs can tell before it trains on the wrong bytes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STDLIB_SOURCE = "stdlib"
# Third-party packages and the standard library's own test suites are left out: the first differ between
# machines even on one Python version, the second are large and repetitive.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_GOLDEN = (math.sqrt(5) - 1) / 2


class ByteDataset:
    """Fixed-length byte windows of a corpus, addressed by a wrapping sample index."""

    def __init__(self, corpus: bytes, seq_len: int, *, name: str) -> None:
        if seq_len <= 0:
            raise ValueError("seq_len must be positive")
        self.name = name
        self.seq_len = seq_len
        self.num_samples = (len(corpus) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(f"corpus {name!r} has {len(corpus)} bytes, fewer than one sample of {seq_len + 1}")
        self.fingerprint = hashlib.sha256(corpus).hexdigest()
        self._tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        stride = int(self.num_samples * _GOLDEN) | 1
        while math.gcd(stride, self.num_samples) != 1:
            stride += 1
        self._stride = stride

    @property
    def num_bytes(self) -> int:
        return int(self._tokens.numel())

    def window(self, index: int) -> int:
        """The corpus window behind ``index`` (indices wrap modulo the number of samples)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"sample index must be a non-negative integer, got {index!r}")
        return (index % self.num_samples) * self._stride % self.num_samples

    def sample(self, index: int) -> torch.Tensor:
        """``seq_len + 1`` byte tokens (int64): inputs are ``[:-1]``, next-byte targets ``[1:]``."""
        start = self.window(index) * self.seq_len
        return self._tokens[start : start + self.seq_len + 1].long()

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        """Samples stacked into ``[len(indices), seq_len + 1]``."""
        if not indices:
            raise ValueError("a batch needs at least one sample index")
        return torch.stack([self.sample(i) for i in indices])


def microbatches(indices: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` sample indices (the last may be shorter): a pipeline pass each."""
    if size < 1:
        raise ValueError("microbatch size must be at least 1")
    items = list(indices)
    return [items[i : i + size] for i in range(0, len(items), size)]


def _read_tree(root: Path, files: Iterable[Path]) -> bytes:
    parts = []
    for file in files:
        parts.append(file.read_bytes())
    log.debug("read %d files under %s", len(parts), root)
    return b"\n".join(parts)


def _walk(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """Regular files under ``root`` in a machine-independent order (sorted relative paths)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("."))
        for name in filenames:
            if suffixes is None or name.endswith(suffixes):
                found.append(Path(dirpath, name))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> bytes:
    """The standard library's ``.py`` sources in sorted order (about 12 MB, read in well under a second)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _read_tree(root, _walk(root, (".py",)))


def files_corpus(paths: Sequence[str | os.PathLike[str]]) -> bytes:
    """Local files, or every file under local directories, in the order given then by sorted path."""
    if not paths:
        raise ValueError("no data paths given")
    chunks = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            chunks.append(path.read_bytes())
        elif path.is_dir():
            files = _walk(path, None)
            if not files:
                raise ValueError(f"data directory {path} holds no files")
            chunks.append(_read_tree(path, files))
        else:
            raise ValueError(f"data path {path} does not exist")
    return b"\n".join(chunks)


def open_dataset(sources: Sequence[str], seq_len: int) -> ByteDataset:
    """``["stdlib"]`` for the embedded default corpus, else local files or directories."""
    if list(sources) == [STDLIB_SOURCE]:
        dataset = ByteDataset(stdlib_corpus(), seq_len, name=STDLIB_SOURCE)
    else:
        dataset = ByteDataset(files_corpus(sources), seq_len, name=",".join(sources))
    log.info(
        "dataset %s: %.1f MB, %d samples of %d tokens, fingerprint %s",
        dataset.name,
        dataset.num_bytes / 1e6,
        dataset.num_samples,
        seq_len + 1,
        dataset.fingerprint[:16],
    )
    return dataset
