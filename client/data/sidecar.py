"""``dataset.json``: the sidecar that describes a directory of token files, validated field by field.

A token dataset is one or more flat little-endian arrays of ``uint16`` or ``uint32`` token ids (``*.tokens``),
read as their concatenation in the order the sidecar lists them. The sidecar names the dtype, the tokenizer
(name and the sha256 of its ``tokenizer.json``; all zeros for the byte-level tokenizer), the vocabulary size,
and every file's token count and sha256. It travels with the files and may come from anyone, so it is parsed
strictly: unknown or missing keys, duplicate keys, wrong types, a path that could leave the directory, a count
too large for the format, each gets a one-line ``DatasetError`` naming the field.

Its canonical form (sorted keys, no spaces) is hashed into the dataset's ``fingerprint``: two machines that
agree on it train on the same tokens, since every file's digest is in it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

import numpy as np

FORMAT = "psyswarm-tokens"
VERSION = 1
SIDECAR_NAME = "dataset.json"
MAX_SIDECAR_BYTES = 1 << 20  # what is read of a dataset.json, from anywhere, before it is parsed
MAX_FILES = 4096
MAX_FILE_TOKENS = 1 << 40
MAX_NAME_CHARS = 128
BYTES_TOKENIZER_NAME = "bytes"
BYTES_VOCAB = 256
ZERO_DIGEST = "0" * 64
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEYS = frozenset({"format", "version", "dtype", "tokenizer", "vocab_size", "files"})
_TOKENIZER_KEYS = frozenset({"name", "sha256"})
_FILE_KEYS = frozenset({"path", "tokens", "sha256"})


class DatasetError(ValueError):
    """A dataset that cannot be used as described: the message names the file or field and the problem."""


class DatasetUnreachable(DatasetError):
    """A remote dataset this machine cannot fetch now (offline, server down): perhaps not the dataset's fault."""


class DatasetMissing(DatasetError):
    """A remote dataset whose host answers that it does not exist (or that this machine may not see it): unlike
    an unreachable one, waiting will not help."""


class TokenizerMismatch(DatasetError):
    """Data tokenized with another tokenizer than the model's: the run's description is wrong, not this machine."""


@dataclasses.dataclass(frozen=True)
class TokenFile:
    path: str  # a plain file name inside the dataset's directory
    tokens: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Sidecar:
    dtype: str
    tokenizer_name: str
    tokenizer_sha256: str  # hex; ZERO_DIGEST for the byte-level tokenizer
    vocab_size: int
    files: tuple[TokenFile, ...]

    @property
    def numpy_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def num_tokens(self) -> int:
        return sum(f.tokens for f in self.files)

    def file_bytes(self, file: TokenFile) -> int:
        return file.tokens * self.numpy_dtype.itemsize

    @property
    def total_bytes(self) -> int:
        """What its token files take, on disk and to download: what a client bounds before it fetches any."""
        return self.num_tokens * self.numpy_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "dtype": self.dtype,
                "tokenizer": {"name": self.tokenizer_name, "sha256": self.tokenizer_sha256},
                "vocab_size": self.vocab_size,
                "files": [{"path": f.path, "tokens": f.tokens, "sha256": f.sha256} for f in self.files]}

    def render(self) -> bytes:
        """The file as written: indented for people; ``canonical`` is what is hashed."""
        return (json.dumps(self.to_dict(), indent=1) + "\n").encode()

    def canonical(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()


def smallest_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits in it, else ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def dtype_holds(dtype: str, vocab_size: int) -> bool:
    return vocab_size <= 1 << (8 * DTYPES[dtype].itemsize)


def _fail(field: str, problem: str) -> DatasetError:
    return DatasetError(f"{SIDECAR_NAME}: {field} {problem}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise _fail(f"key {key[:40]!r}", "appears more than once")
    return dict(pairs)


def _refuse_constant(name: str) -> None:
    raise _fail("value", f"{name} is not JSON")


def _object(value: Any, field: str, keys: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(field, "must be an object")
    missing, unknown = sorted(keys - value.keys()), sorted(value.keys() - keys)
    if missing:
        raise _fail(field, f"lacks {', '.join(missing)}")
    if unknown:
        raise _fail(field, f"has unknown key {unknown[0][:40]!r}")
    return value


def _integer(value: Any, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, "must be an integer")
    if not low <= value <= high:
        raise _fail(field, f"must be in {low}..{high}, got {value}")
    return value


def _digest(value: Any, field: str) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise _fail(field, "must be 64 lowercase hex digits")
    return value


def _name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS or not value.isprintable():
        raise _fail(field, f"must be 1..{MAX_NAME_CHARS} printable characters")
    return value


def _file(value: Any, field: str) -> TokenFile:
    entry = _object(value, field, _FILE_KEYS)
    path = entry["path"]
    if not isinstance(path, str) or not _FILE_NAME.fullmatch(path):
        raise _fail(f"{field}.path", "must be a plain file name (letters, digits, '.', '_', '-'; no directories)")
    return TokenFile(path, _integer(entry["tokens"], f"{field}.tokens", 1, MAX_FILE_TOKENS),
                     _digest(entry["sha256"], f"{field}.sha256"))


def parse_sidecar(raw: bytes) -> Sidecar:
    """The sidecar's description, or ``DatasetError`` naming the first thing wrong with it."""
    if len(raw) > MAX_SIDECAR_BYTES:
        raise _fail("file", f"is {len(raw)} bytes, more than {MAX_SIDECAR_BYTES}")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise _fail("file", "is not UTF-8") from None
    except RecursionError:
        raise _fail("file", "is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise _fail("file", f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    doc = _object(doc, "top level", _KEYS)
    if doc["format"] != FORMAT:
        raise _fail("format", f"must be {FORMAT!r}")
    _integer(doc["version"], "version", VERSION, VERSION)
    dtype = doc["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail("dtype", f"must be one of {', '.join(DTYPES)}")
    tokenizer = _object(doc["tokenizer"], "tokenizer", _TOKENIZER_KEYS)
    tokenizer_name = _name(tokenizer["name"], "tokenizer.name")
    tokenizer_digest = _digest(tokenizer["sha256"], "tokenizer.sha256")
    vocab_size = _integer(doc["vocab_size"], "vocab_size", 1, 1 << (8 * DTYPES[dtype].itemsize))
    if tokenizer_digest == ZERO_DIGEST and vocab_size != BYTES_VOCAB:
        raise _fail("vocab_size", f"must be {BYTES_VOCAB} for the byte-level tokenizer")
    files = doc["files"]
    if not isinstance(files, list) or not 0 < len(files) <= MAX_FILES:
        raise _fail("files", f"must be a list of 1..{MAX_FILES} entries")
    entries = tuple(_file(entry, f"files[{i}]") for i, entry in enumerate(files))
    names = [f.path for f in entries]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _fail(f"files[{i}].path", f"{name!r} is listed twice")
    sidecar = Sidecar(dtype, tokenizer_name, tokenizer_digest, vocab_size, entries)
    if sidecar.num_tokens < 2:
        raise _fail("files", "must hold at least two tokens in all")
    return sidecar
