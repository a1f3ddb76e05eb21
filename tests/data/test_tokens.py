"""Token files read through memory maps: the same windows as the byte corpus mapping, and nothing that differs
from its sidecar (a flipped byte, a truncated file, a lying count or vocabulary) is ever read as data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from client.data import ByteDataset, DatasetError, TokenDataset, open_dataset
from client.data.sidecar import SIDECAR_NAME
from tests.data.conftest import write_token_dir

SEQ = 16


def test_round_trip_samples_are_the_windows_of_the_concatenated_files(token_dir: Path, corpus: np.ndarray) -> None:
    dataset = open_dataset(str(token_dir), SEQ)
    assert isinstance(dataset, TokenDataset) and len(list(token_dir.glob("*.tokens"))) == 4
    assert dataset.num_samples == (len(corpus) - 1) // SEQ and dataset.vocab_size == 1000
    for index in (0, 1, 187, 188, 624, 10**9):
        start = dataset.window(index) * SEQ
        expected = torch.from_numpy(corpus[start : start + SEQ + 1].astype(np.int64))
        assert torch.equal(dataset.sample(index), expected)
    starts = [dataset.window(i) * SEQ for i in range(dataset.num_samples)]
    assert any(s // 3000 != (s + SEQ) // 3000 for s in starts)  # some windows span two files, and read right
    batch = dataset.batch([3, 4, 5])
    assert batch.dtype == torch.int64 and batch.shape == (3, SEQ + 1)


def test_mapping_is_the_byte_datasets_and_the_same_across_opens(tmp_path: Path, token_dir: Path) -> None:
    text = bytes(range(256)) * 40
    write_token_dir(tmp_path / "bytes", np.frombuffer(text, dtype=np.uint8), shard_tokens=1000, vocab_size=256,
                    tokenizer_sha256="0" * 64, name="bytes")
    as_tokens, as_bytes = open_dataset(str(tmp_path / "bytes"), SEQ), ByteDataset(text, SEQ, name="same")
    indices = list(range(0, 600, 7))
    assert torch.equal(as_tokens.batch(indices), as_bytes.batch(indices))
    first, second = open_dataset(str(token_dir), SEQ), open_dataset(str(token_dir), SEQ)
    assert first.fingerprint == second.fingerprint
    assert torch.equal(first.batch(list(range(100))), second.batch(list(range(100))))
    assert isinstance(first._map(0), np.memmap)  # noqa: SLF001 - files stay on disk


def test_sharding_does_not_change_the_data(tmp_path: Path, corpus: np.ndarray) -> None:
    write_token_dir(tmp_path / "one", corpus, shard_tokens=len(corpus))
    write_token_dir(tmp_path / "many", corpus, shard_tokens=999)
    one, many = open_dataset(str(tmp_path / "one"), SEQ), open_dataset(str(tmp_path / "many"), SEQ)
    assert torch.equal(one.batch(list(range(0, 600, 3))), many.batch(list(range(0, 600, 3))))


def test_uint32_files(tmp_path: Path) -> None:
    ids = np.arange(70_000, 70_000 + 500, dtype=np.uint32)
    write_token_dir(tmp_path / "wide", ids, shard_tokens=200, dtype="uint32", vocab_size=100_000)
    dataset = open_dataset(str(tmp_path / "wide"), 10)
    assert int(dataset.batch(list(range(dataset.num_samples))).min()) >= 70_000


def _sidecar(directory: Path) -> dict:
    return json.loads((directory / SIDECAR_NAME).read_text())


def _rewrite(directory: Path, doc: dict) -> None:
    (directory / SIDECAR_NAME).write_text(json.dumps(doc))


def test_flipped_byte_is_refused(token_dir: Path) -> None:
    path = token_dir / "00001.tokens"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"00001.tokens has sha256 .* \(corrupted or replaced\)"):
        open_dataset(str(token_dir), SEQ)


def test_truncated_file_is_refused(token_dir: Path) -> None:
    path = token_dir / "00003.tokens"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(DatasetError, match="00003.tokens is 2012 bytes, but dataset.json says 1007 tokens"):
        open_dataset(str(token_dir), SEQ)


def test_missing_file_is_refused(token_dir: Path) -> None:
    (token_dir / "00002.tokens").unlink()
    with pytest.raises(DatasetError, match="token file 00002.tokens is missing"):
        open_dataset(str(token_dir), SEQ)


def test_sidecar_lying_about_counts_is_refused(token_dir: Path) -> None:
    doc = _sidecar(token_dir)
    doc["files"][0]["tokens"] += 1  # would read past the end of the file
    _rewrite(token_dir, doc)
    with pytest.raises(DatasetError, match="00000.tokens is 6000 bytes, but dataset.json says 3001 tokens"):
        open_dataset(str(token_dir), SEQ)


def test_sidecar_lying_about_the_vocabulary_is_refused(token_dir: Path, corpus: np.ndarray) -> None:
    doc = _sidecar(token_dir)
    doc["vocab_size"] = int(corpus.max())  # one below the largest id in the files
    _rewrite(token_dir, doc)
    with pytest.raises(DatasetError, match=f"holds id {int(corpus.max())}, outside the vocabulary"):
        open_dataset(str(token_dir), SEQ)


def test_sidecar_pointing_outside_its_directory_is_refused(tmp_path: Path, token_dir: Path) -> None:
    secret = tmp_path / "secret.tokens"
    secret.write_bytes((token_dir / "00000.tokens").read_bytes())
    doc = _sidecar(token_dir)
    doc["files"][0]["path"] = "../secret.tokens"
    _rewrite(token_dir, doc)
    with pytest.raises(DatasetError, match=r"files\[0\].path must be a plain file name"):
        open_dataset(str(token_dir), SEQ)


def test_too_few_tokens_for_a_sample(tmp_path: Path) -> None:
    write_token_dir(tmp_path / "short", np.arange(10, dtype=np.uint16), shard_tokens=10)
    with pytest.raises(ValueError, match="has 10 tokens, fewer than one sample of 17"):
        open_dataset(str(tmp_path / "short"), SEQ)
