"""Text read as byte tokens: the embedded default corpus, or local files and directories.

The default corpus is the Python standard library's own sources, found at run time so that a demo downloads
nothing. Those sources differ between Python versions, hence ``fingerprint``: a run records it and a
machine whose corpus differs can tell before it trains on the wrong bytes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from client.data.windows import WindowedDataset

log = logging.getLogger(__name__)

STDLIB_SOURCE = "stdlib"
# Third-party packages and the standard library's own test suites are left out: the first differ between
# machines even on one Python version, the second are large and repetitive.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


class ByteDataset(WindowedDataset):
    """Fixed-length byte windows of a corpus held in memory, addressed by a wrapping sample index."""

    tokenizer_sha256 = bytes(32)  # byte-level, as runs name it on chain
    vocab_size = 256

    def __init__(self, corpus: bytes, seq_len: int, *, name: str) -> None:
        super().__init__(len(corpus), seq_len, name=name, fingerprint=hashlib.sha256(corpus).hexdigest(),
                         unit="bytes")
        self._tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)

    @property
    def num_bytes(self) -> int:
        return int(self._tokens.numel())

    def read(self, start: int, count: int) -> torch.Tensor:
        return self._tokens[start : start + count].long()


def _read_tree(root: Path, files: Iterable[Path]) -> bytes:
    parts = [file.read_bytes() for file in files]
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


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` sources in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return _walk(root, (".py",))


@functools.lru_cache(maxsize=1)
def stdlib_corpus() -> bytes:
    """The standard library's ``.py`` sources in sorted order (about 12 MB, read in well under a second)."""
    return _read_tree(Path(sysconfig.get_paths()["stdlib"]), stdlib_files())


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


def open_byte_dataset(sources: Sequence[str], seq_len: int) -> ByteDataset:
    """``["stdlib"]`` for the embedded default corpus, else local files or directories read as bytes."""
    if list(sources) == [STDLIB_SOURCE]:
        dataset = ByteDataset(stdlib_corpus(), seq_len, name=STDLIB_SOURCE)
    else:
        dataset = ByteDataset(files_corpus(sources), seq_len, name=",".join(sources))
    log.info("dataset %s: %.1f MB, %d samples of %d tokens, fingerprint %s", dataset.name, dataset.num_bytes / 1e6,
             dataset.num_samples, seq_len + 1, dataset.fingerprint[:16])
    return dataset
