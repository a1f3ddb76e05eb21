"""``psyswarm tokenize``: text, JSONL and Parquet become token files that decode back to the documents, each
followed by the tokenizer's EOS; bad input gets one line, no traceback, and leaves nothing behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from client.cli import app
from client.data import DatasetError, TokenDataset, load_tokenizer, tokenizer_sha256
from client.data.tokenize import choose_dtype
from client.data.tokenizer import EOS_TOKEN, stdlib_texts, train_bpe

DOCS = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n", "class A:\n    pass\n"]
SUMMARY = re.compile(r"^([\d,]+) tokens from (\d+) documents in (\d+) (uint16|uint32) files at [\d,]+ tokens/s -> ")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    train_bpe(directory, 600, stdlib_texts(300_000))
    return directory


def tokenize(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["tokenize", *args])
    return result.exit_code, result.output


def read_ids(directory: Path) -> np.ndarray:
    dataset = TokenDataset.from_directory(directory, 1)
    return dataset.read(0, dataset.num_tokens).numpy()


def expected_ids(tokenizer_dir: Path, docs: list[str]) -> np.ndarray:
    tokenizer = load_tokenizer(tokenizer_dir)
    eos = tokenizer.token_id(EOS_TOKEN)
    assert eos is not None and eos == tokenizer.eos_id
    return np.concatenate([np.append(ids, eos) for ids in tokenizer.encode_batch(docs)])


def test_text_files_are_one_document_each(tmp_path: Path, bpe: Path) -> None:
    for i, doc in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(doc)
    code, output = tokenize(*(str(tmp_path / f"{i}.txt") for i in range(3)), "--tokenizer", str(bpe),
                            "--output", str(tmp_path / "out"))
    assert code == 0, output
    summary = SUMMARY.search(output.splitlines()[-1])
    assert summary and summary.group(2) == "3" and summary.group(3) == "1" and summary.group(4) == "uint16"
    ids = read_ids(tmp_path / "out")
    assert int(summary.group(1).replace(",", "")) == len(ids)
    np.testing.assert_array_equal(ids, expected_ids(bpe, DOCS))
    sidecar = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert sidecar["tokenizer"]["sha256"] == tokenizer_sha256(bpe).hex() and sidecar["vocab_size"] == 600


def test_jsonl_with_a_text_field_and_shards(tmp_path: Path, bpe: Path) -> None:
    lines = [json.dumps({"id": i, "body": doc}) for i, doc in enumerate(DOCS)]
    (tmp_path / "in" / ".cache").mkdir(parents=True)  # what `hf download --local-dir` leaves: not an input
    (tmp_path / "in" / ".cache" / "x.jsonl").write_text('{"body": "not mine"}\n')
    (tmp_path / "in" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    code, output = tokenize(str(tmp_path / "in"), "--tokenizer", str(bpe), "--output", str(tmp_path / "out"),
                            "--text-field", "body", "--shard-tokens", "7", "--dtype", "uint32")
    assert code == 0, output
    ids = read_ids(tmp_path / "out")
    np.testing.assert_array_equal(ids, expected_ids(bpe, DOCS))
    files = sorted((tmp_path / "out").glob("*.tokens"))
    assert len(files) == -(-len(ids) // 7) and all(f.stat().st_size <= 28 for f in files)


def test_parquet_with_the_byte_tokenizer(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": DOCS, "n": [1, 2, 3]}), tmp_path / "docs.parquet")
    code, output = tokenize(str(tmp_path / "docs.parquet"), "--output", str(tmp_path / "out"))
    assert code == 0, output
    # byte-level: no EOS between documents
    assert read_ids(tmp_path / "out").astype(np.uint8).tobytes() == "".join(DOCS).encode()
    assert json.loads((tmp_path / "out" / "dataset.json").read_text())["tokenizer"]["sha256"] == "0" * 64


def _refused(tmp_path: Path, message: str, *args: str) -> None:
    code, output = tokenize(*args)
    assert code == 1
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], output
    assert "Traceback" not in output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]


def test_bad_inputs_get_one_line_and_leave_nothing(tmp_path: Path, bpe: Path) -> None:
    out = str(tmp_path / "out")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    _refused(tmp_path, "cannot read the jsonl inputs", str(tmp_path / "bad.jsonl"), "--output", out)
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    _refused(tmp_path, "document 0 has no field 'text' (its fields: body); choose --text-field",
             str(tmp_path / "nofield.jsonl"), "--output", out)
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    _refused(tmp_path, "has a non-text value in field 'text'", str(tmp_path / "num.jsonl"), "--output", out)
    (tmp_path / "data.csv").write_text("a,b\n")
    _refused(tmp_path, "cannot tell the format of", str(tmp_path / "data.csv"), "--output", out)
    _refused(tmp_path, "does not exist", str(tmp_path / "missing.txt"), "--output", out)
    _refused(tmp_path, "no tokenizer.json at", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tmp_path),
             "--output", out)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "tokenizer.json").write_text("{not a tokenizer")
    _refused(tmp_path, "is not a usable tokenizer", str(tmp_path / "bad.jsonl"), "--tokenizer",
             str(tmp_path / "junk"), "--output", out)
    (tmp_path / "empty.txt").write_text("")
    _refused(tmp_path, "a dataset needs at least two", str(tmp_path / "empty.txt"), "--output", out)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, output = tokenize(str(tmp_path / "nofield.jsonl"), "--output", out)
    assert code == 1 and "already exists and is not an empty directory" in output
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_dtype_choice() -> None:
    assert choose_dtype("auto", 65_536) == "uint16" and choose_dtype("auto", 65_537) == "uint32"
    with pytest.raises(DatasetError, match="uint16 cannot hold the ids of a vocabulary of 128256"):
        choose_dtype("uint16", 128_256)
    with pytest.raises(DatasetError, match="dtype must be auto"):
        choose_dtype("int8", 10)


def test_train_tokenizer_command(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train-tokenizer", "--output", str(tmp_path / "tok"), "--vocab", "520",
                                      "--max-bytes", "100000"])
    assert result.exit_code == 0, result.output
    assert tokenizer_sha256(tmp_path / "tok").hex() in result.output
    assert load_tokenizer(tmp_path / "tok").vocab_size == 520
    refused = CliRunner().invoke(app, ["train-tokenizer", "--output", str(tmp_path / "t2"), "--vocab", "10"])
    assert refused.exit_code == 1 and "BPE vocabulary size must be in 512.." in refused.output


def test_the_cli_default_shard_size_is_the_librarys() -> None:
    from client.commands import data as command
    from client.data import tokenize as library

    assert command.DEFAULT_SHARD_TOKENS == library.DEFAULT_SHARD_TOKENS


def test_interrupted_tokenization_leaves_nothing(tmp_path: Path) -> None:
    from client.data.tokenize import tokenize_files

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(1000)))

    def interrupt(done: int, tokens: int) -> None:
        assert tokens > 0 and list(tmp_path.glob(".out.partial-*/00000.tokens"))  # it was being written
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tokenize_files([tmp_path / "docs.jsonl"], load_tokenizer("bytes"), tmp_path / "out", on_progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]
