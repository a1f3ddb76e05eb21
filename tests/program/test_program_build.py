"""The program's build inputs and output: the generated C header is current and says what the Python layouts
say, and the committed .so deploys the way `solana program deploy` does it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from coordinator_chain import PROGRAM_PATH, instruction_error
from sbpf_harness import Chain
from solders.transaction_status import InstructionErrorCustom

from coordinator_program.program import gen_layout
from coordinator_program.spec.errors import MalformedInstruction
from coordinator_program.spec.state import ACCOUNT_LAYOUT, ACCOUNT_SIZE


def test_committed_header_is_what_the_generator_produces() -> None:
    assert gen_layout.HEADER_PATH.read_text() == gen_layout.render(), (
        "run `python -m coordinator_program.program.gen_layout` and commit the header")


def test_check_mode_reports_a_stale_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "psy_coordinator_layout.h"
    stale.write_text(gen_layout.render().replace("#define PSY_MAX_CLIENTS 1024", "#define PSY_MAX_CLIENTS 1023"))
    monkeypatch.setattr(gen_layout, "HEADER_PATH", stale)
    assert gen_layout.main(["--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    assert gen_layout.main([]) == 0
    assert gen_layout.main(["--check"]) == 0


def test_header_offsets_are_the_layouts() -> None:
    macros = dict(re.findall(r"#define (PSY_ACCOUNT_\w+) (\d+)\n", gen_layout.render()))
    assert int(macros["PSY_ACCOUNT_SIZE"]) == ACCOUNT_SIZE
    for name, (offset, size) in ACCOUNT_LAYOUT.offsets(base=8).items():
        macro = "PSY_ACCOUNT_" + gen_layout.macro_name(name)
        assert (int(macros[macro + "_OFFSET"]), int(macros[macro + "_SIZE"])) == (offset, size)


@pytest.mark.parametrize("name,macro", [
    ("NotAClient", "NOT_A_CLIENT"), ("WaitingForMembers", "WAITING_FOR_MEMBERS"), ("P2P", "P2P"),
    ("checkpoint.revision", "CHECKPOINT_REVISION"), ("init_coordinator", "INIT_COORDINATOR"),
])
def test_macro_names(name: str, macro: str) -> None:
    assert gen_layout.macro_name(name) == macro


def test_committed_program_deploys_through_loader_v3() -> None:
    chain = Chain(PROGRAM_PATH.read_bytes(), via_loader_v3=True)
    account = chain.svm.get_account(chain.program_id)
    assert account is not None and account.executable
    assert instruction_error(chain.send([], b"")) == InstructionErrorCustom(MalformedInstruction.code)
