"""The 8-bit block-quantised wire form: close to what it encodes, a quarter of float32's bytes, and decoded
from untrusted bytes into nothing but finite values or a ``MessageError`` naming the problem."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from client.pipeline.messages import (
    BLOCK,
    MAX_SCALE,
    BlockQuantized,
    MessageError,
    decode_message,
    encode_message,
    encode_tensor,
    tensor_digest,
)
from client.pipeline.wire import WIRE_CODECS, codec_name, codec_of, from_wire, to_wire
from coordinator_program.spec.config import Model, WireCodec


def _decoded(tensor: BlockQuantized) -> BlockQuantized:
    _, tensors = decode_message(encode_message({}, {"x": tensor}), max_elements=1 << 20)
    return tensors["x"]  # type: ignore[return-value]


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple) | st.sampled_from([(2, 3, 130), (1, 64)]),
    magnitude=st.sampled_from([1e-30, 1e-7, 1.0, 1e4, 1e30]),
    seed=st.integers(0, 10_000),
)
def test_round_trip_is_within_half_a_step_and_bytes_are_kept(shape: tuple, magnitude: float, seed: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * magnitude
    quantized = BlockQuantized.quantize(x)
    received = _decoded(quantized)
    assert received.shape == x.shape
    assert encode_tensor(received) == encode_tensor(quantized)  # relayed byte for byte: receipts agree
    assert tensor_digest(received) == tensor_digest(quantized)
    restored = received.dequantize()
    assert restored.dtype == torch.float32 and bool(torch.isfinite(restored).all())
    step = quantized.scales.repeat_interleave(BLOCK, dim=-1)[..., : x.shape[-1]]
    assert bool(((restored - x).abs() <= step / 2 * 1.0001 + 1e-45).all())


@settings(max_examples=300, deadline=None)
@given(
    position=st.integers(0, 10_000),
    replacement=st.binary(min_size=1, max_size=4),
    scale_bits=st.integers(0, 2**32 - 1),
)
def test_hostile_bytes_decode_to_finite_values_or_a_codec_error(
    position: int, replacement: bytes, scale_bits: int
) -> None:
    """Any byte of a valid message overwritten, or any bit pattern as a scale: never a NaN or an infinity."""
    message = bytearray(encode_message({"stage": "body1"}, {"input": BlockQuantized.quantize(torch.randn(2, 3, 96))}))
    position %= len(message)
    message[position : position + len(replacement)] = replacement
    scales_at = message.find(b"input") + len(b"input") + 2 + 3 * 4  # after name, code, ndim and the shape
    with_scale = bytearray(message)
    with_scale[scales_at : scales_at + 4] = struct.pack("<I", scale_bits)
    for data in (bytes(message), bytes(with_scale)):
        try:
            _, tensors = decode_message(data, max_elements=2 * 3 * 96)
        except MessageError:
            continue
        for tensor in tensors.values():
            assert bool(torch.isfinite(from_wire(tensor)).all())


def _message_with(scales: torch.Tensor, values: torch.Tensor) -> bytes:
    return encode_message({}, {"x": BlockQuantized(values, scales)})


@pytest.mark.parametrize(
    "scale, reason",
    [(math.nan, "finite"), (math.inf, "finite"), (-1.0, "finite and in 0.."), (MAX_SCALE * 2, "finite and in 0..")],
)
def test_hostile_scales_are_refused(scale: float, reason: str) -> None:
    values = torch.full((2, 64), 127, dtype=torch.int8)
    scales = torch.tensor([[1.0], [scale]])
    with pytest.raises(MessageError, match=f"tensor 'x': quantisation scales must be {reason}"):
        decode_message(_message_with(scales, values), max_elements=128)


def test_the_largest_scale_still_dequantises_to_finite_values() -> None:
    values = torch.tensor([[127, -127, 0]], dtype=torch.int8)
    received = _decoded(BlockQuantized(values, torch.tensor([[MAX_SCALE]])))
    assert bool(torch.isfinite(received.dequantize()).all())


def test_minus_128_is_refused() -> None:
    values = torch.tensor([[1, -128]], dtype=torch.int8)
    with pytest.raises(MessageError, match=r"values must lie in -127\.\.127"):
        decode_message(_message_with(torch.ones(1, 1), values), max_elements=8)


def test_truncated_or_scalar_quantised_tensors_are_refused() -> None:
    good = _message_with(torch.ones(2, 1), torch.ones(2, 3, dtype=torch.int8))
    with pytest.raises(MessageError, match="truncated while reading values"):
        decode_message(good[:-1], max_elements=8)
    with pytest.raises(MessageError, match="truncated while reading scales"):
        decode_message(good[: good.index(b"x") + 1 + 2 + 8 + 3], max_elements=8)
    scalar = bytearray(good[: good.index(b"x") + 1]) + bytes([6, 0]) + struct.pack("<f", 1.0) + b"\x01"
    with pytest.raises(MessageError, match="needs at least one dimension"):
        decode_message(bytes(scalar), max_elements=8)
    with pytest.raises(MessageError, match="exceeds the limit"):
        decode_message(good, max_elements=5)


def test_quantising_a_non_finite_tensor_is_refused() -> None:
    with pytest.raises(MessageError, match="NaN or infinite"):
        BlockQuantized.quantize(torch.tensor([1.0, math.inf]))


def test_int8_is_about_a_quarter_of_float32_on_the_wire() -> None:
    x = torch.randn(8, 128, 128)
    sizes = {codec: len(encode_message({}, {"x": to_wire(x, codec)})) for codec in WIRE_CODECS}
    assert sizes["float16"] == sizes["bfloat16"] < 0.51 * sizes["float32"]
    assert sizes["int8"] < 0.27 * sizes["float32"]  # 1 byte per value + a 4-byte scale per 64


def test_codec_names_follow_the_on_chain_enum() -> None:
    assert [codec_name(codec) for codec in WireCodec] == list(WIRE_CODECS)
    assert codec_name(Model().wire_codec) == "float32"
    assert codec_name("int8") == "int8"
    for bad in ("int4", 4, -1):
        with pytest.raises(ValueError, match="wire codec"):
            codec_name(bad)
    x = torch.randn(2, 64)
    assert [codec_of(to_wire(x, codec)) for codec in WIRE_CODECS] == list(WIRE_CODECS)
    assert codec_of(torch.zeros(2, dtype=torch.uint8)) is None
