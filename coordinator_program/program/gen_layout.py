"""Generate include/psy_coordinator_layout.h, the C program's view of every layout, from the Python schema.

The C program never declares a struct for the account or an instruction: it reads and writes bytes at the
offsets this header gives, with the SDK's unaligned loads and stores, so the Borsh layout has one source
(the Python declarations) and no compiler padding rule can creep in. The header holds:

* for the coordinator account, the instance account and each element type (config, model, checkpoint,
  round, client, pending): the size of the struct and the offset and size of every field, plus GET/SET
  macros for scalar fields that pick the load or store of the field's exact width;
* the Anchor discriminators of both accounts and of every instruction, as little-endian u64 constants;
* for each instruction, the offset and size of its arguments in the instruction data (up to the first
  variable-size argument, whose offset is the last given) and, when it has no variable part, the data size;
* enum values, error codes (6000 + n), capacities from limits.py, the config's bloom limits, the PDA
  seed, the witness RNG's domain and the bloom salt prefix.

Usage (from the repository root):

    python -m coordinator_program.program.gen_layout          # rewrites the header
    python -m coordinator_program.program.gen_layout --check  # fails if the committed header is stale
"""

from __future__ import annotations

import argparse
import enum
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from coordinator_program.onchain.instance import INSTANCE_DISCRIMINATOR, INSTANCE_LAYOUT, INSTANCE_SEED, INSTANCE_SIZE
from coordinator_program.spec import config, limits
from coordinator_program.spec.beacon import COMMIT_DOMAIN, JOIN_DOMAIN
from coordinator_program.spec.bloom import COMPUTE_KEY_PREFIX, SALT_PREFIX
from coordinator_program.spec.errors import ALL_ERRORS
from coordinator_program.spec.instructions import INSTRUCTIONS
from coordinator_program.spec.layout import BOOL, I64, U8, U16, U32, U64, Enum8, Struct
from coordinator_program.spec.selection import DATA_DOMAIN, SEED_DOMAIN, WITNESS_DOMAIN
from coordinator_program.spec.state import (
    ACCOUNT_DISCRIMINATOR,
    ACCOUNT_LAYOUT,
    ACCOUNT_SIZE,
    CLIENT_LAYOUT,
    LEDGER_ENTRY_LAYOUT,
    PENDING_LAYOUT,
    ROUND_LAYOUT,
    Health,
    Phase,
    Role,
)

HEADER_PATH = Path(__file__).resolve().parent / "include" / "psy_coordinator_layout.h"
DISCRIMINATOR_BYTES = 8

# (macro prefix, layout, offset of the layout's first byte): the two accounts start after their
# discriminator; element types are laid out from 0 and placed by the code that indexes their arrays.
STRUCTS: tuple[tuple[str, Struct, int], ...] = (
    ("ACCOUNT", ACCOUNT_LAYOUT, DISCRIMINATOR_BYTES),
    ("INSTANCE", INSTANCE_LAYOUT, DISCRIMINATOR_BYTES),
    ("CONFIG", config.CONFIG_LAYOUT, 0),
    ("MODEL", config.MODEL_LAYOUT, 0),
    ("CHECKPOINT", config.CHECKPOINT_LAYOUT, 0),
    ("ROUND", ROUND_LAYOUT, 0),
    ("CLIENT", CLIENT_LAYOUT, 0),
    ("PENDING", PENDING_LAYOUT, 0),
    ("LEDGER_ENTRY", LEDGER_ENTRY_LAYOUT, 0),
)
ENUMS: tuple[tuple[str, type[enum.IntEnum]], ...] = (
    ("PHASE", Phase), ("ROLE", Role), ("HEALTH", Health), ("CHECKPOINT_KIND", config.CheckpointKind),
    ("TOKENIZER", config.Tokenizer), ("SCHEDULE", config.Schedule), ("GRAD_AVERAGING", config.GradAveraging),
    ("GRAD_VALUES", config.GradValues), ("WIRE_CODEC", config.WireCodec))
CONFIG_LIMITS = ("BLOOM_MIN_SLICES", "BLOOM_MAX_SLICES", "BLOOM_MAX_BITS_PER_SLICE")

# The SDK accessor of each scalar width; i64 is stored as its two's complement u64.
_LOADS = {1: ("{p}[{o}]", "{p}[{o}] = (uint8_t)({v})"),
          2: ("psy_load_u16({p} + {o})", "psy_store_u16({p} + {o}, (uint16_t)({v}))"),
          4: ("psy_load_u32({p} + {o})", "psy_store_u32({p} + {o}, (uint32_t)({v}))"),
          8: ("psy_load_u64({p} + {o})", "psy_store_u64({p} + {o}, (uint64_t)({v}))")}


def macro_name(name: str) -> str:
    """CamelCase or snake_case → UPPER_SNAKE (``NotAClient`` → ``NOT_A_CLIENT``, ``P2P`` stays)."""
    spaced = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return spaced.replace(".", "_").upper()


def u64_constant(raw: bytes) -> str:
    """Eight bytes as the u64 a little-endian load of them yields."""
    assert len(raw) == DISCRIMINATOR_BYTES
    return f"0x{int.from_bytes(raw, 'little'):016x}ULL"


def byte_initializer(raw: bytes) -> str:
    return "{" + ", ".join(f"0x{b:02x}" for b in raw) + "}"


def _is_scalar(t: object) -> bool:
    return t in (U8, U16, U32, U64, I64, BOOL) or isinstance(t, Enum8)


def _struct_lines(prefix: str, layout: Struct, base: int) -> Iterator[str]:
    size = (layout.size or 0) + base
    yield f"#define PSY_{prefix}_SIZE {size}"
    types = _field_types(layout)
    for name, (offset, width) in layout.offsets(base).items():
        macro = f"PSY_{prefix}_{macro_name(name)}"
        yield f"#define {macro}_OFFSET {offset}"
        yield f"#define {macro}_SIZE {width}"
        if _is_scalar(types[name]):
            load, store = _LOADS[width]
            yield f"#define {macro}_GET(p) ({load.format(p='(p)', o=offset)})"
            yield f"#define {macro}_SET(p, v) ({store.format(p='(p)', o=offset, v='v')})"


def _field_types(layout: Struct, prefix: str = "") -> dict[str, object]:
    """Every (nested) field's type, keyed as ``Struct.offsets`` keys them."""
    out: dict[str, object] = {}
    for f in layout.fields:
        out[prefix + f.name] = f.type
        if isinstance(f.type, Struct):
            out.update(_field_types(f.type, prefix + f.name + "."))
    return out


def _instruction_lines() -> Iterator[str]:
    for ix in INSTRUCTIONS:
        macro = f"PSY_IX_{macro_name(ix.NAME)}"
        yield f"#define {macro}_DISCRIMINATOR {u64_constant(ix.discriminator())}"
        offset = DISCRIMINATOR_BYTES
        for f in ix.LAYOUT.fields:
            yield f"#define {macro}_{macro_name(f.name)}_OFFSET {offset}"
            if f.type.size is None:
                break
            yield f"#define {macro}_{macro_name(f.name)}_SIZE {f.type.size}"
            offset += f.type.size
        else:
            yield f"#define {macro}_DATA_SIZE {offset}"


def render() -> str:
    """The header's full text (deterministic: it depends only on the Python declarations)."""
    assert ACCOUNT_SIZE == ACCOUNT_LAYOUT.size + DISCRIMINATOR_BYTES
    assert INSTANCE_SIZE == (INSTANCE_LAYOUT.size or 0) + DISCRIMINATOR_BYTES
    lines = [
        "/* psy_coordinator_layout.h: generated by `python -m coordinator_program.program.gen_layout` from the",
        " * Python layouts (state.py, config.py, instance.py, instructions.py, errors.py, limits.py). Do not edit:",
        " * change the Python declarations and regenerate. Account offsets include the 8-byte discriminator;",
        " * element offsets (config, model, checkpoint, round, client, pending, ledger entry) are from the",
        " * element's start;",
        " * instruction offsets are from the start of the instruction data. */",
        "#ifndef PSY_COORDINATOR_LAYOUT_H",
        "#define PSY_COORDINATOR_LAYOUT_H",
        "",
        "#include <psy_sdk.h>",
        "",
        "/* Anchor discriminators as the u64 a little-endian load of their 8 bytes yields. */",
        f"#define PSY_DISCRIMINATOR_SIZE {DISCRIMINATOR_BYTES}",
        f"#define PSY_ACCOUNT_DISCRIMINATOR {u64_constant(ACCOUNT_DISCRIMINATOR)}",
        f"#define PSY_INSTANCE_DISCRIMINATOR {u64_constant(INSTANCE_DISCRIMINATOR)}",
    ]
    for prefix, layout, base in STRUCTS:
        lines += ["", f"/* {layout.name} */", *_struct_lines(prefix, layout, base)]
    lines += ["", "/* Instructions: discriminator, argument offsets, and the data size when it is fixed. */",
              *_instruction_lines()]
    lines += ["", "/* Enums (one byte each). */"]
    for prefix, cls in ENUMS:
        lines += [f"#define PSY_{prefix}_{macro_name(m.name)} {m.value}" for m in cls]
        lines.append(f"#define PSY_{prefix}_COUNT {len(cls)}")
    lines += ["", "/* Errors: Anchor-style custom codes, as the specification's CoordinatorError classes. */"]
    lines += [f"#define PSY_ERR_{macro_name(e.__name__)} {e.code}u" for e in sorted(ALL_ERRORS, key=lambda e: e.code)]
    lines += ["", "/* Capacities (limits.py) and the config's bloom limits (config.py). */"]
    lines += [f"#define PSY_{name} {getattr(limits, name)}" for name in sorted(vars(limits))
              if name.isupper() and isinstance(getattr(limits, name), int)]
    lines += [f"#define PSY_{name} {getattr(config, name)}" for name in CONFIG_LIMITS]
    lines += [
        "",
        "/* Seeds, domains and salts. */",
        f'#define PSY_INSTANCE_SEED "{INSTANCE_SEED.decode()}"',
        f'#define PSY_WITNESS_DOMAIN "{WITNESS_DOMAIN.decode()}"',
        f'#define PSY_SEED_DOMAIN "{SEED_DOMAIN.decode()}"',
        f'#define PSY_DATA_DOMAIN "{DATA_DOMAIN.decode()}"',
        f'#define PSY_COMMIT_DOMAIN "{COMMIT_DOMAIN.decode()}"',
        f'#define PSY_JOIN_DOMAIN "{JOIN_DOMAIN.decode()}"',
        f'#define PSY_COMPUTE_KEY_PREFIX "{COMPUTE_KEY_PREFIX}"',
        f'#define PSY_PSYSWARM_ARCHITECTURE "{config.PSYSWARM_ARCHITECTURE}"',
        f"#define PSY_BLOOM_SALT_PREFIX {byte_initializer(SALT_PREFIX)}",
        "",
        "#endif /* PSY_COORDINATOR_LAYOUT_H */",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed header is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not HEADER_PATH.exists() or HEADER_PATH.read_text() != text:
            print(f"error: {HEADER_PATH} is stale; run `python -m coordinator_program.program.gen_layout`",
                  file=sys.stderr)
            return 1
        print(f"{HEADER_PATH} is current")
        return 0
    HEADER_PATH.write_text(text)
    print(f"wrote {HEADER_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
