"""The C → clang-14 → linker.py → SBPFv0 toolchain, proven by running fixture programs in LiteSVM.

Each fixture (tests/program/fixtures) exercises one part of psy_sdk.h or the linker, and each test checks
an observable effect: account bytes, return data, logs, transaction errors, or a link error's message.
"""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from sbpf_harness import (
    FIXTURES,
    MEASURED,
    Chain,
    DeployError,
    failed,
    fixture_sources,
    ok,
    readonly,
    writable,
)
from solders.clock import Clock
from solders.pubkey import Pubkey
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.transaction_metadata import FailedTransactionMetadata, TransactionMetadata
from solders.transaction_status import (
    InstructionErrorCustom,
    InstructionErrorFieldless,
    TransactionErrorInstructionError,
)

from coordinator_program.program import build, linker
from coordinator_program.program.build import CFLAGS, BuildError, build_shared_object, compile_object
from coordinator_program.program.linker import KNOWN_SYSCALLS, LinkError, link

Program = Callable[[str], bytes]


def instruction_error(result: TransactionMetadata | FailedTransactionMetadata) -> object:
    """The InstructionError of a failed single-instruction transaction."""
    err = failed(result).err()
    assert isinstance(err, TransactionErrorInstructionError), err
    assert err.index == 0
    return err.err


def section_names(image: bytes) -> list[str]:
    (shoff,) = struct.unpack_from("<Q", image, 40)
    shnum, shstrndx = struct.unpack_from("<HH", image, 60)
    headers = [struct.unpack_from("<IIQQQQIIQQ", image, shoff + 64 * i) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    return [image[strtab + h[0] : image.index(b"\0", strtab + h[0])].decode() for h in headers[1:]]


# --- (a) sol_sha256 into a program-owned account ------------------------------------------------------


@pytest.mark.parametrize("via_loader_v3", [False, True], ids=["add_program", "loader_v3"])
@pytest.mark.parametrize(
    "data", [b"", b"x", bytes(range(64)), b"psyswarm" * 120], ids=["0", "1", "64", "960"]
)
def test_sha256_of_instruction_data_is_stored_in_account(
    program: Program, data: bytes, via_loader_v3: bool
) -> None:
    chain = Chain(program("sha256_account"), via_loader_v3)
    target = chain.program_account(40)
    meta = ok(chain.send([writable(target)], data))
    digest = hashlib.sha256(data).digest()
    assert chain.data(target) == digest + bytes(8)
    assert bytes(meta.return_data().data) == digest
    assert meta.return_data().program_id == chain.program_id
    assert "Program log: sha256 stored" in meta.logs()
    if len(data) == 64:
        MEASURED["sha256 of 64 bytes into an account"] = meta.compute_units_consumed()


def test_sha256_program_checks_owner_and_size(program: Program) -> None:
    chain = Chain(program("sha256_account"))
    small = chain.program_account(31)
    foreign = chain.program_account(64, owner=Pubkey.new_unique())
    assert (
        instruction_error(chain.send([writable(small)], b"a"))
        == InstructionErrorFieldless.AccountDataTooSmall
    )
    assert (
        instruction_error(chain.send([writable(foreign)], b"a"))
        == InstructionErrorFieldless.InvalidAccountOwner
    )
    assert chain.data(small) == bytes(31)


# --- (b) the Clock (and Rent) sysvars ------------------------------------------------------------------


@pytest.mark.parametrize("space", [0, 100, 10_240])
def test_clock_sysvar_and_rent_minimum_are_read(program: Program, space: int) -> None:
    chain = Chain(program("sysvars"))
    target = chain.program_account(48)
    chain.svm.set_clock(Clock(4242, 1_700_000_000, 7, 8, 1_700_000_123))
    meta = ok(chain.send([writable(target)], struct.pack("<Q", space)))
    data = chain.data(target)
    assert struct.unpack_from("<QqQQq", data) == (4242, 1_700_000_000, 7, 8, 1_700_000_123)
    assert struct.unpack_from("<Q", data, 40)[0] == chain.svm.minimum_balance_for_rent_exemption(space)
    MEASURED["clock sysvar + rent minimum"] = meta.compute_units_consumed()


# --- heap allocator ---------------------------------------------------------------------------------------


def test_heap_allocator_is_bump_aligned_zeroed_and_bounded(program: Program) -> None:
    chain = Chain(program("heap"))
    target = chain.program_account(64)
    sizes = [1, 8, 100, 32 * 1024, 16]
    meta = ok(chain.send([writable(target)], struct.pack(f"<{len(sizes)}I", *sizes)))
    start = 0x3_0000_0000 + 8  # the first heap word holds the cursor
    expected = [start, start + 8, start + 16, 0, start + 16 + 104]
    assert list(struct.unpack_from(f"<{len(sizes)}Q", chain.data(target))) == expected
    MEASURED["heap: 5 allocations, 125 bytes filled"] = meta.compute_units_consumed()
    # the whole heap minus the cursor word fits exactly once; then nothing is left
    ok(chain.send([writable(target)], struct.pack("<2I", 32 * 1024 - 8, 1)))
    assert struct.unpack_from("<2Q", chain.data(target)) == (start, 0)


# --- (c) CPI: creating a PDA through the system program, and a transfer ------------------------------------


@pytest.mark.parametrize("via_loader_v3", [False, True], ids=["add_program", "loader_v3"])
def test_cpi_creates_pda_owned_by_program(program: Program, via_loader_v3: bool) -> None:
    chain = Chain(program("cpi_pda"), via_loader_v3)
    run_id = (0x0123_4567_89AB_CDEF).to_bytes(8, "little")
    pda, bump = Pubkey.find_program_address([b"coordinator", run_id], chain.program_id)
    space = 600
    accounts = [writable(chain.payer.pubkey(), signer=True), writable(pda), readonly(SYSTEM_PROGRAM_ID)]
    meta = ok(chain.send(accounts, b"\x00" + run_id + struct.pack("<Q", space)))
    account = chain.svm.get_account(pda)
    assert account is not None
    assert account.owner == chain.program_id
    assert len(account.data) == space
    assert account.lamports == chain.svm.minimum_balance_for_rent_exemption(space)
    assert bytes(account.data[:9]) == bytes([bump]) + run_id
    assert bytes(account.data[9:]) == bytes(space - 9)
    assert f"Program log: {pda}" in meta.logs()
    # find_program_address costs 1,500 CU per bump tried (from 255 down), so the figure depends on the id
    MEASURED[f"CPI: create PDA (600 B, {256 - bump} bump tries)"] = meta.compute_units_consumed()
    # the system program refuses to create it twice (SystemError::AccountAlreadyInUse = Custom(0))
    assert instruction_error(chain.send(accounts, b"\x00" + run_id + struct.pack("<Q", space))) == (
        InstructionErrorCustom(0)
    )


def test_cpi_rejects_account_that_is_not_the_pda(program: Program) -> None:
    chain = Chain(program("cpi_pda"))
    impostor = Pubkey.new_unique()
    accounts = [writable(chain.payer.pubkey(), signer=True), writable(impostor), readonly(SYSTEM_PROGRAM_ID)]
    result = chain.send(accounts, b"\x00" + bytes(8) + struct.pack("<Q", 16))
    assert instruction_error(result) == InstructionErrorFieldless.InvalidSeeds
    assert chain.svm.get_account(impostor) is None


def test_cpi_transfer_moves_lamports(program: Program) -> None:
    chain = Chain(program("cpi_pda"))
    recipient = Pubkey.new_unique()
    before = chain.svm.get_balance(chain.payer.pubkey())
    accounts = [writable(chain.payer.pubkey(), signer=True), writable(recipient), readonly(SYSTEM_PROGRAM_ID)]
    meta = ok(chain.send(accounts, b"\x01" + struct.pack("<Q", 3_000_000)))
    assert chain.svm.get_balance(recipient) == 3_000_000
    assert chain.svm.get_balance(chain.payer.pubkey()) == before - 3_000_000 - 5_000  # one signature's fee
    MEASURED["CPI: system transfer"] = meta.compute_units_consumed()


# --- (d) error codes surface as the runtime's InstructionError -------------------------------------------

_BUILTIN_ORDER = [
    "InvalidArgument",
    "InvalidInstructionData",
    "InvalidAccountData",
    "AccountDataTooSmall",
    "InsufficientFunds",
    "IncorrectProgramId",
    "MissingRequiredSignature",
    "AccountAlreadyInitialized",
    "UninitializedAccount",
    "NotEnoughAccountKeys",
    "MaxSeedLengthExceeded",
    "InvalidSeeds",
    "UnsupportedSysvar",
    "IllegalOwner",
    "InvalidAccountOwner",
    "ArithmeticOverflow",
]


@pytest.mark.parametrize("code", [0, 1, 42, 6000, 2**32 - 1])
def test_custom_error_code_surfaces_as_custom(program: Program, code: int) -> None:
    chain = Chain(program("errors"))
    result = chain.send([], b"\x01" + struct.pack("<I", code))
    assert instruction_error(result) == InstructionErrorCustom(code)
    if code == 42:
        MEASURED["custom error return"] = failed(result).meta().compute_units_consumed()


@pytest.mark.parametrize("n", [0, 3, 999])
def test_anchor_error_codes_start_at_6000(program: Program, n: int) -> None:
    chain = Chain(program("errors"))
    assert instruction_error(chain.send([], b"\x02" + struct.pack("<I", n))) == InstructionErrorCustom(
        6000 + n
    )


@pytest.mark.parametrize("index,name", list(enumerate(_BUILTIN_ORDER)))
def test_builtin_error_constants_map_to_runtime_errors(program: Program, index: int, name: str) -> None:
    chain = Chain(program("errors"))
    assert instruction_error(chain.send([], bytes([3 + index]))) == getattr(InstructionErrorFieldless, name)


def test_success_is_zero(program: Program) -> None:
    ok(Chain(program("errors")).send([], b"\x00"))


# --- (f) duplicate accounts and the rest of the input format -----------------------------------------------


@pytest.mark.parametrize("data", [b"", b"\x01\x02\x03", bytes(range(40))], ids=["empty", "odd", "40"])
def test_duplicate_accounts_deserialize(program: Program, data: bytes) -> None:
    chain = Chain(program("dup_accounts"))
    report = chain.program_account(1024)
    other = chain.program_account(13, owner=Pubkey.new_unique())  # 13: exercises the 8-byte realignment
    payer = chain.payer.pubkey()
    keys = [report, other, payer, other, chain.program_id, report]
    metas = [
        writable(report),
        readonly(other),
        writable(payer, signer=True),
        readonly(other),
        readonly(chain.program_id),
        writable(report),
    ]
    meta = ok(chain.send(metas, data))
    out = chain.data(report)
    assert struct.unpack_from("<Q", out)[0] == len(keys)
    first = [keys.index(k) for k in keys]
    assert first == [0, 1, 2, 1, 4, 0]
    for i, key in enumerate(keys):
        record = out[8 + 56 * i : 8 + 56 * (i + 1)]
        account = chain.svm.get_account(key)
        assert account is not None
        dup_of, is_signer, is_writable, executable = record[:4]
        assert dup_of == first[i]
        assert (is_signer, is_writable, executable) == (
            key == payer,
            key in (report, payer),
            key == chain.program_id,
        )
        assert Pubkey.from_bytes(record[8:40]) == key
        assert struct.unpack_from("<QQ", record, 40) == (account.lamports, len(account.data))
    tail = 8 + 56 * len(keys)
    assert struct.unpack_from("<Q", out, tail)[0] == len(data)
    assert out[tail + 8 : tail + 8 + len(data)] == data
    assert out[tail + 8 + len(data) : tail + 40 + len(data)] == bytes(chain.program_id)
    if data == b"\x01\x02\x03":
        MEASURED["deserialize + report 6 accounts (2 dups)"] = meta.compute_units_consumed()


# --- linker: layouts, multiple objects, determinism, rejections ---------------------------------------------


def test_minimal_program_without_rodata_or_relocations_loads(program: Program) -> None:
    image = program("minimal")
    assert ".rodata" not in section_names(image) and ".rel.dyn" not in section_names(image)
    chain = Chain(image)
    meta = ok(chain.send([], b""))
    MEASURED["minimal (deserialize only)"] = meta.compute_units_consumed()
    assert instruction_error(chain.send([], b"\x07")) == InstructionErrorCustom(7)


def test_multi_object_program_calls_across_objects(program: Program) -> None:
    image = program("multi")
    assert section_names(image) == [
        ".text",
        ".rodata",
        ".dynamic",
        ".dynsym",
        ".dynstr",
        ".rel.dyn",
        ".shstrtab",
    ]
    chain = Chain(image)
    meta = ok(chain.send([], b"Audio equipment"))  # A u i o e u i e: 8 vowels → "many"
    assert bytes(meta.return_data().data) == struct.pack("<Q", 8)
    assert "Program log: counting vowels" in meta.logs()
    assert "Program log: many" in meta.logs()
    MEASURED["multi-object: count vowels in 15 bytes"] = meta.compute_units_consumed()
    meta = ok(chain.send([], b"xyz bot"))
    assert "Program log: one" in meta.logs()


def test_build_is_deterministic_and_independent_of_paths(program: Program, tmp_path: Path) -> None:
    copies = []
    for name in ("a", "b/nested"):
        directory = tmp_path / name
        directory.mkdir(parents=True)
        copies.append(
            build_shared_object([Path(shutil.copy(s, directory)) for s in fixture_sources("cpi_pda")])
        )
    assert copies[0] == copies[1] == program("cpi_pda")
    objects = [(s.name, compile_object(s)) for s in fixture_sources("multi")]
    assert link(objects) == link(list(objects)) == program("multi")


def test_mutable_globals_are_rejected_by_name(needs_clang: None) -> None:
    with pytest.raises(BuildError) as excinfo:
        build_shared_object(fixture_sources("mutable_global"))
    message = str(excinfo.value)
    assert "mutable global" in message
    assert "'call_count' in .bss" in message and "'last_length' in .data" in message


def test_unknown_external_function_is_rejected_by_name(needs_clang: None) -> None:
    with pytest.raises(BuildError, match="call to undefined function 'psy_not_a_syscall'"):
        build_shared_object(fixture_sources("undefined_function"))


def test_duplicate_definitions_are_rejected(needs_clang: None) -> None:
    obj = compile_object(FIXTURES / "minimal.c")
    with pytest.raises(LinkError, match="'entrypoint' is defined in both one.o and two.o"):
        link([("one.o", obj), ("two.o", obj)])


def test_weak_definition_yields_to_strong_one_in_any_order(needs_clang: None, tmp_path: Path) -> None:
    weak = tmp_path / "weak.c"
    weak.write_text(
        "#include <psy_sdk.h>\n"
        "__attribute__((weak)) uint64_t answer(void) { return 1; }\n"
        "uint64_t entrypoint(const uint8_t *input) { (void)input; return PSY_ERROR_CUSTOM(answer()); }\n"
    )
    strong = tmp_path / "strong.c"
    strong.write_text("#include <psy_sdk.h>\nuint64_t answer(void) { return 2; }\n")
    for sources in ([weak, strong], [strong, weak]):
        chain = Chain(build_shared_object(sources))
        assert instruction_error(chain.send([], b"")) == InstructionErrorCustom(2)
    chain = Chain(build_shared_object([weak]))
    assert instruction_error(chain.send([], b"")) == InstructionErrorCustom(1)


def test_mcpu_v3_code_is_rejected(needs_clang: None, tmp_path: Path) -> None:
    flags = [f if f != "-mcpu=v2" else "-mcpu=v3" for f in CFLAGS]
    obj = tmp_path / "heap.o"
    subprocess.run(
        [
            build.find_clang(),
            *flags,
            f"-I{build.INCLUDE_DIR}",
            "-c",
            str(FIXTURES / "heap.c"),
            "-o",
            str(obj),
        ],
        check=True,
    )
    with pytest.raises(LinkError, match=r"heap\.o:\.text\+0x[0-9a-f]+ is a 32-bit .*-mcpu=v2"):
        link([("heap.o", obj.read_bytes())])


def test_non_bpf_input_is_rejected() -> None:
    with pytest.raises(LinkError, match="not an ELF file"):
        link([("notes.txt", b"hello")])
    with pytest.raises(LinkError, match="no objects"):
        link([])


def _all_syscalls_program(names: list[str], directory: Path) -> Path:
    """C source calling each named syscall behind a selector no input produces (the calls never run)."""
    calls = "\n".join(f"  if (selector == {i}) {{ {n}(); }}" for i, n in enumerate(names))
    source = directory / "all_syscalls.c"
    source.write_text(
        "#include <stdint.h>\n"
        + "".join(f"void {n}(void);\n" for n in names)
        + "uint64_t entrypoint(const uint8_t *input);\n"
        "uint64_t entrypoint(const uint8_t *input) {\n"
        "  uint64_t selector = *(const uint64_t *)input + 1000;\n"
        f"{calls}\n  return 0;\n}}\n"
    )
    return source


def test_every_known_syscall_resolves_in_the_loader(needs_clang: None, tmp_path: Path) -> None:
    """The linker's syscall list must match the loader's: loader-v3 rejects unresolved names at deploy."""
    image = build_shared_object([_all_syscalls_program(sorted(KNOWN_SYSCALLS), tmp_path)])
    ok(Chain(image, via_loader_v3=True).send([], b""))


def test_loader_v3_rejects_an_unknown_syscall(
    needs_clang: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the test above: with the linker's check bypassed, deployment does fail."""
    monkeypatch.setattr(linker, "KNOWN_SYSCALLS", KNOWN_SYSCALLS | {"sol_not_a_syscall_"})
    image = build_shared_object(
        [_all_syscalls_program(["sol_log_compute_units_", "sol_not_a_syscall_"], tmp_path)]
    )
    with pytest.raises(DeployError, match=r"Unresolved symbol \(sol_not_a_syscall_\)"):
        Chain(image, via_loader_v3=True)


@pytest.mark.parametrize(
    "name", ["sha256_account", "sysvars", "heap", "cpi_pda", "errors", "dup_accounts", "minimal", "multi"]
)
def test_fixture_programs_deploy_through_loader_v3(program: Program, name: str) -> None:
    """Loader-v3's deployment checks (those `solana program deploy` meets) accept every linked layout."""
    chain = Chain(program(name), via_loader_v3=True)
    account = chain.svm.get_account(chain.program_id)
    assert account is not None and account.executable


# --- the build command ------------------------------------------------------------------------------------


def test_missing_clang_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda _name: None)
    with pytest.raises(BuildError, match=r"clang-14 is not installed.*apt-get install -y clang-14"):
        build.find_clang()


def test_cli_builds_then_checks_and_names_a_difference(
    needs_clang: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "program.so"
    args = ["--src", str(FIXTURES / "multi"), "--out", str(out)]
    assert build.main(["--check", *args]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert build.main(args) == 0
    assert build.main(["--check", *args]) == 0
    image = bytearray(out.read_bytes())
    text_offset = struct.unpack_from("<Q", image, 24)[0]  # e_entry lies in .text
    image[text_offset + 1] ^= 0xFF
    out.write_bytes(image)
    capsys.readouterr()
    assert build.main(["--check", *args]) == 1
    assert f"first difference at byte 0x{text_offset + 1:x} (.text)" in capsys.readouterr().err
    assert build.main(["--check", "--src", str(tmp_path), "--out", str(out)]) == 1
    assert "no C sources" in capsys.readouterr().err
