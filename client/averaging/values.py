"""How the values of an all-reduce travel (a run's ``grad_values``): float32 as computed, float16, or int8 in blocks.

Every part of a gradient round, and every averaged part a reducer returns, travels in the run's codec; a part in
any other is refused like a malformed one. The codecs are chosen so that everything the averaging layer proves
about values still holds, with a margin each codec states:

- **limits** (``norm_error``): a part's norm is checked against its sender's declared norm, a returned part's
  against the group's; a codec may move a vector of norm n by at most ``norm_error(n, numel)``, which the limits
  add to what they allow;
- **audits** (``value_error``): a reducer signs the result as its senders receive it, the codec's round trip of
  the reduction; evidence against it recomputes the reduction of one ``BLOCK`` and allows, beyond the float
  tolerance, the most any value of that block can move in the codec: ``value_error`` of the block's largest
  magnitude. The codec is named in the reducer's signed statement (``audit.Statement.values``), so evidence is
  judged by the codec its signer used, and a sender takes no statement in another codec than the run's.

float16 is hivemind's ``Float16Compression``: each value rounded alone, so within 2⁻¹¹ of itself (and 2⁻²⁴ of
zero below float16's normal range). int8 (``BlockInt8``) is this project's, not hivemind's ``Uniform8BitQuantization``:
hivemind scales a whole part by its standard deviation and clips beyond six of them, so one value's error depends on
every other value of the part and is unbounded for outliers; no evidence of one block could then be checked. Here
each ``BLOCK`` values share one float32 scale (their largest magnitude / 127) and each value is rounded to the
nearest of 255 levels: within half a level of itself, a bound one block's values state. The blocks are the audit's
blocks (``audit.BLOCK`` is this ``BLOCK``), both counted from the start of each part.

hivemind's protobuf names a codec by an enum that has no slot for a new one; ``BlockInt8`` travels under
``BLOCKWISE_8BIT``, which hivemind would hand to bitsandbytes, so its parts are only ever decoded here (``decode``).
"""

from __future__ import annotations

import math
from enum import Enum

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.proto import runtime_pb2

BLOCK = 512
"""Values per int8 block, sharing one scale: one audit block (``audit.BLOCK``)."""
LEVELS = 127
"""int8's levels on each side of zero (-127..127: symmetric, so a block's largest magnitude is a level)."""
FLOAT_SLACK = 1e-3
"""How far float32 rounding may take a part's norm beyond its sender's declared norm, as a fraction of it."""
MAX_DIMENSIONS = 8
"""The most dimensions a part may declare (a part is a flat slice of a vector)."""


class GradValues(Enum):
    """How averaged values travel (the state.toml ``grad_values`` names)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"

    @property
    def code(self) -> int:
        """Its number, as the run's description and a reducer's statement carry it."""
        return list(GradValues).index(self)


class BlockInt8(CompressionBase):
    """int8 in blocks of ``BLOCK`` values, each with its float32 scale: the scales, then one byte per value."""

    compression_type = runtime_pb2.BLOCKWISE_8BIT

    def compress(self, tensor: torch.Tensor, info: CompressionInfo | None = None,
                 allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).reshape(-1, BLOCK)
        scales = blocks.abs().amax(dim=1) / LEVELS
        if not bool(torch.isfinite(scales).all()):
            scales = torch.full_like(scales, math.nan)  # a non-finite part decodes as one (and is refused there)
            levels = torch.zeros_like(blocks, dtype=torch.int8)
        else:
            safe = torch.where(scales > 0, scales, torch.ones_like(scales))
            levels = torch.round(blocks / safe[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
        buffer = scales.numpy().astype("<f4").tobytes() + levels.reshape(-1)[: flat.numel()].numpy().tobytes()
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=buffer, size=tuple(tensor.shape),
                                  dtype="float32", requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        if serialized_tensor.dtype != "float32":
            raise ValueError("an int8 part stands for float32 values")
        count = math.prod(shape)
        blocks = -(-count // BLOCK)
        if len(serialized_tensor.buffer) != 4 * blocks + count:
            raise ValueError(f"an int8 part of {count} values is {4 * blocks + count} bytes, not "
                             f"{len(serialized_tensor.buffer)}")
        scales = torch.from_numpy(np.frombuffer(serialized_tensor.buffer, dtype="<f4", count=blocks).copy())
        levels = np.frombuffer(serialized_tensor.buffer, dtype=np.int8, offset=4 * blocks).astype(np.float32)
        padded = torch.nn.functional.pad(torch.from_numpy(levels), (0, blocks * BLOCK - count))
        return (padded.reshape(blocks, BLOCK) * scales[:, None]).reshape(-1)[:count].reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (1 + 4 / BLOCK) / 4


_CODECS: dict[GradValues, CompressionBase] = {
    GradValues.FLOAT32: NoCompression(), GradValues.FLOAT16: Float16Compression(), GradValues.INT8: BlockInt8()}


def codec(values: GradValues) -> CompressionBase:
    """The compression hivemind's partitioner applies to every part sent in ``values``."""
    return _CODECS[values]


def values_of(compression: CompressionBase) -> GradValues:
    """Which codec a partitioner's compression is (``ValueError`` for one no run uses)."""
    for values, known in _CODECS.items():
        if type(compression) is type(known):
            return values
    raise ValueError(f"{type(compression).__name__} is no codec a run's grad_values names")


def decode(part: runtime_pb2.Tensor, values: GradValues) -> torch.Tensor:
    """A peer's serialized part as float32 values; ``ValueError`` where it is not in the codec ``values`` (or is
    malformed in it)."""
    known = _CODECS[values]
    if len(part.size) > MAX_DIMENSIONS:
        raise ValueError(f"a part of {len(part.size)} dimensions (at most {MAX_DIMENSIONS})")
    if part.compression != known.compression_type:
        raise ValueError(f"a part sent as {runtime_pb2.CompressionType.Name(part.compression)}, where the run's "
                         f"grad_values is {values.value}")
    try:
        decoded = known.extract(part)
    except Exception as exc:  # a peer's bytes: any malformation is a refusal, never a crash
        raise ValueError(f"an unreadable part ({type(exc).__name__}: {exc})") from None
    if decoded.dtype != torch.float32:
        raise ValueError(f"a part of {decoded.dtype} values, not float32")
    return decoded.detach()


def round_trip(tensor: torch.Tensor, values: GradValues) -> torch.Tensor:
    """``tensor`` as it arrives in ``values``: what a reducer signs and keeps of its own result."""
    if values == GradValues.FLOAT32:
        return tensor
    return decode(codec(values).compress(tensor, None), values)


def value_error(values: GradValues, largest: float) -> float:
    """The most one value can move in ``values``, within a block whose largest magnitude is ``largest``."""
    if values == GradValues.FLOAT16:
        return largest * 2.0**-11 + 2.0**-24
    if values == GradValues.INT8:
        return largest / (2 * LEVELS)
    return 0.0


def norm_error(values: GradValues, norm: float, numel: int) -> float:
    """The most a vector of L2 norm ``norm`` and ``numel`` values can move in ``values``, in L2 norm: float16
    rounds each value within 2⁻¹¹ of itself or 2⁻²⁴ of zero; int8 each within half a level, largest/254 of its block,
    and a block's n values then move at most √n · largest / 254 ≤ √BLOCK · (the block's norm) / 254 together."""
    if values == GradValues.FLOAT16:
        return norm * 2.0**-11 + math.sqrt(numel) * 2.0**-24
    if values == GradValues.INT8:
        return norm * math.sqrt(BLOCK) / (2 * LEVELS)
    return 0.0


def norm_bound(values: GradValues, norm: float, numel: int) -> float:
    """The largest L2 norm a part of ``numel`` values can arrive with in ``values`` when it left with at most
    ``norm``: what the declared-norm limits allow."""
    return norm * (1 + FLOAT_SLACK) + norm_error(values, norm, numel) + 1e-12
