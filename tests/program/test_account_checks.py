"""The program's own account checks, broken one at a time on purpose.

The specification never sees accounts (its backend authenticates callers), so these checks exist only on
chain: each broken account must fail with its builtin program error and change nothing, while the same
call with the accounts intact gets past them (it succeeds, or a rule rejects it with a custom error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from coordinator_chain import ProgramChain, Replay, init_instructions, instruction_error, key, program_instruction
from solders.instruction import AccountMeta
from solders.instruction import Instruction as SolanaInstruction
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.transaction_metadata import TransactionMetadata
from solders.transaction_status import InstructionErrorCustom
from solders.transaction_status import InstructionErrorFieldless as Builtin

from coordinator_program.onchain.instance import INSTANCE_SIZE, CoordinatorInstance, encode_instance, instance_address
from coordinator_program.spec import errors, rules
from coordinator_program.spec.config import Checkpoint, CheckpointKind
from coordinator_program.spec.instructions import (
    CheckpointReport,
    CloseRun,
    HealthCheck,
    InitCoordinator,
    Instruction,
    JoinRun,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
    decode_instruction,
)
from coordinator_program.spec.state import ACCOUNT_SIZE, Role, encode_state
from tests.spec.scenario import MODEL, SMALL

RUN_ID = "checks"


@dataclasses.dataclass
class Call:
    """One instruction about to be sent: its metas and signers, which a breakage edits."""

    replay: Replay
    ix: Instruction
    metas: list[AccountMeta]
    signers: list[Keypair]

    def index(self, name: str) -> int:
        return [a.name for a in self.ix.ACCOUNTS].index(name)

    def meta(self, name: str, **changes: object) -> None:
        i = self.index(name)
        old = self.metas[i]
        fields = {"pubkey": old.pubkey, "is_signer": old.is_signer, "is_writable": old.is_writable, **changes}
        self.metas[i] = AccountMeta(**fields)

    def account(self, name: str) -> Pubkey:
        return self.metas[self.index(name)].pubkey

    def rewrite(self, name: str, edit: Callable[[bytes], bytes], owner: Pubkey | None = None) -> None:
        """Replace an account's data (and owner) on chain."""
        address = self.account(name)
        self.replay.chain.set_data(address, edit(self.replay.chain.data(address)), owner)

    def send(self) -> object:
        chain = self.replay.chain
        return chain.send([SolanaInstruction(chain.program_id, self.ix.encode(), self.metas)], self.signers)


def started() -> tuple[Replay, Keypair]:
    """A run waiting for members, with one member pending."""
    authority, member = Keypair(), Keypair()
    replay = Replay(ProgramChain(), authority, RUN_ID)
    replay.chain.fund(member)
    assert replay.apply(Update(SMALL, MODEL, Checkpoint()), authority) is None
    assert replay.apply(SetPaused(False), authority) is None
    assert replay.apply(Tick(), authority) is None
    assert replay.apply(JoinRun(RUN_ID, Role.Trainer), member) is None
    return replay, member


def prepare(ix: Instruction, by_authority: bool) -> Call:
    replay, member = started()
    signer = replay.authority if by_authority else member
    accounts = replay.accounts(signer, None)
    metas = program_instruction(replay.chain.program_id, type(ix), accounts, ix.encode()).accounts
    return Call(replay, ix, list(metas), [signer])


CALLS: list[tuple[Instruction, bool]] = [
    (Update(SMALL, MODEL, Checkpoint()), True),
    (SetPaused(True), True),
    (JoinRun(RUN_ID, Role.Worker), False),
    (Tick(), False),
    (Witness(0, b"", b""), False),
    (WarmupWitness(b"", b""), False),
    (HealthCheck(bytes(32)), False),
    (CheckpointReport(CheckpointKind.Hub, "org/m", "main"), False),
    (Withdraw(), False),
    (CloseRun(), True),
]
EVERY = tuple(type(ix) for ix, _ in CALLS)
WITH_INSTANCE = (Update, SetPaused, JoinRun, CloseRun)


def _unsigned(call: Call) -> None:
    """The signer's key stays, but nothing signs for it (join_run lists it twice: as signer and authorizer)."""
    payer = Keypair()
    call.replay.chain.fund(payer)
    signer = call.account("signer")
    call.metas = [AccountMeta(m.pubkey, m.is_signer and m.pubkey != signer, m.is_writable) for m in call.metas]
    call.signers = [payer]


def _read_only_authority(call: Call) -> None:
    """The authority listed read-only: someone else pays the fee, as the payer is always writable."""
    payer = Keypair()
    call.replay.chain.fund(payer)
    call.meta("signer", is_writable=False)
    call.signers = [payer, *call.signers]


def _other_run_instance(call: Call) -> None:
    other = Replay(call.replay.chain, Keypair(), "another-run")
    call.meta("coordinatorInstance", pubkey=other.run.instance)


def _forged_instance(call: Call) -> None:
    """The real instance's bytes at an address that is not the PDA of its run id and bump."""
    forged = Pubkey.new_unique()
    call.replay.chain.set_data(forged, call.replay.chain.data(call.account("coordinatorInstance")))
    call.meta("coordinatorInstance", pubkey=forged)


def _other_bump(call: Call) -> None:
    call.rewrite("coordinatorInstance", lambda d: d[:-1] + bytes([d[-1] ^ 1]))


BREAKAGES: dict[str, tuple[Callable[[Call], None], object, tuple[type[Instruction], ...]]] = {
    # name: (breakage, expected error, the instructions it applies to)
    "missing account": (lambda c: c.metas.pop(), Builtin.NotEnoughAccountKeys, EVERY),
    "signer does not sign": (_unsigned, Builtin.MissingRequiredSignature, EVERY),
    "coordinator of another owner": (
        lambda c: c.rewrite("coordinatorAccount", lambda d: d, owner=Pubkey.new_unique()),
        Builtin.InvalidAccountOwner, EVERY),
    "coordinator read-only": (
        lambda c: c.meta("coordinatorAccount", is_writable=False), Builtin.Immutable, EVERY),
    "coordinator discriminator": (
        lambda c: c.rewrite("coordinatorAccount", lambda d: bytes([d[0] ^ 1]) + d[1:]),
        Builtin.InvalidAccountData, EVERY),
    "coordinator truncated": (
        lambda c: c.rewrite("coordinatorAccount", lambda d: d[:-1]), Builtin.InvalidAccountData, EVERY),
    "coordinator is the instance": (
        lambda c: c.meta("coordinatorAccount", pubkey=c.replay.run.instance), Builtin.InvalidAccountData, EVERY),
    "instance of another owner": (
        lambda c: c.rewrite("coordinatorInstance", lambda d: d, owner=Pubkey.new_unique()),
        Builtin.InvalidAccountOwner, WITH_INSTANCE),
    "instance discriminator": (
        lambda c: c.rewrite("coordinatorInstance", lambda d: bytes([d[0] ^ 1]) + d[1:]),
        Builtin.InvalidAccountData, WITH_INSTANCE),
    "instance truncated": (
        lambda c: c.rewrite("coordinatorInstance", lambda d: d[:-1]), Builtin.InvalidAccountData, WITH_INSTANCE),
    "instance of another run": (_other_run_instance, Builtin.InvalidAccountData, WITH_INSTANCE),
    "instance not at its PDA": (_forged_instance, Builtin.InvalidSeeds, WITH_INSTANCE),
    "instance bump tampered": (_other_bump, Builtin.InvalidSeeds, WITH_INSTANCE),
    "authority read-only": (_read_only_authority, Builtin.Immutable, (CloseRun,)),
    "instance read-only": (lambda c: c.meta("coordinatorInstance", is_writable=False), Builtin.Immutable, (CloseRun,)),
}

CASES = [pytest.param(ix, by_authority, name, id=f"{ix.NAME}-{name}") for ix, by_authority in CALLS
         for name, (_, _, kinds) in BREAKAGES.items() if isinstance(ix, kinds)]


@pytest.mark.parametrize("ix,by_authority", CALLS, ids=[ix.NAME for ix, _ in CALLS])
def test_intact_accounts_pass_the_checks(ix: Instruction, by_authority: bool) -> None:
    """The control of the test below: unbroken, each call succeeds or a rule rejects it."""
    result = prepare(ix, by_authority).send()
    assert isinstance(result, TransactionMetadata) or isinstance(instruction_error(result), InstructionErrorCustom)


@pytest.mark.parametrize("ix,by_authority,breakage", CASES)
def test_broken_account_fails_and_changes_nothing(ix: Instruction, by_authority: bool, breakage: str) -> None:
    call = prepare(ix, by_authority)
    breaker, expected, _ = BREAKAGES[breakage]
    breaker(call)
    watched = call.replay.snapshot()
    assert instruction_error(call.send()) == expected
    assert call.replay.snapshot() == watched


def test_join_needs_the_authorizer_to_sign() -> None:
    call = prepare(JoinRun(RUN_ID, Role.Worker), False)
    gate = Keypair()
    call.meta("authorizer", pubkey=gate.pubkey(), is_signer=False)
    before = call.replay.chain.data(call.replay.run.coordinator)
    assert instruction_error(call.send()) == Builtin.MissingRequiredSignature
    assert call.replay.chain.data(call.replay.run.coordinator) == before


def test_update_by_anyone_but_the_main_authority_is_refused() -> None:
    call = prepare(Update(SMALL, MODEL, Checkpoint()), False)
    assert call.replay.apply(SetPaused(True), call.replay.authority) is None
    assert call.replay.apply(Tick(), call.replay.authority) is None  # paused, so only the signer is wrong
    before = call.replay.chain.data(call.replay.run.coordinator)
    assert instruction_error(call.send()) == InstructionErrorCustom(errors.NotAuthorized.code)
    assert call.replay.chain.data(call.replay.run.coordinator) == before
    assert call.replay.apply(Update(SMALL, MODEL, Checkpoint()), call.replay.authority) is None


# --- init_coordinator ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Init:
    """An init_coordinator whose coordinator account was pre-created (zeroed, program-owned) on its own, so
    each breakage tests the instruction alone."""

    chain: ProgramChain
    payer: Keypair
    coordinator: Keypair
    instruction: SolanaInstruction
    instance: Pubkey
    signers: list[Keypair]

    def meta(self, index: int, **changes: object) -> None:
        metas = list(self.instruction.accounts)
        old = metas[index]
        fields = {"pubkey": old.pubkey, "is_signer": old.is_signer, "is_writable": old.is_writable, **changes}
        metas[index] = AccountMeta(**fields)
        self.instruction = SolanaInstruction(self.instruction.program_id, self.instruction.data, metas)

    def coordinator_data(self, data: bytes, owner: Pubkey | None = None) -> None:
        self.chain.set_data(self.coordinator.pubkey(), data, owner)

    def send(self) -> object:
        return self.chain.send([self.instruction], self.signers)


def prepare_init(run_id: str = RUN_ID, data: bytes | None = None, chain: ProgramChain | None = None) -> Init:
    chain = chain or ProgramChain()
    payer, coordinator = Keypair(), Keypair()
    chain.fund(payer)
    instructions, run = init_instructions(chain.program_id, chain.account_rent(), payer, coordinator,
                                          InitCoordinator(run_id, key(payer), bytes(32)))
    chain.set_data(coordinator.pubkey(), bytes(ACCOUNT_SIZE))
    init = instructions[1]
    if data is not None:
        init = SolanaInstruction(init.program_id, data, init.accounts)
    return Init(chain, payer, coordinator, init, run.instance, [payer])


def test_init_writes_the_initial_state_and_the_instance() -> None:
    init = prepare_init()
    assert isinstance(init.send(), TransactionMetadata)
    state = rules.init_coordinator(RUN_ID, key(init.payer), bytes(32), init.chain.svm.get_clock().unix_timestamp)
    assert init.chain.data(init.coordinator.pubkey()) == encode_state(state)
    instance = init.chain.svm.get_account(init.instance)
    assert instance is not None and instance.owner == init.chain.program_id
    assert instance.lamports == init.chain.svm.minimum_balance_for_rent_exemption(INSTANCE_SIZE)
    _, bump = instance_address(init.chain.program_id, RUN_ID)
    assert bytes(instance.data) == encode_instance(CoordinatorInstance(RUN_ID, key(init.coordinator), bump))


def _payer_unsigned(init: Init) -> None:
    helper = Keypair()
    init.chain.fund(helper)
    init.meta(0, is_signer=False)
    init.signers = [helper]


def _without_system_program(init: Init) -> None:
    accounts = list(init.instruction.accounts)[:3]
    init.instruction = SolanaInstruction(init.instruction.program_id, init.instruction.data, accounts)


INIT_BREAKAGES: dict[str, tuple[Callable[[Init], None], object]] = {
    "payer does not sign": (_payer_unsigned, Builtin.MissingRequiredSignature),
    "instance read-only": (lambda i: i.meta(1, is_writable=False), Builtin.Immutable),
    "not the system program": (lambda i: i.meta(3, pubkey=i.chain.program_id), Builtin.IncorrectProgramId),
    "system program missing": (_without_system_program, Builtin.NotEnoughAccountKeys),
    "coordinator of another owner": (
        lambda i: i.coordinator_data(bytes(ACCOUNT_SIZE), Pubkey.new_unique()), Builtin.InvalidAccountOwner),
    "coordinator read-only": (lambda i: i.meta(2, is_writable=False), Builtin.Immutable),
    "coordinator too small": (lambda i: i.coordinator_data(bytes(ACCOUNT_SIZE - 1)), Builtin.InvalidAccountData),
    "coordinator too large": (lambda i: i.coordinator_data(bytes(ACCOUNT_SIZE + 1)), Builtin.InvalidAccountData),
    "coordinator not zeroed": (
        lambda i: i.coordinator_data(bytes(ACCOUNT_SIZE - 1) + b"\x01"), Builtin.AccountAlreadyInitialized),
    "instance not the PDA": (lambda i: i.meta(1, pubkey=Pubkey.new_unique()), Builtin.InvalidSeeds),
    "instance of another run id": (
        lambda i: i.meta(1, pubkey=instance_address(i.chain.program_id, "other")[0]), Builtin.InvalidSeeds),
}


@pytest.mark.parametrize("breakage", list(INIT_BREAKAGES))
def test_broken_init_fails_and_creates_nothing(breakage: str) -> None:
    init = prepare_init()
    breaker, expected = INIT_BREAKAGES[breakage]
    breaker(init)
    before = init.chain.data(init.coordinator.pubkey())
    assert instruction_error(init.send()) == expected
    assert init.chain.data(init.coordinator.pubkey()) == before
    assert init.chain.svm.get_account(init.instance) is None


def test_second_init_of_a_run_id_is_refused_by_the_system_program() -> None:
    first = prepare_init()
    assert isinstance(first.send(), TransactionMetadata)
    instance = first.chain.data(first.instance)
    again = prepare_init(chain=first.chain)
    assert again.instance == first.instance
    assert instruction_error(again.send()) == InstructionErrorCustom(0)  # SystemError::AccountAlreadyInUse
    assert first.chain.data(first.instance) == instance
    assert not any(first.chain.data(again.coordinator.pubkey()))


@pytest.mark.parametrize("run_id", ["", "has space", "émigré", "x" * 32])
def test_init_run_id_rules_match_the_specification(run_id: str) -> None:
    try:
        rules.init_coordinator(run_id, bytes(32), bytes(32), now=0)
    except errors.InvalidRunId as exc:
        expected: int | None = exc.code
    else:
        expected = None
    init = prepare_init(run_id)
    result = init.send()
    if expected is None:
        assert isinstance(result, TransactionMetadata)
    else:
        assert instruction_error(result) == InstructionErrorCustom(expected)
        assert not any(init.chain.data(init.coordinator.pubkey()))


@pytest.mark.parametrize("data", [
    InitCoordinator(RUN_ID, bytes(32), bytes(32)).encode()[:-1],
    InitCoordinator(RUN_ID, bytes(32), bytes(32)).encode() + b"\0",
    InitCoordinator("a", bytes(32), bytes(32)).encode().replace(b"a\0", b"\xff\0", 1),
    InitCoordinator("a", bytes(32), bytes(32)).encode().replace(b"a\0\0", b"a\0b", 1),
], ids=["truncated", "trailing", "not-utf8", "nul-inside"])
def test_malformed_init_data_is_malformed_instruction(data: bytes) -> None:
    with pytest.raises(errors.MalformedInstruction):
        decode_instruction(data)
    init = prepare_init(data=data)
    assert instruction_error(init.send()) == InstructionErrorCustom(errors.MalformedInstruction.code)
    assert init.chain.svm.get_account(init.instance) is None
