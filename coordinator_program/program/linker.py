"""Link clang-14's relocatable BPF objects into the SBPFv0 shared object Solana's BPF loader accepts.

Solana's own toolchain (platform-tools, its patched lld) cannot be installed here, and upstream lld and
GNU ld cannot emit the ELF the loader wants. This module is the missing step: it reads the ET_REL objects
upstream clang-14 writes for ``-target bpf``, merges their ``.text*`` and ``.rodata*`` sections, resolves
every relocation it can at link time and writes an ET_DYN image laid out the way the loader checks it
(see ``shared/notes/sbf-toolchain.md``):

* ELF header, program headers, then ``.text .rodata .dynamic .dynsym .dynstr .rel.dyn .shstrtab`` with
  every loaded section's address equal to its file offset;
* read-only data addresses are pre-resolved to ``0x1_0000_0000 + file offset``, where the VM maps them,
  so no ``R_BPF_64_RELATIVE`` entries are needed;
* calls between functions (static or not, in any object) become pc-relative immediates, which the loader
  registers as call targets itself;
* calls to syscalls stay ``call -1`` with an undefined dynamic symbol and an ``R_BPF_64_32`` dynamic
  relocation, which the loader rewrites to the syscall's hash.

The output depends only on the input bytes and their order, so a committed ``.so`` can be checked by
rebuilding it. Anything the loader or the SBPFv0 VM would reject, or would run with different semantics
(writable globals, 32-bit jumps or arithmetic, atomics, unknown syscalls), is a ``LinkError`` naming the
culprit instead of an opaque failure at deploy time.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

# --- ELF constants (only the ones this linker reads or writes) -------------------------------------
_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_EV_CURRENT = 1
_ET_REL = 1
_ET_DYN = 3
_EM_BPF = 247

_SHT_PROGBITS = 1
_SHT_SYMTAB = 2
_SHT_STRTAB = 3
_SHT_RELA = 4
_SHT_DYNAMIC = 6
_SHT_NOBITS = 8
_SHT_REL = 9
_SHT_DYNSYM = 11

_SHF_WRITE = 0x1
_SHF_ALLOC = 0x2
_SHF_EXECINSTR = 0x4

_SHN_UNDEF = 0
_SHN_ABS = 0xFFF1
_SHN_COMMON = 0xFFF2

_STB_GLOBAL = 1
_STB_WEAK = 2
_STT_NOTYPE = 0
_STT_SECTION = 3
_STT_FILE = 4

_PT_LOAD = 1
_PT_DYNAMIC = 2
_PF_X = 1
_PF_W = 2
_PF_R = 4

_DT_NULL = 0
_DT_STRTAB = 5
_DT_SYMTAB = 6
_DT_STRSZ = 10
_DT_SYMENT = 11
_DT_REL = 17
_DT_RELSZ = 18
_DT_RELENT = 19

_R_BPF_64_64 = 1
_R_BPF_64_ABS64 = 2
_R_BPF_64_32 = 10
_RELOC_NAMES = {
    0: "R_BPF_NONE",
    1: "R_BPF_64_64",
    2: "R_BPF_64_ABS64",
    3: "R_BPF_64_ABS32",
    4: "R_BPF_64_NODYLD32",
    8: "R_BPF_64_RELATIVE",
    10: "R_BPF_64_32",
}

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SYM = struct.Struct("<IBBHQQ")
_REL = struct.Struct("<QQ")
_DYN = struct.Struct("<qQ")

# --- SBPFv0 facts ---------------------------------------------------------------------------------------
MM_RODATA_START = 0x1_0000_0000
"""Where the VM maps the read-only region (``.text`` and ``.rodata``): an address is this plus the offset."""

ENTRYPOINT = "entrypoint"
"""The loader starts execution at ``e_entry``; by convention it is this global function."""

_INSN = 8
_OP_LDDW = 0x18
_OP_CALL = 0x85
_OP_LE = 0xD4
_OP_BE = 0xDC
_CLASS_LD = 0x00
_CLASS_STX = 0x03
_CLASS_ALU = 0x04
_CLASS_JMP32 = 0x06
_MODE_ATOMIC = 0xC0

KNOWN_SYSCALLS: frozenset[str] = frozenset(
    {
        "abort",
        "sol_panic_",
        "sol_log_",
        "sol_log_64_",
        "sol_log_compute_units_",
        "sol_log_pubkey",
        "sol_log_data",
        "sol_create_program_address",
        "sol_try_find_program_address",
        "sol_sha256",
        "sol_keccak256",
        "sol_blake3",
        "sol_secp256k1_recover",
        "sol_poseidon",
        "sol_curve_validate_point",
        "sol_curve_group_op",
        "sol_curve_multiscalar_mul",
        "sol_alt_bn128_group_op",
        "sol_alt_bn128_compression",
        "sol_big_mod_exp",
        "sol_get_clock_sysvar",
        "sol_get_epoch_schedule_sysvar",
        "sol_get_rent_sysvar",
        "sol_get_epoch_rewards_sysvar",
        "sol_get_last_restart_slot",
        "sol_get_sysvar",
        "sol_get_epoch_stake",
        "sol_memcpy_",
        "sol_memmove_",
        "sol_memcmp_",
        "sol_memset_",
        "sol_invoke_signed_c",
        "sol_invoke_signed_rust",
        "sol_set_return_data",
        "sol_get_return_data",
        "sol_get_stack_height",
        "sol_get_processed_sibling_instruction",
        "sol_remaining_compute_units",
    }
)
"""Syscalls the SBPFv0 loader of Agave 2.2 (as bundled in solders' LiteSVM) resolves by name.

An undefined symbol outside this set would only fail at deploy time ("Unresolved symbol"), so the
linker rejects it up front; tests/program checks that a program calling every one of these loads.
"""


class LinkError(ValueError):
    """The objects cannot become a loadable SBPFv0 program; the message names the object and symbol."""


@dataclass(frozen=True)
class _Section:
    index: int
    name: str
    type: int
    flags: int
    size: int
    link: int
    info: int
    align: int
    data: bytes


@dataclass(frozen=True)
class _Symbol:
    name: str
    value: int
    bind: int
    type: int
    shndx: int


@dataclass(frozen=True)
class _Object:
    name: str
    sections: tuple[_Section, ...]
    symbols: tuple[_Symbol, ...]


@dataclass(frozen=True)
class _Placed:
    """A symbol's final location: ``kind`` is "text" or "rodata", ``offset`` from that section's start."""

    kind: str
    offset: int


def _cstring(table: bytes, offset: int, what: str) -> str:
    end = table.find(b"\0", offset)
    if offset >= len(table) or end < 0:
        raise LinkError(f"{what}: string offset {offset} outside its string table")
    return table[offset:end].decode("utf-8", "replace")


def _parse(name: str, data: bytes) -> _Object:
    """Read the parts of a relocatable object the link needs, checking it is clang's BPF output."""
    if len(data) < _EHDR.size or data[:4] != _ELF_MAGIC:
        raise LinkError(f"{name}: not an ELF file")
    (
        ident,
        e_type,
        e_machine,
        _ver,
        _entry,
        _phoff,
        shoff,
        _flags,
        _ehsize,
        _phentsize,
        _phnum,
        shentsize,
        shnum,
        shstrndx,
    ) = _EHDR.unpack_from(data)
    if ident[4] != _ELFCLASS64 or ident[5] != _ELFDATA2LSB:
        raise LinkError(f"{name}: not a 64-bit little-endian ELF (compile with -target bpf, i.e. bpfel)")
    if e_machine != _EM_BPF:
        raise LinkError(f"{name}: e_machine is {e_machine}, not EM_BPF (247); compile with -target bpf")
    if e_type != _ET_REL:
        raise LinkError(f"{name}: e_type is {e_type}, expected a relocatable object (clang -c)")
    if shentsize != _SHDR.size or shoff + shnum * _SHDR.size > len(data) or shstrndx >= shnum:
        raise LinkError(f"{name}: malformed section header table")
    raw = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    for sh in raw:
        if sh[1] != _SHT_NOBITS and sh[4] + sh[5] > len(data):
            raise LinkError(f"{name}: a section extends past the end of the file")
    shstr = data[raw[shstrndx][4] : raw[shstrndx][4] + raw[shstrndx][5]]
    sections = tuple(
        _Section(
            index=i,
            name=_cstring(shstr, sh_name, name),
            type=sh_type,
            flags=sh_flags,
            size=sh_size,
            link=sh_link,
            info=sh_info,
            align=max(sh_align, 1),
            data=b"" if sh_type == _SHT_NOBITS else data[sh_offset : sh_offset + sh_size],
        )
        for i, (
            sh_name,
            sh_type,
            sh_flags,
            _addr,
            sh_offset,
            sh_size,
            sh_link,
            sh_info,
            sh_align,
            _ent,
        ) in enumerate(raw)
    )
    symtabs = [s for s in sections if s.type == _SHT_SYMTAB]
    if len(symtabs) > 1:
        raise LinkError(f"{name}: more than one symbol table")
    symbols: tuple[_Symbol, ...] = ()
    if symtabs:
        symtab = symtabs[0]
        if symtab.size % _SYM.size or symtab.link >= len(sections):
            raise LinkError(f"{name}: malformed symbol table")
        strtab = sections[symtab.link].data
        symbols = tuple(
            _Symbol(_cstring(strtab, st_name, name), st_value, st_info >> 4, st_info & 0xF, st_shndx)
            for st_name, st_info, _other, st_shndx, st_value, _size in _SYM.iter_unpack(symtab.data)
        )
    return _Object(name, sections, symbols)


def _is_text(section: _Section) -> bool:
    return bool(section.flags & _SHF_ALLOC and section.flags & _SHF_EXECINSTR)


def _is_rodata(section: _Section) -> bool:
    return bool(section.flags & _SHF_ALLOC) and not section.flags & (_SHF_WRITE | _SHF_EXECINSTR)


def _is_writable(section: _Section) -> bool:
    return bool(section.flags & _SHF_ALLOC and (section.flags & _SHF_WRITE or section.type == _SHT_NOBITS))


def _check_sections(obj: _Object) -> None:
    """Reject allocated sections the SBPFv0 loader has no place for, naming the globals that caused them."""
    mutable: list[str] = []
    for section in obj.sections:
        if not section.flags & _SHF_ALLOC:
            continue
        if _is_writable(section):
            if section.size == 0:
                continue
            names = [
                s.name
                for s in obj.symbols
                if s.shndx == section.index and s.type not in (_STT_SECTION, _STT_FILE) and s.name
            ]
            mutable.append(
                ", ".join(f"'{n}'" for n in names) + f" in {section.name}" if names else section.name
            )
        elif _is_text(section):
            if section.name != ".text" and not section.name.startswith(".text."):
                raise LinkError(f"{obj.name}: executable section {section.name} is not supported")
            if section.type != _SHT_PROGBITS or section.size % _INSN:
                raise LinkError(f"{obj.name}: {section.name} is not a whole number of BPF instructions")
        elif section.type != _SHT_PROGBITS or not (
            section.name == ".rodata" or section.name.startswith(".rodata.")
        ):
            raise LinkError(
                f"{obj.name}: allocated section {section.name} (type {section.type}) is not supported"
            )
    mutable += [f"'{s.name}' (common symbol)" for s in obj.symbols if s.shndx == _SHN_COMMON]
    if mutable:
        raise LinkError(
            f"{obj.name}: mutable global data is not supported by SBPFv0 (the loader rejects writable "
            f"sections): {'; '.join(mutable)}. Make it const, or keep the state in account data or the heap."
        )


def _check_instructions(text: bytes | bytearray, where: dict[int, str]) -> None:
    """Reject instructions that SBPFv0 lacks or runs differently from upstream BPF (JMP32, ALU32, atomics)."""
    pc = 0
    while pc < len(text):
        opcode = text[pc]
        cls = opcode & 0x07
        problem = ""
        if cls == _CLASS_JMP32:
            problem = "a 32-bit jump (JMP32), which SBPFv0 lacks: compile with -mcpu=v2, not v3"
        elif cls == _CLASS_ALU and opcode not in (_OP_LE, _OP_BE):
            problem = "32-bit arithmetic (ALU32), which SBPFv0 sign-extends: compile with -mcpu=v2, no +alu32"
        elif cls == _CLASS_STX and opcode & 0xE0 == _MODE_ATOMIC:
            problem = "an atomic operation, which SBPFv0 lacks"
        elif cls == _CLASS_LD and opcode != _OP_LDDW:
            problem = "a legacy packet load, which SBPFv0 lacks"
        if problem:
            owner = max((start for start in where if start <= pc), default=0)
            raise LinkError(
                f"instruction 0x{opcode:02x} at {where.get(owner, '.text')}+0x{pc - owner:x} is {problem}"
            )
        pc += 2 * _INSN if opcode == _OP_LDDW else _INSN
    if text and text[-_INSN] == _OP_LDDW:
        raise LinkError(".text ends in the middle of a 16-byte lddw instruction")


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _code_offsets(text_len: int, rodata_len: int, rodata_align: int) -> tuple[int, int]:
    """File offsets (== addresses) of .text and .rodata: right after the headers, as the loader expects.

    The relocation step needs the .rodata offset before the image is written, so both use this.
    """
    phnum = 4 if rodata_len else 3
    text_off = _align(_EHDR.size + phnum * _PHDR.size, 8)
    return text_off, _align(text_off + text_len, rodata_align)


class _Linker:
    """One link: placement of every input section, the global symbol table, then relocation."""

    def __init__(self, objects: Sequence[_Object]) -> None:
        self.objects = objects
        self.text = bytearray()
        self.rodata = bytearray()
        self.rodata_align = 8
        self.base: dict[tuple[int, int], _Placed] = {}
        self.text_origin: dict[int, str] = {}
        self.globals: dict[str, tuple[_Placed, int, str]] = {}
        self.syscall_sites: list[tuple[int, str]] = []
        self.rodata_address = 0

    def place(self) -> None:
        """Concatenate every object's text and rodata sections in input order (deterministic)."""
        for oi, obj in enumerate(self.objects):
            for section in obj.sections:
                if _is_text(section):
                    self.text_origin[len(self.text)] = f"{obj.name}:{section.name}"
                    self.base[(oi, section.index)] = _Placed("text", len(self.text))
                    self.text += section.data
                elif _is_rodata(section):
                    start = _align(len(self.rodata), section.align)
                    self.rodata += bytes(start - len(self.rodata)) + section.data
                    self.rodata_align = max(self.rodata_align, section.align)
                    self.base[(oi, section.index)] = _Placed("rodata", start)
        # the sizes are final now, so the VM address where .rodata will be mapped is known
        rodata_offset = _code_offsets(len(self.text), len(self.rodata), self.rodata_align)[1]
        self.rodata_address = MM_RODATA_START + rodata_offset

    def collect_globals(self) -> None:
        """Build the cross-object symbol table: one strong definition per name, weak ones yield to it."""
        for oi, obj in enumerate(self.objects):
            for sym in obj.symbols:
                if sym.bind not in (_STB_GLOBAL, _STB_WEAK) or sym.shndx == _SHN_UNDEF:
                    continue
                placed = self._placed(oi, sym)
                if placed is None:
                    continue
                previous = self.globals.get(sym.name)
                if previous is not None and previous[1] == _STB_GLOBAL and sym.bind == _STB_GLOBAL:
                    raise LinkError(f"symbol '{sym.name}' is defined in both {previous[2]} and {obj.name}")
                if previous is None or previous[1] == _STB_WEAK and sym.bind == _STB_GLOBAL:
                    self.globals[sym.name] = (placed, sym.bind, obj.name)

    def _placed(self, oi: int, sym: _Symbol) -> _Placed | None:
        base = self.base.get((oi, sym.shndx))
        return None if base is None else _Placed(base.kind, base.offset + sym.value)

    def _resolve(self, oi: int, sym: _Symbol) -> _Placed | None:
        """Where a relocation's symbol lives; None means an external name (a syscall).

        Global and weak names go through the cross-object table, so a strong definition elsewhere wins
        over a weak one in this object; local symbols (static functions, sections) stay in their object.
        """
        if sym.bind in (_STB_GLOBAL, _STB_WEAK) or sym.shndx == _SHN_UNDEF:
            found = self.globals.get(sym.name)
            if found is not None or sym.shndx == _SHN_UNDEF:
                return None if found is None else found[0]
        placed = self._placed(oi, sym)
        if placed is None:
            what = "an absolute symbol" if sym.shndx == _SHN_ABS else f"section #{sym.shndx}"
            raise LinkError(
                f"{self.objects[oi].name}: reference to '{sym.name}' in {what}, which is not linked"
            )
        return placed

    def relocate(self) -> None:
        for oi, obj in enumerate(self.objects):
            for rel in obj.sections:
                if rel.type not in (_SHT_REL, _SHT_RELA) or rel.info >= len(obj.sections):
                    continue
                target = obj.sections[rel.info]
                if not target.flags & _SHF_ALLOC:
                    continue  # debug information, dropped from the output
                if rel.type == _SHT_RELA:
                    raise LinkError(f"{obj.name}: RELA relocations ({rel.name}) are not supported")
                base = self.base[(oi, target.index)]
                for r_offset, r_info in _REL.iter_unpack(rel.data):
                    sym_index, r_type = r_info >> 32, r_info & 0xFFFFFFFF
                    if sym_index >= len(obj.symbols):
                        raise LinkError(f"{obj.name}: relocation in {rel.name} names symbol #{sym_index}")
                    self._apply(oi, target, base, r_offset, r_type, obj.symbols[sym_index])

    def _apply(
        self, oi: int, section: _Section, base: _Placed, r_offset: int, r_type: int, sym: _Symbol
    ) -> None:
        obj = self.objects[oi]
        where = f"{obj.name}:{section.name}+0x{r_offset:x}"
        label = sym.name or f"section #{sym.shndx}"
        if r_offset + _INSN > section.size:
            raise LinkError(f"{where}: relocation outside its section")
        placed = self._resolve(oi, sym)
        out = self.text if base.kind == "text" else self.rodata
        at = base.offset + r_offset
        if base.kind == "text" and r_type == _R_BPF_64_32 and section.data[r_offset] == _OP_CALL:
            if placed is None:
                if sym.name not in KNOWN_SYSCALLS:
                    raise LinkError(
                        f"{where}: call to undefined function '{sym.name}': no object defines it and it is "
                        "not a known Solana syscall"
                    )
                struct.pack_into("<i", out, at + 4, -1)
                self.syscall_sites.append((at, sym.name))
                return
            if placed.kind != "text":
                raise LinkError(f"{where}: call to '{label}', which is data, not a function")
            (imm,) = struct.unpack_from("<i", section.data, r_offset + 4)
            destination = placed.offset + (imm + 1) * _INSN
            if destination % _INSN or not 0 <= destination < len(self.text):
                raise LinkError(f"{where}: call to '{label}' lands outside .text")
            struct.pack_into("<i", out, at + 4, (destination - at - _INSN) // _INSN)
            return
        if placed is None:
            raise LinkError(f"{where}: reference to undefined symbol '{sym.name}'")
        if placed.kind == "text":
            raise LinkError(
                f"{where}: taking the address of function '{label}' is not supported (no indirect calls)"
            )
        if base.kind == "text" and r_type == _R_BPF_64_64 and section.data[r_offset] == _OP_LDDW:
            if r_offset + 2 * _INSN > section.size:
                raise LinkError(f"{where}: lddw cut off at the end of its section")
            (low,) = struct.unpack_from("<I", section.data, r_offset + 4)
            (high,) = struct.unpack_from("<I", section.data, r_offset + 12)
            addend = high << 32 | low
            address = self.rodata_address + placed.offset + addend
            struct.pack_into("<I", out, at + 4, address & 0xFFFFFFFF)
            struct.pack_into("<I", out, at + 12, address >> 32)
            return
        if base.kind == "rodata" and r_type == _R_BPF_64_ABS64:
            (addend,) = struct.unpack_from("<Q", section.data, r_offset)
            struct.pack_into("<Q", out, at, self.rodata_address + placed.offset + addend)
            return
        name = _RELOC_NAMES.get(r_type, f"type {r_type}")
        raise LinkError(f"{where}: unsupported relocation {name} against '{label}'")

    def entry(self) -> int:
        found = self.globals.get(ENTRYPOINT)
        if found is None or found[0].kind != "text":
            raise LinkError(f"no object defines the global function '{ENTRYPOINT}'")
        return found[0].offset


def _section_header(
    name: int,
    sh_type: int,
    flags: int,
    offset: int,
    size: int,
    link: int = 0,
    info: int = 0,
    align: int = 1,
    entsize: int = 0,
) -> bytes:
    """A section header of the output: every loaded section's address equals its file offset."""
    addr = offset if flags & _SHF_ALLOC else 0
    return _SHDR.pack(name, sh_type, flags, addr, offset, size, link, info, align, entsize)


def _emit(
    text: bytes, rodata: bytes, rodata_align: int, entry: int, syscall_sites: list[tuple[int, str]]
) -> bytes:
    """Lay out and serialise the shared object (all offsets are computed before any byte is written)."""
    names = sorted({name for _, name in syscall_sites})
    dynstr = bytearray(b"\0")
    name_offset: dict[str, int] = {}
    for name in names:
        name_offset[name] = len(dynstr)
        dynstr += name.encode() + b"\0"
    dynsym = bytes(_SYM.size) + b"".join(
        _SYM.pack(name_offset[n], _STB_GLOBAL << 4 | _STT_NOTYPE, 0, _SHN_UNDEF, 0, 0) for n in names
    )
    sym_index = {n: i + 1 for i, n in enumerate(names)}

    has_rodata = bool(rodata)
    text_off, rodata_off = _code_offsets(len(text), len(rodata), rodata_align)
    dynamic_off = _align(rodata_off + len(rodata) if has_rodata else text_off + len(text), 8)
    dyn_entries = 5 + (3 if syscall_sites else 0)  # DT_NULL included
    dynsym_off = dynamic_off + dyn_entries * _DYN.size
    dynstr_off = dynsym_off + len(dynsym)
    rel_off = _align(dynstr_off + len(dynstr), 8)
    # text offsets in the sites are relative to .text; the loader wants file offsets (== addresses here)
    reldyn = b"".join(
        _REL.pack(text_off + at, sym_index[name] << 32 | _R_BPF_64_32) for at, name in sorted(syscall_sites)
    )
    shstrtab_off = rel_off + len(reldyn)

    section_names = [".text", ".rodata", ".dynamic", ".dynsym", ".dynstr", ".rel.dyn", ".shstrtab"]
    kept = [n for n in section_names if (n != ".rodata" or has_rodata) and (n != ".rel.dyn" or reldyn)]
    shstrtab = bytearray(b"\0")
    shname: dict[str, int] = {}
    for n in kept:
        shname[n] = len(shstrtab)
        shstrtab += n.encode() + b"\0"
    shdr_off = _align(shstrtab_off + len(shstrtab), 8)
    index = {n: i + 1 for i, n in enumerate(kept)}

    dynamic = [
        (_DT_SYMTAB, dynsym_off),
        (_DT_STRTAB, dynstr_off),
        (_DT_STRSZ, len(dynstr)),
        (_DT_SYMENT, _SYM.size),
    ]
    if reldyn:
        dynamic += [(_DT_REL, rel_off), (_DT_RELSZ, len(reldyn)), (_DT_RELENT, _REL.size)]
    dynamic.append((_DT_NULL, 0))
    dynamic_bytes = b"".join(_DYN.pack(tag, value) for tag, value in dynamic)
    dyn_end = rel_off + len(reldyn)

    phdrs = [_PHDR.pack(_PT_LOAD, _PF_R | _PF_X, text_off, text_off, text_off, len(text), len(text), 0x1000)]
    if has_rodata:
        phdrs.append(
            _PHDR.pack(_PT_LOAD, _PF_R, rodata_off, rodata_off, rodata_off, len(rodata), len(rodata), 0x1000)
        )
    span = dyn_end - dynamic_off
    phdrs.append(_PHDR.pack(_PT_LOAD, _PF_R, dynamic_off, dynamic_off, dynamic_off, span, span, 0x1000))
    phdrs.append(
        _PHDR.pack(
            _PT_DYNAMIC,
            _PF_R | _PF_W,
            dynamic_off,
            dynamic_off,
            dynamic_off,
            len(dynamic_bytes),
            len(dynamic_bytes),
            8,
        )
    )

    shdrs = [
        bytes(_SHDR.size),
        _section_header(
            shname[".text"], _SHT_PROGBITS, _SHF_ALLOC | _SHF_EXECINSTR, text_off, len(text), align=8
        ),
    ]
    if has_rodata:
        shdrs.append(
            _section_header(
                shname[".rodata"], _SHT_PROGBITS, _SHF_ALLOC, rodata_off, len(rodata), align=rodata_align
            )
        )
    shdrs += [
        _section_header(
            shname[".dynamic"],
            _SHT_DYNAMIC,
            _SHF_ALLOC | _SHF_WRITE,
            dynamic_off,
            len(dynamic_bytes),
            link=index[".dynstr"],
            align=8,
            entsize=_DYN.size,
        ),
        _section_header(
            shname[".dynsym"],
            _SHT_DYNSYM,
            _SHF_ALLOC,
            dynsym_off,
            len(dynsym),
            link=index[".dynstr"],
            info=1,
            align=8,
            entsize=_SYM.size,
        ),
        _section_header(shname[".dynstr"], _SHT_STRTAB, _SHF_ALLOC, dynstr_off, len(dynstr)),
    ]
    if reldyn:
        shdrs.append(
            _section_header(
                shname[".rel.dyn"],
                _SHT_REL,
                _SHF_ALLOC,
                rel_off,
                len(reldyn),
                link=index[".dynsym"],
                align=8,
                entsize=_REL.size,
            )
        )
    shdrs.append(_section_header(shname[".shstrtab"], _SHT_STRTAB, 0, shstrtab_off, len(shstrtab)))

    ident = _ELF_MAGIC + bytes([_ELFCLASS64, _ELFDATA2LSB, _EV_CURRENT]) + bytes(9)
    header = _EHDR.pack(
        ident,
        _ET_DYN,
        _EM_BPF,
        _EV_CURRENT,
        text_off + entry,
        _EHDR.size,
        shdr_off,
        0,
        _EHDR.size,
        _PHDR.size,
        len(phdrs),
        _SHDR.size,
        len(shdrs),
        index[".shstrtab"],
    )

    image = bytearray(shdr_off + len(shdrs) * _SHDR.size)
    for offset, blob in [
        (0, header),
        (_EHDR.size, b"".join(phdrs)),
        (text_off, text),
        (rodata_off, rodata),
        (dynamic_off, dynamic_bytes),
        (dynsym_off, dynsym),
        (dynstr_off, dynstr),
        (rel_off, reldyn),
        (shstrtab_off, shstrtab),
        (shdr_off, b"".join(shdrs)),
    ]:
        image[offset : offset + len(blob)] = blob
    return bytes(image)


def link(objects: Sequence[tuple[str, bytes]]) -> bytes:
    """Link named relocatable BPF objects (``(name, bytes)``, in a fixed order) into SBPFv0 .so bytes.

    The names only appear in error messages; the output is a pure function of the bytes and their order.
    """
    if not objects:
        raise LinkError("nothing to link: no objects given")
    parsed = [_parse(name, data) for name, data in objects]
    for obj in parsed:
        _check_sections(obj)
    linker = _Linker(parsed)
    linker.place()
    if not linker.text:
        raise LinkError("the objects contain no code")
    linker.collect_globals()
    linker.relocate()
    entry = linker.entry()
    _check_instructions(linker.text, linker.text_origin)
    return _emit(bytes(linker.text), bytes(linker.rodata), linker.rodata_align, entry, linker.syscall_sites)
