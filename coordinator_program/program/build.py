"""Build psyswarm's on-chain coordinator: clang-14 compiles each C source, linker.py makes the SBPFv0 .so.

Usage (from the repository root):

    python -m coordinator_program.program.build            # writes program/psyswarm_coordinator.so
    python -m coordinator_program.program.build --check    # rebuilds into a temp dir, fails if it differs
    python -m coordinator_program.program.build --out X.so

The built ``.so`` is committed so that users without clang can deploy it; ``--check`` is how CI proves the
committed file is exactly what the sources produce. The same functions build test fixture programs.
"""

from __future__ import annotations

import argparse
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from coordinator_program.program.linker import LinkError, link

PROGRAM_DIR = Path(__file__).resolve().parent
SOURCE_DIR = PROGRAM_DIR / "src"
INCLUDE_DIR = PROGRAM_DIR / "include"
DEFAULT_OUTPUT = PROGRAM_DIR / "psyswarm_coordinator.so"

CLANG = "clang-14"
CFLAGS: tuple[str, ...] = (
    "-target",
    "bpf",
    "-mcpu=v2",  # v3 emits JMP32/ALU32, which SBPFv0 lacks or runs with different semantics
    "-O2",
    "-fno-builtin",  # no memcpy/memset calls synthesized from loops: there is no libc to link
    "-ffreestanding",
    "-nostdlib",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror",  # the .so is committed: a warning today is a silent miscompile tomorrow
)
"""Compiler flags for every source; -mcpu, -O2 and the freestanding flags are what the loader needs."""

INSTALL_HINT = "install it with: apt-get update && apt-get install -y clang-14"


class BuildError(RuntimeError):
    """A build step failed; the message says which and why (compiler output, linker reason)."""


def find_clang() -> str:
    """Path of clang-14; a clear BuildError saying how to install it when it is missing."""
    path = shutil.which(CLANG)
    if path is None:
        raise BuildError(f"{CLANG} is not installed (it compiles the on-chain program); {INSTALL_HINT}")
    return path


def compile_object(source: Path, include_dirs: Sequence[Path] = (INCLUDE_DIR,)) -> bytes:
    """Compile one C file to a relocatable BPF object and return its bytes.

    The object goes through a private temporary directory so that parallel builds never collide.
    """
    clang = find_clang()
    with tempfile.TemporaryDirectory(prefix="psy-cc-") as tmp:
        obj = Path(tmp) / (source.stem + ".o")
        includes = [f"-I{d}" for d in include_dirs]
        cmd = [clang, *CFLAGS, *includes, "-c", str(source), "-o", str(obj)]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"compiling {source} failed:\n{result.stderr.strip()}")
        return obj.read_bytes()


def build_shared_object(
    sources: Sequence[Path], out: Path | None = None, include_dirs: Sequence[Path] = (INCLUDE_DIR,)
) -> bytes:
    """Compile ``sources`` (linked in the order given) into SBPFv0 .so bytes, written to ``out`` if set.

    Objects are named by file name in link errors; the bytes do not depend on where the sources live.
    """
    if not sources:
        raise BuildError("no C sources to build")
    objects = [(Path(s).name, compile_object(Path(s), include_dirs)) for s in sources]
    try:
        image = link(objects)
    except LinkError as exc:
        raise BuildError(f"linking failed: {exc}") from exc
    if out is not None:
        Path(out).write_bytes(image)
    return image


def program_sources(source_dir: Path = SOURCE_DIR) -> list[Path]:
    """The coordinator's C sources, sorted by name so the link order (and the .so) is reproducible."""
    return sorted(source_dir.glob("*.c"))


def describe_difference(built: bytes, committed: bytes) -> str:
    """Say where two images first differ, naming the ELF region, so a failed --check is actionable."""
    if len(built) != len(committed):
        prefix = f"sizes differ (rebuilt {len(built)} bytes, committed {len(committed)} bytes); "
    else:
        prefix = ""
    first = next((i for i, (a, b) in enumerate(zip(built, committed, strict=False)) if a != b), None)
    if first is None:
        return prefix + "one is a prefix of the other"
    return prefix + f"first difference at byte 0x{first:x} ({_region(built, first)})"


def _region(image: bytes, offset: int) -> str:
    """Name of the section holding ``offset`` in a linked image, or which headers hold it."""
    if len(image) < 64 or image[:4] != b"\x7fELF":
        return "not an ELF image"
    (shoff,) = struct.unpack_from("<Q", image, 40)
    shnum, shstrndx = struct.unpack_from("<HH", image, 60)
    if shoff + 64 * shnum > len(image) or shstrndx >= shnum:
        return "malformed section headers"
    if offset >= shoff:
        return "section headers"
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + 64 * i) for i in range(shnum)]
    strtab_off = headers[shstrndx][4]
    for name, _type, _flags, _addr, sh_offset, size, *_ in headers[1:]:
        if sh_offset <= offset < sh_offset + size:
            end = image.index(b"\0", strtab_off + name)
            return image[strtab_off + name : end].decode(errors="replace")
    return "ELF or program headers" if offset < headers[1][4] else "padding between sections"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="rebuild and compare with the committed .so")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUTPUT, help="the .so to write (or compare with)")
    parser.add_argument("--src", type=Path, default=SOURCE_DIR, help="directory of the program's *.c files")
    args = parser.parse_args(argv)
    sources = program_sources(args.src)
    try:
        if not sources:
            raise BuildError(f"no C sources in {args.src}")
        if not args.check:
            image = build_shared_object(sources, args.out)
            print(f"wrote {args.out} ({len(image)} bytes) from {len(sources)} source(s)")
            return 0
        with tempfile.TemporaryDirectory(prefix="psy-check-") as tmp:
            image = build_shared_object(sources, Path(tmp) / DEFAULT_OUTPUT.name)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.out.exists():
        print(
            f"error: {args.out} does not exist; build it with `make -C coordinator_program/program`",
            file=sys.stderr,
        )
        return 1
    committed = args.out.read_bytes()
    if image != committed:
        print(
            f"error: {args.out} is not what the sources build: {describe_difference(image, committed)}; "
            "rebuild it with `make -C coordinator_program/program` and commit it",
            file=sys.stderr,
        )
        return 1
    print(f"{args.out} matches a fresh build ({len(image)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
