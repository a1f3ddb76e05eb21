"""A compact, strictly validated byte encoding for RPC messages: a little JSON metadata plus raw tensors.

Activations dominate the traffic, so tensors travel as raw little-endian bytes with a few bytes of header
(no protobuf, no pickle: a worker decodes bytes from untrusted trainers and must never execute them).
Decoding checks every length against the buffer and against caller-given limits before allocating, so a
malformed or oversized message costs nothing but a ``MessageError`` naming the problem.

Layout::

    message := b"PSW1" u32 meta_len meta_json u8 n_tensors tensor*
    tensor  := u8 name_len name u8 dtype u8 ndim u32 dim* payload      (payload = prod(dims) · itemsize)

except for the 8-bit block-quantised form (``BlockQuantized``, dtype code 6), whose payload is its float32
scales, one per block of ``BLOCK`` values along the last dimension, then one int8 per element.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
import sys

import torch

from client.identity import from_json

MAGIC = b"PSW1"
MAX_META_BYTES = 4096
MAX_NDIM = 4
MAX_NAME_BYTES = 32
MAX_TENSORS = 8
BLOCK = 64  # values per quantisation scale, along the last dimension
QMAX = 127  # symmetric int8: -127..127, so that 0 is exact and negation is lossless
MAX_SCALE = torch.finfo(torch.float32).max / 128  # exact in float32; 127 × it stays finite, unlike max / 127

# Wire code of each dtype a message may carry. Activations and gradients travel in the run's wire codec (``wire``:
# one of these float types, or ``BlockQuantized``); byte tokens travel as uint8, a quarter of int32's size.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.uint8: 4,
    torch.int64: 5,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
BLOCK_QUANTIZED_CODE = 6
FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("psyswarm's tensor encoding assumes a little-endian host")


class MessageError(ValueError):
    """A message is malformed or exceeds a limit; the text says which field and why."""


MetaValue = str | int | float | bool | None


def _blocks(width: int) -> int:
    return -(-width // BLOCK)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockQuantized:
    """A float tensor as symmetric int8 values with one float32 scale per block of ``BLOCK`` values along its
    last dimension (the last block of a row may be shorter): a byte per value and 4 per 64 values, 0.27 of float32.

    Per-block scales keep one outlier from flattening a whole row to zero; float32 scales (not fp16) keep the
    tiny values of activation gradients in range. It travels and is hashed as received: a trainer relays a
    worker's quantised output to the next stage byte for byte, so receipts on both sides hash the same bytes.
    """

    values: torch.Tensor  # int8, the tensor's shape, each in -QMAX..QMAX
    scales: torch.Tensor  # float32, shape[:-1] + (blocks per row,), each finite in 0..MAX_SCALE

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dim(self) -> int:
        return self.values.dim()

    @classmethod
    def quantize(cls, tensor: torch.Tensor) -> BlockQuantized:
        """Round each block to the nearest multiple of its absolute maximum / 127; refuses non-finite input,
        which no scale can represent."""
        if tensor.dim() < 1:
            raise MessageError("a quantised tensor needs at least one dimension")
        x = tensor.detach().float()
        if not bool(torch.isfinite(x).all()):
            raise MessageError("cannot quantise a tensor holding NaN or infinite values")
        width = x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, _blocks(width) * BLOCK - width))
        blocks = padded.reshape(*x.shape[:-1], _blocks(width), BLOCK)
        scales = blocks.abs().amax(dim=-1) / QMAX
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
        values = torch.round(blocks / divisor).clamp_(-QMAX, QMAX).to(torch.int8)
        values = values.reshape(*x.shape[:-1], _blocks(width) * BLOCK)[..., :width]
        return cls(values.contiguous(), scales.contiguous())

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor these values and scales stand for; always finite (scales are bounded)."""
        width = self.values.shape[-1]
        return self.values.float() * self.scales.repeat_interleave(BLOCK, dim=-1)[..., :width]

    def check(self) -> None:
        """Raise ``MessageError`` unless every value and scale is in range (what ``decode_message`` enforces)."""
        if bool((self.values < -QMAX).any()):
            raise MessageError(f"quantised values must lie in -{QMAX}..{QMAX}")
        finite = torch.isfinite(self.scales).all()
        if not bool(finite) or bool(((self.scales < 0) | (self.scales > MAX_SCALE)).any()):
            raise MessageError(f"quantisation scales must be finite and in 0..{MAX_SCALE:.3g}")


WireTensor = torch.Tensor | BlockQuantized


def encode_tensor(tensor: WireTensor) -> bytes:
    """One tensor's wire form (dtype code, shape, raw bytes); also what receipts hash."""
    if tensor.dim() > MAX_NDIM:
        raise MessageError(f"tensor has {tensor.dim()} dimensions, more than {MAX_NDIM}")
    if isinstance(tensor, BlockQuantized):
        header = struct.pack(f"<BB{tensor.dim()}I", BLOCK_QUANTIZED_CODE, tensor.dim(), *tensor.shape)
        return header + _raw(tensor.scales) + _raw(tensor.values)
    if tensor.dtype not in DTYPE_CODES:
        raise MessageError(f"dtype {tensor.dtype} cannot be encoded; use one of {list(DTYPE_CODES)}")
    header = struct.pack(f"<BB{tensor.dim()}I", DTYPE_CODES[tensor.dtype], tensor.dim(), *tensor.shape)
    return header + _raw(tensor)


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_digest(tensor: WireTensor) -> str:
    """sha256 of a tensor's wire form, so a trainer and a worker can agree on what was exchanged."""
    return hashlib.sha256(encode_tensor(tensor)).hexdigest()


def encode_message(meta: dict[str, MetaValue], tensors: dict[str, WireTensor]) -> bytes:
    """Serialise metadata (flat JSON of scalars) and named tensors."""
    meta_bytes = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    if len(meta_bytes) > MAX_META_BYTES:
        raise MessageError(f"metadata is {len(meta_bytes)} bytes, more than {MAX_META_BYTES}")
    if len(tensors) > MAX_TENSORS:
        raise MessageError(f"{len(tensors)} tensors, more than {MAX_TENSORS}")
    parts = [MAGIC, struct.pack("<I", len(meta_bytes)), meta_bytes, struct.pack("<B", len(tensors))]
    for name, tensor in tensors.items():
        raw_name = name.encode()
        if not 0 < len(raw_name) <= MAX_NAME_BYTES:
            raise MessageError(f"tensor name {name!r} must be 1..{MAX_NAME_BYTES} bytes")
        parts += [struct.pack("<B", len(raw_name)), raw_name, encode_tensor(tensor)]
    return b"".join(parts)


class _Reader:
    """Bounds-checked cursor over a received buffer."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, count: int, what: str) -> memoryview:
        if count < 0 or self.pos + count > len(self.data):
            raise MessageError(f"message truncated while reading {what}")
        chunk = self.data[self.pos : self.pos + count]
        self.pos += count
        return chunk

    def unpack(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))


def _decode_meta(raw: memoryview) -> dict[str, MetaValue]:
    try:
        meta = from_json(bytes(raw).decode("utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON, or nested too deeply
        raise MessageError(f"metadata is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise MessageError("metadata must be a JSON object")
    for key, value in meta.items():
        if not isinstance(value, str | int | float | bool | type(None)):
            raise MessageError(f"metadata field {key!r} must be a scalar, not {type(value).__name__}")
    return meta


def decode_message(data: bytes, *, max_elements: int) -> tuple[dict[str, MetaValue], dict[str, WireTensor]]:
    """Parse a message, refusing any tensor with more than ``max_elements`` elements or any trailing byte.

    Tensors keep their wire form (a dtype, or ``BlockQuantized`` with its values and scales checked in
    range); callers convert after checking it, and hash them as received.
    """
    reader = _Reader(data)
    if bytes(reader.take(len(MAGIC), "magic")) != MAGIC:
        raise MessageError("not a psyswarm message (bad magic bytes)")
    (meta_len,) = reader.unpack("<I", "metadata length")
    if meta_len > MAX_META_BYTES:
        raise MessageError(f"metadata length {meta_len} exceeds {MAX_META_BYTES}")
    meta = _decode_meta(reader.take(meta_len, "metadata"))
    (count,) = reader.unpack("<B", "tensor count")
    if count > MAX_TENSORS:
        raise MessageError(f"{count} tensors, more than {MAX_TENSORS}")
    tensors: dict[str, WireTensor] = {}
    for _ in range(count):
        (name_len,) = reader.unpack("<B", "tensor name length")
        if not 0 < name_len <= MAX_NAME_BYTES:
            raise MessageError(f"tensor name length {name_len} is not in 1..{MAX_NAME_BYTES}")
        try:
            name = bytes(reader.take(name_len, "tensor name")).decode("ascii")
        except UnicodeDecodeError:
            raise MessageError("tensor name is not ASCII") from None
        if name in tensors:
            raise MessageError(f"tensor {name!r} appears twice")
        tensors[name] = _decode_tensor(reader, name, max_elements)
    if reader.pos != len(reader.data):
        raise MessageError(f"{len(reader.data) - reader.pos} unexpected bytes after the last tensor")
    return meta, tensors


def _decode_tensor(reader: _Reader, name: str, max_elements: int) -> WireTensor:
    code, ndim = reader.unpack("<BB", f"header of tensor {name!r}")
    if code not in _CODE_DTYPES and code != BLOCK_QUANTIZED_CODE:
        raise MessageError(f"tensor {name!r} has unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise MessageError(f"tensor {name!r} has {ndim} dimensions, more than {MAX_NDIM}")
    shape = reader.unpack(f"<{ndim}I", f"shape of tensor {name!r}")
    elements = math.prod(shape)
    if elements > max_elements:
        raise MessageError(f"tensor {name!r} of shape {list(shape)} exceeds the limit of {max_elements} elements")
    if code != BLOCK_QUANTIZED_CODE:
        return _take(reader, shape, _CODE_DTYPES[code], f"payload of tensor {name!r}")
    if ndim < 1:
        raise MessageError(f"quantised tensor {name!r} needs at least one dimension")
    scale_shape = (*shape[:-1], _blocks(shape[-1]))
    scales = _take(reader, scale_shape, torch.float32, f"scales of tensor {name!r}")
    quantized = BlockQuantized(_take(reader, shape, torch.int8, f"values of tensor {name!r}"), scales)
    try:
        quantized.check()
    except MessageError as exc:
        raise MessageError(f"tensor {name!r}: {exc}") from None
    return quantized


def _take(reader: _Reader, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    elements = math.prod(shape)
    payload = reader.take(elements * dtype.itemsize, what)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if elements else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)
