"""How activations and their gradients travel between stages: the run's wire codec.

A run fixes one codec for all its pipeline traffic (``Model.wire_codec`` on chain): every trainer encodes
in it and every worker accepts only it, so the two always agree and a receipt's digests name the very bytes
that crossed the wire. Tokens and targets are not activations: they travel as uint8 whatever the codec.

- ``float32``: exact.  ``float16`` / ``bfloat16``: half the bytes (fp16 keeps more mantissa, bf16 fp32's
  range).  ``int8``: symmetric 8-bit values with a float32 scale per block of 64 (``BlockQuantized``), about
  a quarter of float32's bytes.

The activation-gradient path has no error feedback: a microbatch's input gradient is sent once, for samples
that never come back within the step, so a residual carried over would be added to other samples' gradients.
"""

from __future__ import annotations

import torch

from client.pipeline.messages import FLOAT_DTYPES, BlockQuantized, WireTensor

INT8 = "int8"
WIRE_CODECS = ("float32", "float16", "bfloat16", INT8)  # by the index of on-chain ``WireCodec``
DEFAULT_CODEC = "float32"


def codec_name(codec: object) -> str:
    """The codec's name from a name or from the run's ``Model.wire_codec`` (``WireCodec``, an int enum)."""
    if isinstance(codec, str):
        if codec not in WIRE_CODECS:
            raise ValueError(f"wire codec must be one of {', '.join(WIRE_CODECS)}, got {codec!r}")
        return codec
    index = int(getattr(codec, "value", codec))  # type: ignore[call-overload]
    if not 0 <= index < len(WIRE_CODECS):
        raise ValueError(f"unknown wire codec {codec!r}")
    return WIRE_CODECS[index]


def to_wire(tensor: torch.Tensor, codec: str) -> WireTensor:
    """An activation or gradient in ``codec``'s wire form."""
    if codec == INT8:
        return BlockQuantized.quantize(tensor)
    return tensor.detach().to(FLOAT_DTYPES[codec])


def from_wire(wire: WireTensor) -> torch.Tensor:
    """The float32 tensor a received activation or gradient stands for."""
    return wire.dequantize() if isinstance(wire, BlockQuantized) else wire.float()


def codec_of(wire: WireTensor) -> str | None:
    """The codec a received tensor is in; None for a tensor no codec produces (tokens, say)."""
    if isinstance(wire, BlockQuantized):
        return INT8
    return next((name for name, dtype in FLOAT_DTYPES.items() if wire.dtype == dtype), None)


def is_finite(wire: WireTensor) -> bool:
    """Whether every value is finite (a decoded ``BlockQuantized`` always is: its scales are checked)."""
    return isinstance(wire, BlockQuantized) or bool(torch.isfinite(wire).all())
