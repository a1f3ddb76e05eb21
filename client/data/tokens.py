"""Token files on disk: a dataset read through memory maps, each file checked against its sidecar first, and
the writer that produces them.

Opening checks every file's size and sha256 and that no id lies outside the vocabulary, in one streaming pass
(bound by sha256: 0.3-2 GB/s per core, files checked in parallel), so a truncated download, a flipped byte or
a lying sidecar is refused before a trainer sends a single sample to the workers. Reading a sample then touches
only its pages.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from client.data.sidecar import MAX_SIDECAR_BYTES, SIDECAR_NAME, DatasetError, Sidecar, TokenFile, parse_sidecar
from client.data.windows import WindowedDataset

_CHUNK_BYTES = 16 * 1024 * 1024
_OPEN_MAPS = 64  # memory maps kept open at once (each holds a file descriptor)


def verify_token_file(path: Path, sidecar: Sidecar, entry: TokenFile) -> None:
    """Refuse a file whose size, digest or ids differ from what the sidecar says of it."""
    expected = sidecar.file_bytes(entry)
    try:
        size = path.stat().st_size
    except OSError:
        raise DatasetError(f"token file {entry.path} is missing (looked at {path})") from None
    if size != expected:
        raise DatasetError(f"token file {entry.path} is {size} bytes, but {SIDECAR_NAME} says {entry.tokens} tokens "
                           f"of {sidecar.dtype} ({expected} bytes)")
    digest, highest = hashlib.sha256(), 0
    itemsize = sidecar.numpy_dtype.itemsize
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES - _CHUNK_BYTES % itemsize):
            digest.update(chunk)
            highest = max(highest, int(np.frombuffer(chunk, dtype=sidecar.numpy_dtype).max()))
    if digest.hexdigest() != entry.sha256:
        raise DatasetError(f"token file {entry.path} has sha256 {digest.hexdigest()[:16]}..., but {SIDECAR_NAME} "
                           f"says {entry.sha256[:16]}... (corrupted or replaced)")
    if highest >= sidecar.vocab_size:
        raise DatasetError(f"token file {entry.path} holds id {highest}, outside the vocabulary of "
                           f"{sidecar.vocab_size} that {SIDECAR_NAME} states")


def verify_token_files(paths: Sequence[Path], sidecar: Sidecar) -> None:
    """Every file checked, several at once (hashlib releases the GIL: sha256 runs at a few hundred MB/s a core)."""
    workers = min(len(paths), os.cpu_count() or 1, 8)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for done in [pool.submit(verify_token_file, p, sidecar, e) for p, e in zip(paths, sidecar.files, strict=True)]:
            done.result()  # the first file that fails, in sidecar order


def read_sidecar_bytes(directory: Path) -> bytes:
    """A local ``dataset.json`` as it is on disk (what a run pins by digest), read up to one byte over the cap."""
    path = directory / SIDECAR_NAME
    try:
        with path.open("rb") as handle:
            return handle.read(MAX_SIDECAR_BYTES + 1)  # one byte over: parse_sidecar names the oversize
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_sidecar(directory: Path) -> Sidecar:
    return parse_sidecar(read_sidecar_bytes(directory))


class TokenDataset(WindowedDataset):
    """The concatenation of a sidecar's token files, cut into sample windows; files stay on disk."""

    def __init__(self, sidecar: Sidecar, paths: Sequence[Path], seq_len: int, *, name: str,
                 verified: bool = False) -> None:
        """``verified``: the caller has just run ``verify_token_file`` on every path (a download cache does)."""
        if len(paths) != len(sidecar.files):
            raise ValueError("one path per token file of the sidecar")
        super().__init__(sidecar.num_tokens, seq_len, name=name, fingerprint=sidecar.fingerprint())
        if not verified:
            verify_token_files(paths, sidecar)
        self.sidecar = sidecar
        self._paths = list(paths)
        self._starts = np.cumsum([0] + [f.tokens for f in sidecar.files]).tolist()
        self._maps: collections.OrderedDict[int, np.memmap] = collections.OrderedDict()

    @classmethod
    def from_directory(cls, directory: Path, seq_len: int, *, name: str | None = None) -> TokenDataset:
        sidecar = read_sidecar(directory)
        return cls(sidecar, [directory / f.path for f in sidecar.files], seq_len, name=name or str(directory))

    @property
    def num_tokens(self) -> int:
        return self._starts[-1]

    @property
    def vocab_size(self) -> int:
        return self.sidecar.vocab_size

    @property
    def tokenizer_sha256(self) -> bytes:
        return bytes.fromhex(self.sidecar.tokenizer_sha256)

    def _map(self, file: int) -> np.memmap:
        if file in self._maps:
            self._maps.move_to_end(file)
        else:
            self._maps[file] = np.memmap(self._paths[file], dtype=self.sidecar.numpy_dtype, mode="r")
            if len(self._maps) > _OPEN_MAPS:
                self._maps.popitem(last=False)
        return self._maps[file]

    def read(self, start: int, count: int) -> torch.Tensor:
        pieces = []
        file = bisect.bisect_right(self._starts, start) - 1
        while count > 0:
            offset = start - self._starts[file]
            piece = self._map(file)[offset : offset + count]
            pieces.append(piece.astype(np.int64))
            start, count, file = start + len(piece), count - len(piece), file + 1
        return torch.from_numpy(np.concatenate(pieces))


class TokenWriter:
    """Token ids appended to ``00000.tokens``, ``00001.tokens``... of at most ``shard_tokens`` each."""

    def __init__(self, directory: Path, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError("shard size must be at least one token")
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.files: list[TokenFile] = []
        self._handle = None
        self._count = 0
        self._digest = hashlib.sha256()

    @property
    def num_tokens(self) -> int:
        return sum(f.tokens for f in self.files) + self._count

    def add(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._handle is None:
                self._handle = (self.directory / f"{len(self.files):05d}.tokens").open("wb")
            room = self.shard_tokens - self._count
            data = ids[:room].tobytes()
            self._handle.write(data)
            self._digest.update(data)
            self._count += len(ids[:room])
            ids = ids[room:]
            if self._count == self.shard_tokens:
                self._finish_file()

    def _finish_file(self) -> None:
        assert self._handle is not None
        self._handle.close()
        self.files.append(TokenFile(Path(self._handle.name).name, self._count, self._digest.hexdigest()))
        self._handle, self._count, self._digest = None, 0, hashlib.sha256()

    def close(self) -> list[TokenFile]:
        if self._handle is not None:
            self._finish_file()
        return self.files
