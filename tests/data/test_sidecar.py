"""``dataset.json`` is untrusted: every field is checked, and any input gets a sidecar or a one-line error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.data.sidecar import MAX_SIDECAR_BYTES, DatasetError, Sidecar, TokenFile, parse_sidecar

DIGEST = "cd" * 32


def valid() -> dict[str, Any]:
    return {"format": "psyswarm-tokens", "version": 1, "dtype": "uint16",
            "tokenizer": {"name": "tiny-bpe", "sha256": "ab" * 32}, "vocab_size": 2048,
            "files": [{"path": "00000.tokens", "tokens": 100, "sha256": DIGEST},
                      {"path": "00001.tokens", "tokens": 7, "sha256": "ef" * 32}]}


def encode(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_round_trip_and_fingerprint_ignores_formatting() -> None:
    sidecar = parse_sidecar(encode(valid()))
    assert sidecar == Sidecar("uint16", "tiny-bpe", "ab" * 32, 2048,
                              (TokenFile("00000.tokens", 100, DIGEST), TokenFile("00001.tokens", 7, "ef" * 32)))
    assert parse_sidecar(sidecar.render()) == sidecar
    assert parse_sidecar(json.dumps(valid(), indent=4, sort_keys=True).encode()).fingerprint() == sidecar.fingerprint()
    assert sidecar.num_tokens == 107 and sidecar.file_bytes(sidecar.files[0]) == 200


def mutate(path: list[Any], value: Any) -> dict[str, Any]:
    doc = valid()
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


LIES = [
    (["format"], "other", "format must be"),
    (["version"], 2, "version must be in 1..1"),
    (["version"], True, "version must be an integer"),
    (["dtype"], "int16", "dtype must be one of uint16, uint32"),
    (["dtype"], KeyError, "top level lacks dtype"),
    (["extra"], 1, "top level has unknown key 'extra'"),
    (["vocab_size"], 70_000, "vocab_size must be in 1..65536"),  # ids that uint16 cannot hold
    (["vocab_size"], 0, "vocab_size must be in"),
    (["vocab_size"], 2048.0, "vocab_size must be an integer"),
    (["tokenizer", "sha256"], "AB" * 32, "tokenizer.sha256 must be 64 lowercase hex digits"),
    (["tokenizer", "sha256"], "0" * 64, "vocab_size must be 256 for the byte-level tokenizer"),
    (["tokenizer", "name"], "", "tokenizer.name must be 1..128 printable"),
    (["tokenizer", "name"], "a\nb", "tokenizer.name must be 1..128 printable"),
    (["tokenizer"], "tiny-bpe", "tokenizer must be an object"),
    (["files"], [], "files must be a list of 1..4096 entries"),
    (["files"], {"path": "x"}, "files must be a list"),
    (["files", 0, "path"], "../../etc/passwd", "files[0].path must be a plain file name"),
    (["files", 0, "path"], "/etc/passwd", "files[0].path must be a plain file name"),
    (["files", 0, "path"], "..", "files[0].path must be a plain file name"),
    (["files", 0, "path"], "sub/00000.tokens", "files[0].path must be a plain file name"),
    (["files", 1, "path"], "00000.tokens", "files[1].path '00000.tokens' is listed twice"),
    (["files", 0, "tokens"], -5, "files[0].tokens must be in 1.."),
    (["files", 0, "tokens"], 1 << 41, "files[0].tokens must be in 1.."),
    (["files", 0, "tokens"], "100", "files[0].tokens must be an integer"),
    (["files", 0, "sha256"], "cd" * 31, "files[0].sha256 must be 64 lowercase hex digits"),
    (["files", 0, "extra"], 1, "files[0] has unknown key 'extra'"),
]


@pytest.mark.parametrize(("path", "value", "message"), LIES, ids=[m for _, _, m in LIES])
def test_a_lying_field_is_named_in_one_line(path: list[Any], value: Any, message: str) -> None:
    with pytest.raises(DatasetError) as refused:
        parse_sidecar(encode(mutate(path, value)))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("raw", "message"), [
    (b"\xff\xfe", "is not UTF-8"),
    (b"{", "is not valid JSON"),
    (b'{"format": NaN}', "NaN is not JSON"),
    (b'{"format": "a", "format": "b"}', "key 'format' appears more than once"),
    (b"[" * 100_000, "nested too deeply"),
    (b" " * (MAX_SIDECAR_BYTES + 1), "more than"),
    (b"[]", "top level must be an object"),
])
def test_malformed_files_are_refused(raw: bytes, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        parse_sidecar(raw)


def test_a_dataset_of_one_token_is_refused() -> None:
    doc = mutate(["files"], [{"path": "a.tokens", "tokens": 1, "sha256": DIGEST}])
    with pytest.raises(DatasetError, match="at least two tokens"):
        parse_sidecar(encode(doc))


def _refused_or_valid(raw: bytes) -> None:
    try:
        sidecar = parse_sidecar(raw)
    except DatasetError as exc:
        assert str(exc).startswith("dataset.json: ") and "\n" not in str(exc)
    else:
        assert parse_sidecar(sidecar.render()) == sidecar


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_bytes(raw: bytes) -> None:
    _refused_or_valid(raw)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["format", "version", "dtype", "tokenizer", "vocab_size", "files"]), json_values)
def test_fuzz_one_top_level_field(key: str, value: Any) -> None:
    doc = valid()
    doc[key] = value
    _refused_or_valid(encode(doc))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["path", "tokens", "sha256"]), json_values, st.integers(0, 1))
def test_fuzz_one_file_field(key: str, value: Any, index: int) -> None:
    doc = valid()
    doc["files"][index][key] = value
    _refused_or_valid(encode(doc))
