"""The wire encoding round-trips every supported tensor and refuses every malformed message."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.pipeline.messages import MAGIC, MessageError, decode_message, encode_message, tensor_digest

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    meta=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-5, 5), st.text(max_size=8), st.none())),
    seed=st.integers(0, 1000),
)
def test_round_trip(dtype: torch.dtype, shape: list[int], meta: dict, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensor = (torch.rand(shape, generator=generator) * 200).to(dtype)
    decoded_meta, tensors = decode_message(encode_message(meta, {"x": tensor}), max_elements=10_000)
    assert decoded_meta == meta
    assert tensors["x"].dtype == dtype and tensors["x"].shape == tensor.shape
    assert torch.equal(tensors["x"], tensor)
    assert tensor_digest(tensors["x"]) == tensor_digest(tensor)


def test_half_precision_halves_the_size() -> None:
    x = torch.randn(4, 16, 32)
    full = encode_message({}, {"x": x})
    half = encode_message({}, {"x": x.half()})
    assert len(half) < 0.51 * len(full)


GOOD = encode_message({"a": 1}, {"x": torch.ones(2, 3)})


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "truncated"),
        (b"nope" + GOOD[4:], "bad magic"),
        (GOOD[:-1], "truncated"),
        (GOOD + b"\0", "unexpected bytes"),
        (MAGIC + struct.pack("<I", 10**6) + b"{}", "metadata length"),
        (MAGIC + struct.pack("<I", 2) + b"[]\0", "JSON object"),
        (MAGIC + struct.pack("<I", 2) + b"\xff\xfe\0", "UTF-8 JSON"),
        (MAGIC + struct.pack("<I", 8) + b'{"a":[]}\0', "scalar"),
        (MAGIC + struct.pack("<I", 2) + b"{}\x09", "9 tensors"),
        (MAGIC + struct.pack("<I", 2) + b"{}\x01\x01x\x63\x00", "unknown dtype"),
        (MAGIC + struct.pack("<I", 2) + b"{}\x01\x01x\x01\x07", "7 dimensions"),
        (MAGIC + struct.pack("<I", 2) + b"{}\x01\x01x\x01\x02" + struct.pack("<II", 2**31, 2**31), "exceeds"),
        (MAGIC + struct.pack("<I", 2) + b"{}\x01\x00", "name length"),
        (MAGIC + struct.pack("<I", 2) + b"{}\x02\x01x\x04\x00\x00\x01x\x04\x00\x00", "twice"),
    ],
)
def test_malformed_messages_are_refused_with_reason(data: bytes, message: str) -> None:
    with pytest.raises(MessageError, match=message):
        decode_message(data, max_elements=1000)


def test_encoding_refuses_unsupported_input() -> None:
    with pytest.raises(MessageError, match="cannot be encoded"):
        encode_message({}, {"x": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(MessageError, match="metadata"):
        encode_message({"big": "x" * 5000}, {})
