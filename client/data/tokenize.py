"""Text, JSONL or Parquet → token files and their sidecar (what ``psyswarm tokenize`` runs).

Documents are read with ``datasets`` in streaming mode (local files only, nothing cached on disk), a text file
being one document; each is encoded without special tokens and followed by the tokenizer's end-of-sequence
id where it has one. Everything is written into a hidden directory beside ``output`` that becomes ``output``
only once the sidecar is complete, so a failure or an interrupt leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from client.data.corpus import STDLIB_SOURCE, stdlib_files
from client.data.sidecar import DTYPES, SIDECAR_NAME, DatasetError, Sidecar, dtype_holds, smallest_dtype
from client.data.tokenizer import ByteTokenizer, ModelTokenizer
from client.data.tokens import TokenWriter

FORMATS = ("text", "jsonl", "parquet")
_SUFFIXES = {".txt": "text", ".md": "text", ".text": "text", ".py": "text", ".jsonl": "jsonl", ".json": "jsonl",
             ".parquet": "parquet"}
_BUILDERS = {"text": "text", "jsonl": "json", "parquet": "parquet"}
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB of uint16 per file
_BATCH_DOCUMENTS = 256


@dataclasses.dataclass(frozen=True)
class TokenizeSummary:
    documents: int
    tokens: int
    files: int
    seconds: float
    sidecar: Sidecar

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def input_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The files named, with directories expanded to their regular files in sorted order and ``stdlib`` to the
    embedded corpus's sources (one document each)."""
    if not inputs:
        raise DatasetError("no input files given")
    found: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if str(raw) == STDLIB_SOURCE:
            found += stdlib_files()
        elif path.is_dir():
            inside = sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not inside:
                raise DatasetError(f"input directory {path} holds no files")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise DatasetError(f"input {path} does not exist")
    return found


def infer_format(files: Sequence[Path]) -> str:
    """The one format the files' suffixes name (``.txt``/``.md``/``.py`` text, ``.jsonl``/``.json``, ``.parquet``)."""
    formats = {_SUFFIXES.get(p.suffix.lower()) for p in files}
    if None in formats:
        unknown = next(p for p in files if p.suffix.lower() not in _SUFFIXES)
        raise DatasetError(f"cannot tell the format of {unknown} from its suffix: give --format text|jsonl|parquet")
    if len(formats) > 1:
        raise DatasetError(f"inputs mix formats ({', '.join(sorted(f for f in formats if f))}): tokenize them "
                           "separately or give --format")
    return formats.pop()  # type: ignore[return-value]


def count_documents(files: Sequence[Path], fmt: str) -> int:
    """How many documents the inputs hold, for the progress bar (cheap: file count, line count, metadata)."""
    if fmt == "text":
        return len(files)
    if fmt == "jsonl":
        total = 0
        for path in files:
            with path.open("rb") as handle:
                total += sum(1 for line in handle if line.strip())
        return total
    import pyarrow.parquet as pq

    try:
        return sum(pq.ParquetFile(path).metadata.num_rows for path in files)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read parquet metadata: {str(exc).splitlines()[0][:200]}") from None


def documents(files: Sequence[Path], fmt: str, text_field: str) -> Iterator[str]:
    """Each document's text, in input order; ``DatasetError`` for a malformed file or a missing field."""
    import datasets

    datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its errors reach the user once, as ours
    datasets.disable_progress_bars()
    options = {"sample_by": "document"} if fmt == "text" else {}
    field = "text" if fmt == "text" else text_field
    stream = datasets.load_dataset(_BUILDERS[fmt], data_files=[str(p) for p in files], split="train",
                                   streaming=True, **options)
    rows = iter(stream)
    number = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (OSError, ValueError) as exc:  # pyarrow's parse errors are ValueErrors
            raise DatasetError(f"cannot read the {fmt} inputs after {number} documents: "
                               f"{str(exc).splitlines()[0][:200]}") from None
        value = row.get(field)
        if not isinstance(value, str):
            fields = ", ".join(list(row)[:8]) or "none"
            problem = "has no field" if field not in row else "has a non-text value in field"
            raise DatasetError(f"document {number} {problem} {field!r} (its fields: {fields}); choose --text-field")
        number += 1
        yield value


def _batches(texts: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _concatenated(ids: list[np.ndarray], eos_id: int | None) -> np.ndarray:
    if eos_id is not None:
        eos = np.array([eos_id], dtype=np.uint32)
        ids = [piece for doc in ids for piece in (doc.astype(np.uint32, copy=False), eos)]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)


def _check_output(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DatasetError(f"output {output} already exists and is not an empty directory")


def choose_dtype(requested: str, vocab_size: int) -> str:
    """``auto``: the smallest that holds every id; an explicit dtype too small for the vocabulary is refused."""
    if requested == "auto":
        return smallest_dtype(vocab_size)
    if requested not in DTYPES:
        raise DatasetError(f"dtype must be auto, {', '.join(DTYPES)}; got {requested!r}")
    if not dtype_holds(requested, vocab_size):
        raise DatasetError(f"{requested} cannot hold the ids of a vocabulary of {vocab_size}: use uint32")
    return requested


@contextlib.contextmanager
def _staging(output: Path) -> Iterator[Path]:
    """A hidden directory beside ``output`` that replaces it on success and disappears on failure."""
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
        if output.exists():
            output.rmdir()  # empty, as _check_output found it
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


Progress = Callable[[int, int], None]  # (documents done, tokens so far)


def tokenize_files(inputs: Sequence[str | Path], tokenizer: ByteTokenizer | ModelTokenizer, output: Path, *,
                   fmt: str | None = None, text_field: str = "text", dtype: str = "auto",
                   shard_tokens: int = DEFAULT_SHARD_TOKENS, on_progress: Progress | None = None,
                   total_hint: Callable[[int], None] | None = None) -> TokenizeSummary:
    """Tokenize ``inputs`` into ``output`` (created; it must not hold anything yet)."""
    output = Path(output).expanduser()
    files = input_files(inputs)
    fmt = fmt or infer_format(files)
    if fmt not in FORMATS:
        raise DatasetError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    if shard_tokens < 1:
        raise DatasetError("--shard-tokens must be at least 1")
    chosen = choose_dtype(dtype, tokenizer.vocab_size)
    _check_output(output)
    if total_hint is not None:
        total_hint(count_documents(files, fmt))
    started = time.perf_counter()
    done = 0
    with _staging(output) as staging:
        writer = TokenWriter(staging, DTYPES[chosen], shard_tokens)
        try:
            for batch in _batches(documents(files, fmt, text_field), _BATCH_DOCUMENTS):
                writer.add(_concatenated(tokenizer.encode_batch(batch), tokenizer.eos_id))
                done += len(batch)
                if on_progress is not None:
                    on_progress(done, writer.num_tokens)
        finally:
            token_files = tuple(writer.close())
        if sum(f.tokens for f in token_files) < 2:
            raise DatasetError(f"the inputs hold {writer.num_tokens} tokens: a dataset needs at least two")
        sidecar = Sidecar(chosen, tokenizer.name, tokenizer.sha256.hex(), tokenizer.vocab_size, token_files)
        (staging / SIDECAR_NAME).write_bytes(sidecar.render())
    return TokenizeSummary(done, sidecar.num_tokens, len(token_files), time.perf_counter() - started, sidecar)
