"""Sample indices mean the same bytes everywhere; corpora are fingerprinted; bad input is refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from client.data import ByteDataset, files_corpus, open_byte_dataset, stdlib_corpus
from client.pipeline.data import microbatches


def test_stdlib_dataset_is_deterministic_and_wraps(dataset: ByteDataset) -> None:
    rebuilt = ByteDataset(stdlib_corpus(), dataset.seq_len, name="again")
    assert rebuilt.fingerprint == dataset.fingerprint == hashlib.sha256(stdlib_corpus()).hexdigest()
    assert dataset.num_bytes > 1_000_000  # the standard library's sources were found
    sample = dataset.sample(12345)
    assert sample.dtype == torch.int64 and sample.shape == (dataset.seq_len + 1,)
    assert torch.equal(sample, rebuilt.sample(12345))
    assert torch.equal(dataset.sample(5), dataset.sample(5 + dataset.num_samples))
    assert not torch.equal(dataset.sample(5), dataset.sample(6))


def test_index_mapping_is_a_bijection_over_windows() -> None:
    dataset = ByteDataset(bytes(range(256)) * 4, 10, name="small")
    windows = [dataset.window(i) for i in range(dataset.num_samples)]
    assert sorted(windows) == list(range(dataset.num_samples))
    assert windows[:2] != [0, 1]  # consecutive indices are spread over the corpus


def test_sample_is_the_window_bytes() -> None:
    corpus = bytes(range(100))
    dataset = ByteDataset(corpus, 9, name="small")
    start = dataset.window(3) * 9
    assert dataset.sample(3).tolist() == list(corpus[start : start + 10])


@pytest.mark.parametrize("index", [-1, 1.5, "3", True])
def test_bad_sample_index_is_refused(dataset: ByteDataset, index: object) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        dataset.sample(index)  # type: ignore[arg-type]


def test_files_source_and_its_errors(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"second file " * 20)
    (tmp_path / "one.txt").write_bytes(b"first file " * 20)
    dataset = open_byte_dataset([str(tmp_path)], 16)
    assert dataset.fingerprint == hashlib.sha256(files_corpus([tmp_path])).hexdigest()
    assert files_corpus([tmp_path]).startswith(b"second file")  # sorted relative paths: b/two.txt < one.txt
    with pytest.raises(ValueError, match="does not exist"):
        files_corpus([tmp_path / "missing"])
    with pytest.raises(ValueError, match="fewer than one sample"):
        ByteDataset(b"tiny", 16, name="tiny")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        files_corpus([tmp_path / "empty"])


def test_microbatches() -> None:
    assert microbatches(range(5), 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        microbatches([1], 0)
    with pytest.raises(ValueError, match="at least one"):
        ByteDataset(bytes(100), 4, name="x").batch([])
