"""A small schema language for fixed, Borsh-compatible layouts.

The coordinator account and every instruction are declared once with these types. From one declaration
come the encoder and decoder the specification and the TCP backend use, the Anchor IDL that anchorpy
reads, and the byte offsets the C program is checked against, so the three can never drift apart.

Borsh has no padding and writes integers little-endian; a fixed array is its elements back to back; a
``bytes``/``string`` is a u32 length then the bytes (used only in instructions: the account is fixed).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
import struct
from collections.abc import Sequence
from typing import Any


class LayoutError(ValueError):
    """Bytes that do not decode under a layout, or a value that does not fit one."""


class Reader:
    """A cursor over bytes that fails with a clear message instead of reading past the end."""

    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise LayoutError(f"truncated data: {what} needs {n} bytes at offset {self.pos}, "
                              f"{len(self.data) - self.pos} left")
        chunk = self.data[self.pos:self.pos + n].tobytes()
        self.pos += n
        return chunk


class Type:
    """A layout type: knows its size, how to write and read a Python value, and its IDL spelling."""

    size: int | None = None  # None for variable-size types

    def encode(self, value: Any, out: bytearray) -> None:
        raise NotImplementedError

    def decode(self, reader: Reader, what: str) -> Any:
        raise NotImplementedError

    def idl(self) -> Any:
        raise NotImplementedError

    def zero(self) -> Any:
        """The value whose encoding is all zero bytes (what fills unused slots of a fixed array)."""
        raise NotImplementedError


class Int(Type):
    def __init__(self, name: str, fmt: str, lo: int, hi: int) -> None:
        self.name, self.fmt, self.lo, self.hi = name, fmt, lo, hi
        self.size = struct.calcsize(fmt)

    def encode(self, value: Any, out: bytearray) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise LayoutError(f"{value!r} does not fit {self.name}")
        out += struct.pack(self.fmt, value)

    def decode(self, reader: Reader, what: str) -> int:
        return struct.unpack(self.fmt, reader.take(self.size, what))[0]

    def idl(self) -> str:
        return self.name

    def zero(self) -> int:
        return 0


U8 = Int("u8", "<B", 0, 2**8 - 1)
U16 = Int("u16", "<H", 0, 2**16 - 1)
U32 = Int("u32", "<I", 0, 2**32 - 1)
U64 = Int("u64", "<Q", 0, 2**64 - 1)
I64 = Int("i64", "<q", -(2**63), 2**63 - 1)


class Bool(Type):
    size = 1

    def encode(self, value: Any, out: bytearray) -> None:
        if not isinstance(value, bool):
            raise LayoutError(f"{value!r} is not a bool")
        out.append(1 if value else 0)

    def decode(self, reader: Reader, what: str) -> bool:
        byte = reader.take(1, what)[0]
        if byte > 1:
            raise LayoutError(f"{what}: {byte} is not a bool (0 or 1)")
        return byte == 1

    def idl(self) -> str:
        return "bool"

    def zero(self) -> bool:
        return False


BOOL = Bool()


class FixedBytes(Type):
    """``[u8; n]`` held as Python ``bytes`` of exactly n."""

    def __init__(self, n: int, idl_name: str | None = None) -> None:
        self.size = n
        self.idl_name = idl_name

    def encode(self, value: Any, out: bytearray) -> None:
        if not isinstance(value, (bytes, bytearray)) or len(value) != self.size:
            raise LayoutError(f"expected {self.size} bytes, got {value!r:.60}")
        out += value

    def decode(self, reader: Reader, what: str) -> bytes:
        return reader.take(self.size, what)

    def idl(self) -> Any:
        return self.idl_name or {"array": ["u8", self.size]}

    def zero(self) -> bytes:
        return bytes(self.size)


PUBKEY = FixedBytes(32, "publicKey")


class FixedStr(Type):
    """A UTF-8 string zero-padded into ``[u8; n]``; it may not contain NUL, so padding is unambiguous."""

    def __init__(self, n: int) -> None:
        self.size = n

    def encode(self, value: Any, out: bytearray) -> None:
        if not isinstance(value, str):
            raise LayoutError(f"{value!r} is not a string")
        raw = value.encode()
        if len(raw) > self.size or b"\0" in raw:
            raise LayoutError(f"{value!r:.60} must be at most {self.size} UTF-8 bytes without NUL")
        out += raw.ljust(self.size, b"\0")

    def decode(self, reader: Reader, what: str) -> str:
        raw = reader.take(self.size, what).rstrip(b"\0")
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            raise LayoutError(f"{what}: not UTF-8") from None
        if "\0" in text:
            raise LayoutError(f"{what}: NUL inside a string")
        return text

    def idl(self) -> Any:
        return {"array": ["u8", self.size]}

    def zero(self) -> str:
        return ""


class VarBytes(Type):
    """Borsh ``bytes``: u32 length, then the bytes. Bounded so a hostile length cannot allocate much."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def encode(self, value: Any, out: bytearray) -> None:
        if not isinstance(value, (bytes, bytearray)) or len(value) > self.max_len:
            raise LayoutError(f"expected at most {self.max_len} bytes")
        out += struct.pack("<I", len(value)) + value

    def decode(self, reader: Reader, what: str) -> bytes:
        n = U32.decode(reader, what)
        if n > self.max_len:
            raise LayoutError(f"{what}: length {n} exceeds {self.max_len}")
        return reader.take(n, what)

    def idl(self) -> str:
        return "bytes"

    def zero(self) -> bytes:
        return b""


class Enum8(Type):
    """A fieldless Rust-style enum stored as one byte, held in Python as an ``IntEnum``."""

    size = 1

    def __init__(self, cls: type[enum.IntEnum]) -> None:
        self.cls = cls
        assert [m.value for m in cls] == list(range(len(cls))), "enum values must be 0..n-1 in order"

    def encode(self, value: Any, out: bytearray) -> None:
        if not isinstance(value, self.cls):
            raise LayoutError(f"{value!r} is not a {self.cls.__name__}")
        out.append(int(value))

    def decode(self, reader: Reader, what: str) -> enum.IntEnum:
        byte = reader.take(1, what)[0]
        try:
            return self.cls(byte)
        except ValueError:
            raise LayoutError(f"{what}: {byte} is not a {self.cls.__name__}") from None

    def idl(self) -> Any:
        return {"defined": self.cls.__name__}

    def idl_definition(self) -> dict[str, Any]:
        return {"name": self.cls.__name__,
                "type": {"kind": "enum", "variants": [{"name": m.name} for m in self.cls]}}

    def zero(self) -> enum.IntEnum:
        return self.cls(0)


def _plain_ints_within(values: Sequence[Any], lo: int, hi: int) -> bool:
    """Every value is an ``int`` (not a bool nor another subclass) in ``[lo, hi]``: what ``Int.encode`` accepts of
    plain ints, checked at C speed; anything else takes the element-wise path and its error."""
    return not values or (set(map(type, values)) == {int} and lo <= min(values) and max(values) <= hi)


class Array(Type):
    """``[T; n]`` held as a Python list of exactly n elements."""

    def __init__(self, elem: Type, n: int) -> None:
        assert elem.size is not None, "arrays hold fixed-size elements"
        self.elem, self.n = elem, n
        self.size = elem.size * n

    def encode(self, value: Any, out: bytearray) -> None:
        if len(value) != self.n:
            raise LayoutError(f"expected {self.n} elements, got {len(value)}")
        if isinstance(self.elem, Int) and _plain_ints_within(value, self.elem.lo, self.elem.hi):
            # One struct.pack for the whole array: the votes are 1,024 u8s, packed on every change the server makes.
            out += struct.pack(f"<{self.n}{self.elem.fmt[1:]}", *value)
            return
        for item in value:
            self.elem.encode(item, out)

    def decode(self, reader: Reader, what: str) -> list[Any]:
        return [self.elem.decode(reader, f"{what}[{i}]") for i in range(self.n)]

    def idl(self) -> Any:
        return {"array": [self.elem.idl(), self.n]}

    def zero(self) -> list[Any]:
        return [self.elem.zero() for _ in range(self.n)]


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a struct. ``count_of`` makes it a u16/u32 that stores the length of a list field,
    derived when encoding and used to trim the fixed array when decoding."""

    name: str
    type: Type
    count_of: str | None = None
    doc: str = ""


class Struct(Type):
    """A Borsh struct bound to a Python dataclass.

    Fields of kind ``Bounded`` are held in Python as a list shorter than the fixed array; the array is
    padded with zero elements on the wire and trimmed by its count field on the way back.
    """

    def __init__(self, cls: type, fields: Sequence[Field], doc: str = "") -> None:
        self.cls, self.fields, self.doc = cls, tuple(fields), doc
        sizes = [f.type.size for f in self.fields]
        self.size = None if any(s is None for s in sizes) else sum(sizes)  # type: ignore[arg-type]
        self.counts = {f.count_of: f.name for f in self.fields if f.count_of}
        for name in self.counts:  # encode pads a bounded list with zero bytes: its zero element's
            elem = next(f.type for f in self.fields if f.name == name).elem  # type: ignore[attr-defined]
            assert elem.pack(elem.zero()) == bytes(elem.size), f"{name}: a zero entry must encode as zeros"

    @property
    def name(self) -> str:
        return self.cls.__name__

    def encode(self, value: Any, out: bytearray) -> None:
        for f in self.fields:
            if f.count_of:
                item = len(getattr(value, f.count_of))
            else:
                item = getattr(value, f.name)
                if f.name in self.counts:
                    assert isinstance(f.type, Array)
                    if len(item) > f.type.n:
                        raise LayoutError(f"{self.name}.{f.name}: {len(item)} entries exceed {f.type.n}")
            try:
                if f.name in self.counts:  # the unused entries are zero elements, whose bytes are all zero
                    if not pack_rows(f.type.elem, item, out):  # type: ignore[attr-defined]
                        for element in item:
                            f.type.elem.encode(element, out)
                    out += bytes(f.type.elem.size * (f.type.n - len(item)))  # type: ignore[attr-defined,operator]
                else:
                    f.type.encode(item, out)
            except LayoutError as exc:
                raise LayoutError(f"{self.name}.{f.name}: {exc}") from None

    def decode(self, reader: Reader, what: str) -> Any:
        values: dict[str, Any] = {}
        counts: dict[str, int] = {}
        for f in self.fields:
            item = f.type.decode(reader, f"{what}.{f.name}")
            if f.count_of:
                counts[f.count_of] = item
                continue
            if f.name in counts:
                count = counts[f.name]
                if count > len(item):
                    raise LayoutError(f"{what}.{f.name}: count {count} exceeds {len(item)}")
                assert isinstance(f.type, Array)
                if any(unused != f.type.elem.zero() for unused in item[count:]):
                    raise LayoutError(f"{what}.{f.name}: unused entries past {count} must be zero")
                item = item[:count]
            values[f.name] = item
        return self.cls(**values)

    def idl(self) -> Any:
        return {"defined": self.name}

    def idl_definition(self) -> dict[str, Any]:
        fields = [{"name": camel(f.name), "type": f.type.idl()} for f in self.fields]
        definition: dict[str, Any] = {"name": self.name, "type": {"kind": "struct", "fields": fields}}
        if self.doc:
            definition["docs"] = [self.doc]
        return definition

    def zero(self) -> Any:
        values = {}
        for f in self.fields:
            if f.count_of:
                continue
            values[f.name] = [] if f.name in self.counts else f.type.zero()
        return self.cls(**values)

    def offsets(self, base: int = 0, prefix: str = "") -> dict[str, tuple[int, int]]:
        """Byte offset and size of every field, recursively, for checking the C program's structs."""
        out: dict[str, tuple[int, int]] = {}
        pos = base
        for f in self.fields:
            assert f.type.size is not None, "offsets exist only for fixed layouts"
            out[prefix + f.name] = (pos, f.type.size)
            if isinstance(f.type, Struct):
                out.update(f.type.offsets(pos, prefix + f.name + "."))
            pos += f.type.size
        return out

    def pack(self, value: Any) -> bytes:
        out = bytearray()
        self.encode(value, out)
        return bytes(out)

    def unpack(self, data: bytes) -> Any:
        reader = Reader(data)
        value = self.decode(reader, self.name)
        if reader.pos != len(reader.data):
            raise LayoutError(f"{self.name}: {len(reader.data) - reader.pos} trailing bytes")
        return value


def pack_rows(elem: Type, rows: Sequence[Any], out: bytearray) -> bool:
    """Append ``rows`` of the flat struct ``elem`` (fields of ints, enums, bools and fixed bytes only) with one
    ``struct.pack``, checking each column at once, and say whether it did. It declines, appending nothing, for
    any other type or any value that ``Struct.encode`` might reject, which then encodes (or rejects) row by row:
    the account's 1,024 clients, joiners and ledger entries are packed on every change the server makes."""
    if not rows or not isinstance(elem, Struct) or elem.counts:
        return False
    formats, columns = [], []
    for f in elem.fields:
        column = list(map(operator.attrgetter(f.name), rows))
        kinds = set(map(type, column))
        if isinstance(f.type, Int) and kinds == {int} and f.type.lo <= min(column) and max(column) <= f.type.hi:
            formats.append(f.type.fmt[1:])
        elif isinstance(f.type, Enum8) and kinds == {f.type.cls}:
            formats.append("B")
        elif isinstance(f.type, Bool) and kinds == {bool}:
            formats.append("?")  # struct packs a bool as the byte 0 or 1, as Bool.encode does
        elif isinstance(f.type, FixedBytes) and kinds == {bytes} and set(map(len, column)) == {f.type.size}:
            formats.append(f"{f.type.size}s")
        else:
            return False
        columns.append(column)
    out += struct.pack("<" + "".join(formats) * len(rows), *itertools.chain.from_iterable(zip(*columns, strict=True)))
    return True


def camel(name: str) -> str:
    """snake_case → camelCase, the spelling of names in Anchor's legacy IDL (anchorpy snakes them back)."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def referenced_types(types: Sequence[Type]) -> list[Struct | Enum8]:
    """Every struct and enum reachable from ``types``, dependencies first, each once (for the IDL)."""
    seen: dict[str, Struct | Enum8] = {}

    def visit(t: Type) -> None:
        if isinstance(t, Array):
            visit(t.elem)
        elif isinstance(t, Enum8):
            seen.setdefault(t.cls.__name__, t)
        elif isinstance(t, Struct):
            for f in t.fields:
                visit(f.type)
            seen.setdefault(t.name, t)

    for t in types:
        visit(t)
    return list(seen.values())

