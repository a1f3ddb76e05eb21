"""How the values of an all-reduce travel (a run's ``grad_values``): float32 as computed, float16, or int8 or int4 in
blocks.

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
blocks (``audit.BLOCK`` is this ``BLOCK``), both counted from the start of each part. int4 (``BlockInt4``) is the same
rule with 15 levels in blocks of ``INT4_BLOCK`` (64) values, eight to an audit block, so a value is within half a
level of its codec block's scale, and so within the audit block's largest magnitude / 14. It is meant for SPARTA's
slices sent as changes (``client.averaging.anchored``), where a slice's bytes buy more of the stage averaged each
step: at a sixty-fourth of full averaging's bytes, a tenth of the parameters every step in int4 instead of a
seventeenth in int8.

hivemind's protobuf names a codec by an enum that has no slot for a new one; ``BlockInt8`` travels under
``BLOCKWISE_8BIT``, which hivemind would hand to bitsandbytes, and ``BlockInt4`` under ``QUANTILE_8BIT``, whose
hivemind codec no run uses, so their parts are only ever decoded here (``decode``).
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
INT4_BLOCK = 64
"""Values per int4 block, sharing one scale: eight to an audit block."""
INT4_LEVELS = 7
"""int4's levels on each side of zero (-7..7)."""
MAX_DIMENSIONS = 8
"""The most dimensions a part may declare (a part is a flat slice of a vector)."""


class GradValues(Enum):
    """How averaged values travel (the state.toml ``grad_values`` names)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def code(self) -> int:
        """Its number, as the run's description and a reducer's statement carry it."""
        return list(GradValues).index(self)


class _Blockwise(CompressionBase):
    """Symmetric integers in blocks of ``block`` values, each block with its float32 scale (its largest magnitude
    over ``levels``): the scales, then the packed levels. Blocks count from the start of the part, and ``block``
    divides ``BLOCK``, so an audit block holds whole codec blocks."""

    name: str
    block: int
    levels: int

    def pack(self, levels: torch.Tensor) -> bytes:
        """The levels (int8 tensor, one per value, within ``levels``) as this codec's bytes."""
        raise NotImplementedError

    def unpack(self, data: memoryview, count: int) -> np.ndarray:
        """``count`` levels from ``data`` (exactly their bytes), as float32; ``ValueError`` where malformed."""
        raise NotImplementedError

    def packed_bytes(self, count: int) -> int:
        """The bytes ``count`` levels take, scales apart."""
        raise NotImplementedError

    def buffer_bytes(self, count: int) -> int:
        """The bytes a part of ``count`` values takes: its blocks' scales and its levels."""
        return 4 * -(-count // self.block) + self.packed_bytes(count)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo | None = None,
                 allow_inplace: bool = False) -> runtime_pb2.Tensor:
        flat = tensor.detach().reshape(-1).to(torch.float32)
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % self.block)).reshape(-1, self.block)
        scales = blocks.abs().amax(dim=1) / self.levels
        if not bool(torch.isfinite(scales).all()):
            scales = torch.full_like(scales, math.nan)  # a non-finite part decodes as one (and is refused there)
            levels = torch.zeros_like(blocks, dtype=torch.int8)
        else:
            safe = torch.where(scales > 0, scales, torch.ones_like(scales))
            levels = torch.round(blocks / safe[:, None]).clamp_(-self.levels, self.levels).to(torch.int8)
        buffer = scales.numpy().astype("<f4").tobytes() + self.pack(levels.reshape(-1)[: flat.numel()])
        return runtime_pb2.Tensor(compression=self.compression_type, buffer=buffer, size=tuple(tensor.shape),
                                  dtype="float32", requires_grad=False)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        shape = tuple(serialized_tensor.size)
        if serialized_tensor.dtype != "float32":
            raise ValueError(f"an {self.name} part stands for float32 values")
        count = math.prod(shape)
        blocks = -(-count // self.block)
        expected = self.buffer_bytes(count)
        if len(serialized_tensor.buffer) != expected:
            raise ValueError(f"an {self.name} part of {count} values is {expected} bytes, not "
                             f"{len(serialized_tensor.buffer)}")
        scales = torch.from_numpy(np.frombuffer(serialized_tensor.buffer, dtype="<f4", count=blocks).copy())
        levels = self.unpack(memoryview(serialized_tensor.buffer)[4 * blocks:], count)  # the levels, not copied
        padded = torch.nn.functional.pad(torch.from_numpy(levels), (0, blocks * self.block - count))
        return (padded.reshape(blocks, self.block) * scales[:, None]).reshape(-1)[:count].reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (self.packed_bytes(self.block) + 4) / (4 * self.block)


class BlockInt8(_Blockwise):
    """int8 in blocks of ``BLOCK`` values, each with its float32 scale: the scales, then one byte per value."""

    compression_type = runtime_pb2.BLOCKWISE_8BIT
    name, block, levels = "int8", BLOCK, LEVELS

    def pack(self, levels: torch.Tensor) -> bytes:
        return levels.numpy().tobytes()

    def unpack(self, data: memoryview, count: int) -> np.ndarray:
        return np.frombuffer(data, dtype=np.int8).astype(np.float32)

    def packed_bytes(self, count: int) -> int:
        return count


class BlockInt4(_Blockwise):
    """4-bit levels in blocks of ``INT4_BLOCK`` values, each with its float32 scale: the scales, then two levels a
    byte (the first value in the low nibble), each stored as level + 8, so 1..15; a nibble of 0 is never a value,
    and pads an odd count. A 64-value block keeps a few large values from flattening the rest of an audit block
    to zero, at half a bit a value for the scales: 4.5 bits a value, a seventh of float32."""

    compression_type = runtime_pb2.QUANTILE_8BIT
    name, block, levels = "int4", INT4_BLOCK, INT4_LEVELS

    def pack(self, levels: torch.Tensor) -> bytes:
        nibbles = (levels.to(torch.int16) + 8).to(torch.uint8)
        nibbles = torch.nn.functional.pad(nibbles, (0, nibbles.numel() % 2))  # the pad nibble: 0
        return (nibbles[0::2] | (nibbles[1::2] << 4)).numpy().tobytes()

    def unpack(self, data: memoryview, count: int) -> np.ndarray:
        packed = np.frombuffer(data, dtype=np.uint8)
        nibbles = np.empty(2 * packed.size, dtype=np.uint8)
        nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
        if nibbles[count:].any():
            raise ValueError("an int4 part's pad nibble is not 0")
        if not nibbles[:count].all():
            raise ValueError("an int4 part holds a nibble of 0, which is no level")
        return nibbles[:count].astype(np.float32) - 8

    def packed_bytes(self, count: int) -> int:
        return -(-count // 2)


_CODECS: dict[GradValues, CompressionBase] = {
    GradValues.FLOAT32: NoCompression(), GradValues.FLOAT16: Float16Compression(), GradValues.INT8: BlockInt8(),
    GradValues.INT4: BlockInt4()}


def codec(values: GradValues) -> CompressionBase:
    """The compression hivemind's partitioner applies to every part sent in ``values``."""
    return _CODECS[values]


def encoded_bytes(values: GradValues, count: int) -> int:
    """The bytes ``count`` values take as one part in ``values`` (hivemind's message framing apart)."""
    compression = _CODECS[values]
    if isinstance(compression, _Blockwise):
        return compression.buffer_bytes(count)
    return count * (2 if values == GradValues.FLOAT16 else 4)


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
    if values == GradValues.INT4:  # a codec block's scale is at most the audit block's largest over INT4_LEVELS
        return largest / (2 * INT4_LEVELS)
    return 0.0


def norm_error(values: GradValues, norm: float, numel: int) -> float:
    """The most a vector of L2 norm ``norm`` and ``numel`` values can move in ``values``, in L2 norm: float16
    rounds each value within 2⁻¹¹ of itself or 2⁻²⁴ of zero; int8 each within half a level, largest/254 of its block,
    and a block's n values then move at most √n · largest / 254 ≤ √BLOCK · (the block's norm) / 254 together."""
    if values == GradValues.FLOAT16:
        return norm * 2.0**-11 + math.sqrt(numel) * 2.0**-24
    if values == GradValues.INT8:
        return norm * math.sqrt(BLOCK) / (2 * LEVELS)
    if values == GradValues.INT4:
        return norm * math.sqrt(INT4_BLOCK) / (2 * INT4_LEVELS)
    return 0.0


def norm_bound(values: GradValues, norm: float, numel: int) -> float:
    """The largest L2 norm a part of ``numel`` values can arrive with in ``values`` when it left with at most
    ``norm``: what the declared-norm limits allow."""
    return norm * (1 + FLOAT_SLACK) + norm_error(values, norm, numel) + 1e-12
