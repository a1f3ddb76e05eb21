"""Tokenizers: byte-level (the embedded default) or a model's own ``tokenizer.json``, and a small BPE trained
here on the embedded corpus so that an example needs no download.

A run names its tokenizer on chain by the sha256 of the ``tokenizer.json`` bytes (``tokenizer_sha256``; all
zeros for byte-level), and a token dataset's sidecar carries the same digest, so a mismatch between the data
and the model is caught by comparing 32 bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from client.data.corpus import stdlib_files
from client.data.sidecar import BYTES_TOKENIZER_NAME, BYTES_VOCAB, MAX_NAME_CHARS, DatasetError

BYTES_TOKENIZER = BYTES_TOKENIZER_NAME
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
MIN_BPE_VOCAB, MAX_BPE_VOCAB = 512, 1 << 20


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None
    sha256: bytes

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: what psyswarm's own model reads. It has no end-of-document token."""

    name = BYTES_TOKENIZER
    vocab_size = BYTES_VOCAB
    eos_id = None
    sha256 = bytes(32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]


def tokenizer_file(path_or_dir: str | Path) -> Path:
    """``tokenizer.json`` itself, or the one inside a model directory."""
    path = Path(path_or_dir).expanduser()
    found = path / TOKENIZER_FILE if path.is_dir() else path
    if not found.is_file():
        raise DatasetError(f"no {TOKENIZER_FILE} at {found}")
    return found


def tokenizer_sha256(path_or_dir: str | Path) -> bytes:
    """The sha256 of a tokenizer's ``tokenizer.json`` bytes: how a run and a dataset name a tokenizer."""
    return hashlib.sha256(tokenizer_file(path_or_dir).read_bytes()).digest()


def _eos_token(directory: Path) -> str | None:
    """The end-of-sequence token a model directory's ``tokenizer_config.json`` names, if any."""
    try:
        config = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


class ModelTokenizer:
    """A Hugging Face ``tokenizer.json`` (the fast tokenizer every Llama-family repo ships)."""

    def __init__(self, path_or_dir: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        file = tokenizer_file(path_or_dir)
        raw = file.read_bytes()
        try:
            self._tokenizer = HFTokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # tokenizers raises its own Exception type for any malformed file
            raise DatasetError(f"{file} is not a usable tokenizer: {str(exc).splitlines()[0][:200]}") from None
        self.name = (file.parent.name or file.name)[:MAX_NAME_CHARS]
        self.sha256 = hashlib.sha256(raw).digest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        eos = _eos_token(file.parent)
        self.eos_id = self._tokenizer.token_to_id(eos) if eos is not None else None

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]


def load_tokenizer(spec: str | Path) -> ByteTokenizer | ModelTokenizer:
    """``"bytes"`` for byte-level, else a ``tokenizer.json`` or a directory holding one."""
    return ByteTokenizer() if str(spec) == BYTES_TOKENIZER else ModelTokenizer(spec)


def stdlib_texts(max_bytes: int | None = None) -> Iterator[str]:
    """The embedded corpus one source file at a time, up to about ``max_bytes``."""
    seen = 0
    for path in stdlib_files():
        if max_bytes is not None and seen >= max_bytes:
            return
        data = path.read_bytes()
        seen += len(data)
        yield data.decode("utf-8", errors="replace")


def train_bpe(output: Path, vocab_size: int, texts: Iterable[str]) -> Path:
    """Train a byte-level BPE with ``<s>``/``</s>`` and write ``tokenizer.json`` + ``tokenizer_config.json``
    (loadable by ``transformers.AutoTokenizer``) into ``output``; returns the ``tokenizer.json`` path."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
        raise DatasetError(f"BPE vocabulary size must be in {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB}, got {vocab_size}")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TOKEN, EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    (output / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return output / TOKENIZER_FILE
