"""The codec against anchorpy: accounts decode to the same values, anchorpy-built instructions decode back
to the same operation, the committed IDL is current, and malformed bytes fail cleanly."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from anchorpy import Context, Idl, Program, Provider, Wallet
from anchorpy.coder.coder import Coder
from hypothesis import given, settings
from hypothesis import strategies as st
from solana.rpc.async_api import AsyncClient
from solders.keypair import Keypair
from solders.pubkey import Pubkey

from coordinator_program.onchain.idl import IDL_PATH, idl_json
from coordinator_program.onchain.instance import (
    INSTANCE_LAYOUT,
    INSTANCE_SIZE,
    CoordinatorInstance,
    decode_instance,
    encode_instance,
)
from coordinator_program.spec import errors, layout, limits, rules
from coordinator_program.spec.config import (
    Checkpoint,
    CheckpointKind,
    GradAveraging,
    GradValues,
    Schedule,
    Tokenizer,
    WireCodec,
)
from coordinator_program.spec.instructions import (
    INSTRUCTIONS,
    CheckpointReport,
    CloseRun,
    CommitSeed,
    HealthCheck,
    InitCoordinator,
    Instruction,
    JoinRun,
    ReleaseSlot,
    RevealSeed,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
    decode_instruction,
)
from coordinator_program.spec.layout import (
    I64,
    U8,
    U16,
    U32,
    U64,
    Array,
    Bool,
    Enum8,
    FixedBytes,
    FixedStr,
    Int,
    LayoutError,
    Struct,
    Type,
    VarBytes,
    pack_rows,
)
from coordinator_program.spec.state import (
    ACCOUNT_LAYOUT,
    ACCOUNT_SIZE,
    CLIENT_LAYOUT,
    LEDGER_ENTRY_LAYOUT,
    PENDING_LAYOUT,
    ROUND_LAYOUT,
    CoordinatorState,
    Health,
    Pending,
    Role,
    decode_state,
    encode_state,
)
from tests.spec.scenario import MODEL, SMALL, finish_round, join_pipeline, new_run, start_training, witness_all

IDL = Idl.from_json(IDL_PATH.read_text())
PROGRAM = Program(IDL, Pubkey.new_unique(), Provider(AsyncClient("http://127.0.0.1:9"), Wallet(Keypair())))


def from_anchorpy(t: Type, value: Any) -> Any:
    """Convert a value anchorpy decoded into the specification's Python value for the same layout."""
    if isinstance(t, Struct):
        fields = {}
        for f in t.fields:
            item = from_anchorpy(f.type, getattr(value, f.name))
            if f.count_of:
                continue
            fields[f.name] = item
        for count_field in (f for f in t.fields if f.count_of):
            fields[count_field.count_of] = fields[count_field.count_of][:getattr(value, count_field.name)]
        return t.cls(**fields)
    if isinstance(t, Enum8):
        return t.cls[type(value).__name__]
    if isinstance(t, FixedStr):
        return bytes(value).rstrip(b"\0").decode()
    if isinstance(t, FixedBytes):
        return bytes(value)
    if isinstance(t, Array):
        return [from_anchorpy(t.elem, v) for v in value]
    return value


def to_anchorpy(t: Type, value: Any) -> Any:
    """Convert a specification value into the argument anchorpy expects for the same layout."""
    if isinstance(t, Struct):
        return PROGRAM.type[t.name](**{f.name: to_anchorpy(f.type, getattr(value, f.name)) for f in t.fields})
    if isinstance(t, Enum8):
        return getattr(PROGRAM.type[t.cls.__name__], value.name)()
    if isinstance(t, FixedStr):
        return list(value.encode().ljust(t.size, b"\0"))
    if isinstance(t, FixedBytes):
        return Pubkey.from_bytes(value) if t.idl_name == "publicKey" else list(value)
    if isinstance(t, (VarBytes, Int, Bool)):
        return value
    raise AssertionError(f"no conversion for {t}")


def busy_state() -> CoordinatorState:
    """A state with clients, pending joiners, proofs and a previous round: every field exercised."""
    state = new_run()
    join_pipeline(state, workers=4, trainers=2)
    now = start_training(state)
    now = finish_round(state, now)
    witness_all(state)
    join_pipeline(state, workers=1, trainers=0, first=30)
    rules.withdraw(state, state.clients[2].id)
    state.checkpoints[1] = Checkpoint(CheckpointKind.Local, "/data/run", "epoch-0")  # each stage has its own place
    return state


def test_anchorpy_decodes_the_account_to_the_same_values() -> None:
    state = busy_state()
    data = encode_state(state)
    assert len(data) == ACCOUNT_SIZE
    decoded = Coder(IDL).accounts.decode(data)
    assert from_anchorpy(ACCOUNT_LAYOUT, decoded) == state
    assert decode_state(data) == state


def test_anchorpy_decodes_the_instance_account() -> None:
    instance = CoordinatorInstance("run-1", bytes(range(32)), 254)
    data = encode_instance(instance)
    assert len(data) == INSTANCE_SIZE
    assert from_anchorpy(INSTANCE_LAYOUT, Coder(IDL).accounts.decode(data)) == instance
    assert decode_instance(data) == instance
    with pytest.raises(LayoutError, match="discriminator"):
        decode_instance(encode_state(busy_state())[:INSTANCE_SIZE])


def test_account_with_1024_clients_fits_190848_bytes() -> None:
    """Issue 22's bound: 1,024 clients, 1,024 pending joiners (each entry with the join authority's slot, which
    lets the coordinator hold a contributor to its cap) and a ledger of 1,024 contributors, and no witness filter
    kept (health checks read per-client counts), fit 120,000 bytes (Psyche's 64-client account is 119,160). Issue
    20 gave each of the 16 stages a checkpoint place of its own (161 bytes each, for the one record of 163 bytes
    every stage shared), so that no worker can move another stage's: 2,413 bytes more. Issue 23's beacon keeps each
    witness's commitment to the next seed, two masks and the XOR of the reveals in the round: 1,064 bytes, whatever
    the number of clients; the election by rank keeps the elected witnesses' client indices (64 bytes), so that no
    witness instruction ranks every client again. Marking each client and joiner a veteran or not (a byte each), so
    that an epoch's first elections rank the clients whose keys predate their seeds first: 2,048 bytes. Issue 25's
    DeMo settings (chunk, top-k and β in thousandths): 4 bytes. Each client's and joiner's commitment to the secret it
    reveals in its first warmup, so that no joiner foresees the warmup's election (issue 23): 65,536 bytes. How
    averaged gradient values travel (grad_values): 1 byte. Whether each replica steps Adam on the whole batch's
    second moment (whole_batch_moment): 1 byte. How often each peer audits each other reducer (audit_permille): 2
    bytes. PowerGossip's rank (gossip_rank): 1 byte, 190,812 in all."""
    assert limits.MAX_CLIENTS == 1024
    assert ACCOUNT_LAYOUT.offsets()["ledger"][1] == 40 * limits.MAX_CLIENTS
    assert ACCOUNT_LAYOUT.offsets()["checkpoints"][1] == 161 * limits.MAX_STAGES
    assert ROUND_LAYOUT.size == 154 + 32 * limits.MAX_WITNESSES + 4 + 4 + 32 + 2 * limits.MAX_WITNESSES
    assert ACCOUNT_LAYOUT.offsets()["clients"][1] == (32 + 1 + 1 + 2 + 1 + 32 + 1) * limits.MAX_CLIENTS
    assert ACCOUNT_SIZE <= 190_848


SAMPLES: list[Instruction] = [
    InitCoordinator("run-1", bytes(range(32)), bytes(32)),
    Update(SMALL, MODEL, Checkpoint(CheckpointKind.Hub, "org/model", "abc123")),
    Update(SMALL, dataclasses.replace(MODEL, architecture="qwen2", source="./models/q", source_revision="r1",
                                      config_sha256=bytes(range(32)), tokenizer=Tokenizer.Model,
                                      tokenizer_sha256=b"\x07" * 32, lr_schedule=Schedule.WarmupCosine,
                                      warmup_steps=3, lr_floor_micros=10, grad_averaging=GradAveraging.PowerSGD,
                                      powersgd_rank=4, grad_values=GradValues.Float16,
                                      wire_codec=WireCodec.Int8Block), Checkpoint()),
    Update(SMALL, dataclasses.replace(MODEL, grad_averaging=GradAveraging.DeMo, demo_chunk=128, demo_topk=127,
                                      demo_beta_permille=999, grad_values=GradValues.Int8,
                                      wire_codec=WireCodec.BFloat16), Checkpoint()),
    SetPaused(True),
    JoinRun("run-1", Role.Worker, 2),
    JoinRun("run-1", Role.Trainer, limits.NO_STAGE, 17, 1_700_000_000),
    ReleaseSlot(b"\x05" * 32),
    Tick(),
    Witness(7, b"\x01" * 16, b"\x02" * 16),
    WarmupWitness(b"\x03" * 16, b""),
    HealthCheck(b"\x09" * 32),
    CommitSeed(3, b"\x0a" * 32),
    RevealSeed(3, bytes(range(32))),
    CheckpointReport(CheckpointKind.Local, "/tmp/ckpt", "epoch-3"),
    Withdraw(),
    CloseRun(),
]


def test_samples_cover_every_instruction() -> None:
    assert {type(ix) for ix in SAMPLES} == set(INSTRUCTIONS)


@pytest.mark.parametrize("ix", SAMPLES, ids=lambda ix: ix.NAME)
def test_anchorpy_built_instruction_decodes_to_the_same_operation(ix: Instruction) -> None:
    args = [to_anchorpy(f.type, getattr(ix, f.name)) for f in ix.LAYOUT.fields]
    accounts = {a.name: Pubkey.new_unique() for a in ix.ACCOUNTS}
    built = PROGRAM.instruction[ix.NAME](*args, ctx=Context(accounts={_snake(k): v for k, v in accounts.items()}))
    assert bytes(built.data) == ix.encode()
    assert decode_instruction(bytes(built.data)) == ix
    assert [m.is_signer for m in built.accounts] == [a.signer for a in ix.ACCOUNTS]
    assert [m.is_writable for m in built.accounts] == [a.mut for a in ix.ACCOUNTS]


def _snake(name: str) -> str:
    return "".join("_" + ch.lower() if ch.isupper() else ch for ch in name)


def test_committed_idl_is_generated_from_the_layouts() -> None:
    assert IDL_PATH.read_text() == idl_json(), "run `python -m coordinator_program.onchain.idl` and commit the result"
    assert json.loads(idl_json())["accounts"][0]["name"] == "CoordinatorAccount"


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_fuzzed_instruction_bytes_fail_cleanly(data: bytes) -> None:
    try:
        ix = decode_instruction(data)
    except errors.MalformedInstruction:
        return
    assert ix.encode() == data


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_instructions_fail_cleanly_or_roundtrip(ix: Instruction, data: st.DataObject) -> None:
    raw = bytearray(ix.encode())
    cut = data.draw(st.integers(0, len(raw)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, max(len(raw) - 1, 0)), st.integers(0, 255)), max_size=4))
    for pos, byte in flips:
        if pos < len(raw):
            raw[pos] = byte
    mutated = bytes(raw[:cut]) if data.draw(st.booleans()) else bytes(raw)
    try:
        decoded = decode_instruction(mutated)
    except errors.MalformedInstruction:
        return
    assert decoded.encode() == mutated


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_mutated_accounts_fail_cleanly_or_roundtrip(data: st.DataObject) -> None:
    raw = bytearray(encode_state(busy_state_cached()))
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        state = decode_state(bytes(raw))
    except LayoutError:
        return
    assert encode_state(state) == bytes(raw)


_CACHE: list[CoordinatorState] = []


def busy_state_cached() -> CoordinatorState:
    if not _CACHE:
        _CACHE.append(busy_state())
    return _CACHE[0]


def test_layout_rejects_values_that_do_not_fit() -> None:
    state = busy_state()
    bad = dataclasses.replace(state, clients=state.clients * 200)
    with pytest.raises(LayoutError, match="clients"):
        encode_state(bad)
    with pytest.raises(LayoutError, match="trailing"):
        decode_state(encode_state(state) + b"\0")
    with pytest.raises(LayoutError, match="discriminator"):
        decode_state(b"\0" * ACCOUNT_SIZE)
    assert limits.MAX_CLIENTS == 1024


INT_TYPES = [U8, U16, U32, U64, I64]
_LOOSE_INT = st.one_of(st.integers(-(2**64), 2**65), st.booleans(), st.sampled_from([1.0, "1", None]))


def _element_wise(array: Array, values: list[Any]) -> bytes | str:
    """What encoding the array one element at a time gives: its bytes, or its error."""
    out = bytearray()
    try:
        if len(values) != array.n:
            raise LayoutError(f"expected {array.n} elements, got {len(values)}")
        for value in values:
            array.elem.encode(value, out)
    except LayoutError as exc:
        return str(exc)
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(INT_TYPES), st.integers(0, 40), st.data())
def test_integer_arrays_pack_as_element_by_element(elem: Int, n: int, data: st.DataObject) -> None:
    """The whole-array packing of integers gives the bytes, or the error, that packing each element gives."""
    in_range = st.integers(elem.lo, elem.hi)
    values = data.draw(st.lists(st.one_of(in_range, _LOOSE_INT) if data.draw(st.booleans()) else in_range,
                                min_size=n, max_size=n + data.draw(st.sampled_from([0, 0, 1]))))
    array, out = Array(elem, n), bytearray()
    try:
        array.encode(values, out)
    except LayoutError as exc:
        assert str(exc) == _element_wise(array, values)
    else:
        assert bytes(out) == _element_wise(array, values)


def _field_values(t: Type, loose: bool) -> st.SearchStrategy[Any]:
    """Values a field of type ``t`` holds, and with ``loose`` the values a buggy caller might put there."""
    if isinstance(t, Int):
        good = st.integers(t.lo, t.hi)
    elif isinstance(t, Enum8):
        good = st.sampled_from(list(t.cls))
    elif isinstance(t, Bool):
        good = st.booleans()
    else:
        assert isinstance(t, FixedBytes)
        good = st.binary(min_size=t.size, max_size=t.size)
    bad = st.one_of(_LOOSE_INT, st.binary(max_size=40),
                    st.sampled_from([bytearray(32), Role.Trainer, Health.Healthy, 2]))
    return st.one_of(good, bad) if loose else good


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([CLIENT_LAYOUT, PENDING_LAYOUT, LEDGER_ENTRY_LAYOUT]), st.booleans(), st.data())
def test_flat_struct_rows_pack_as_row_by_row(flat: Struct, loose: bool, data: st.DataObject) -> None:
    """``pack_rows`` packs rows of a flat struct into the bytes that encoding each row gives, or declines (and
    appends nothing) where a row would not encode as it is."""
    rows = data.draw(st.lists(st.builds(flat.cls, **{f.name: _field_values(f.type, loose) for f in flat.fields}),
                              max_size=20))
    out = bytearray(b"before")
    if pack_rows(flat, rows, out):
        assert bytes(out) == b"before" + b"".join(flat.pack(row) for row in rows)
    else:
        assert bytes(out) == b"before"
        assert loose or not rows, "declined rows of valid values"


def test_account_encodes_as_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole account, 1,000 joiners and every vote array included, is byte for byte what encoding each
    element alone gives (the fast paths turned off)."""
    state = busy_state()
    state.pending = [Pending(i.to_bytes(32, "little"), Role.Worker, i % 4, i) for i in range(1, 1001)]
    state.presence_votes = [i % 256 for i in range(limits.MAX_CLIENTS)]
    fast = encode_state(state)
    monkeypatch.setattr(layout, "pack_rows", lambda *_: False)
    monkeypatch.setattr(layout, "_plain_ints_within", lambda *_: False)
    assert encode_state(state) == fast
    assert decode_state(fast) == state
