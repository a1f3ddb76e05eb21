"""Instruction data: the program accepts exactly what ``decode_instruction`` accepts.

Malformed bytes must fail with MalformedInstruction and change nothing; bytes that decode go on to the
rules, and ``Replay`` checks the program's outcome against the specification's either way.
"""

from __future__ import annotations

import struct

import pytest
from coordinator_chain import ProgramChain, Replay
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.keypair import Keypair

from coordinator_program.spec import errors
from coordinator_program.spec.config import Checkpoint, CheckpointKind
from coordinator_program.spec.instructions import (
    CheckpointReport,
    CloseRun,
    HealthCheck,
    Instruction,
    JoinRun,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
)
from coordinator_program.spec.state import Role
from tests.spec.scenario import MODEL, SMALL

RUN_ID = "data"
SAMPLES: list[Instruction] = [
    Update(SMALL, MODEL, Checkpoint(CheckpointKind.Hub, "org/model", "abc123")),
    SetPaused(True),
    JoinRun(RUN_ID, Role.Worker, 2),
    Tick(),
    Witness(7, b"\x01" * 16, b"\x02" * 16),
    WarmupWitness(b"\x03" * 16, b""),
    HealthCheck(b"\x09" * 32),
    CheckpointReport(CheckpointKind.Local, "/tmp/ckpt", "epoch-3"),
    Withdraw(),
]


@pytest.fixture(scope="module")
def replay() -> Replay:
    """A configured, paused run: update validates its data fully, the other operations reach their rules."""
    authority = Keypair()
    run = Replay(ProgramChain(), authority, RUN_ID)
    assert run.apply(Update(SMALL, MODEL, Checkpoint()), authority) is None
    return run


def _with_run_id(raw: bytes) -> bytes:
    return JoinRun.discriminator() + raw.ljust(32, b"\0") + bytes([Role.Trainer, 255])


def _update_with(field: str, raw: bytes) -> bytes:
    """An update whose ``field`` (a FixedStr such as ``model.dataset``) holds ``raw``, zero-padded."""
    offset, size = Update.LAYOUT.offsets(base=8)[field]
    data = bytearray(SAMPLES[0].encode())
    data[offset:offset + size] = raw.ljust(size, b"\0")
    return bytes(data)


CASES: list[tuple[str, bytes, type[Instruction]]] = [
    ("empty", b"", Tick),
    ("short discriminator", Tick.discriminator()[:7], Tick),
    ("unknown discriminator", b"\x01" * 8, Tick),
    ("trailing byte", Tick().encode() + b"\0", Tick),
    ("close_run with an argument", CloseRun().encode() + b"\0", CloseRun),
    ("bool 2", SetPaused.discriminator() + b"\x02", SetPaused),
    ("role 2", JoinRun(RUN_ID, Role.Worker).encode()[:-2] + b"\x02\xff", JoinRun),
    ("checkpoint kind 4", CheckpointReport.discriminator() + b"\x04" + SAMPLES[7].encode()[9:], CheckpointReport),
    ("bloom of 481 bytes", Witness.discriminator() + struct.pack("<II", 0, 481) + bytes(481) + bytes(4), Witness),
    ("bloom of 480 bytes", Witness(0, bytes(480), b"").encode(), Witness),
    ("bloom length past the end", WarmupWitness.discriminator() + struct.pack("<I", 5) + bytes(4), WarmupWitness),
    ("second bloom missing", WarmupWitness.discriminator() + struct.pack("<I", 0), WarmupWitness),
    ("overlong UTF-8", _with_run_id(b"\xc0\x80"), JoinRun),
    ("surrogate", _with_run_id(b"\xed\xa0\x80"), JoinRun),
    ("beyond U+10FFFF", _with_run_id(b"\xf4\x90\x80\x80"), JoinRun),
    ("truncated sequence", _with_run_id(b"a\xe2\x82"), JoinRun),
    ("NUL inside", _with_run_id(b"da\0ta"), JoinRun),
    ("four-byte character", _with_run_id("d😀".encode()), JoinRun),
    ("largest code point", _with_run_id("\U0010ffff".encode()), JoinRun),
    ("exact run id", _with_run_id(RUN_ID.encode()), JoinRun),
    ("non-ASCII dataset", _update_with("model.dataset", "donnée".encode()), Update),
    ("control character in repo", _update_with("checkpoint.repo", b"org/\x7fmodel"), Update),
    ("repo not UTF-8", _update_with("checkpoint.repo", b"org/\xfe"), Update),
    ("grad values 3", _update_with("model.grad_values", b"\x03"), Update),
    ("whole-batch moment 2", _update_with("model.whole_batch_moment", b"\x02"), Update),
]


@pytest.mark.parametrize("data,kind", [(d, k) for _, d, k in CASES], ids=[name for name, _, _ in CASES])
def test_edge_cases_match_the_specification(replay: Replay, data: bytes, kind: type[Instruction]) -> None:
    replay.apply_data(data, kind, replay.authority)


def test_edge_cases_include_malformed_and_well_formed_data(replay: Replay) -> None:
    """The cases above exercise both sides of the decoder (guards against a table that tests one side)."""
    outcomes = [replay.apply_data(data, kind, replay.authority) for _, data, kind in CASES]
    assert outcomes.count(errors.MalformedInstruction.code) >= 12
    assert len({code for code in outcomes if code != errors.MalformedInstruction.code}) >= 3


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_instructions_match_the_specification(replay: Replay, ix: Instruction, data: st.DataObject) -> None:
    raw = bytearray(ix.encode())
    cut = data.draw(st.integers(0, len(raw)))
    for pos, byte in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=4)):
        raw[pos] = byte
    mutated = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)
    replay.apply_data(mutated, type(ix), replay.authority)
