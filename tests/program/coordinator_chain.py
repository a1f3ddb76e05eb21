"""The coordinator program in LiteSVM beside the specification: the harness of the conformance tests and of
the compute-unit benchmark.

``Replay`` drives one run on both: every operation is sent as a real transaction, signed by real keypairs,
at a clock the harness sets, and applied to the specification with ``apply_then_tick`` at the same time
and with the program's entropy (none); after each, the account bytes must equal ``encode_state`` of the
specification's state, and an operation the specification rejects must fail on chain with the same custom
error and change nothing.
``close_run`` is validated by ``rules.close_run``; once accepted, the run's accounts must be gone on chain and
their lamports credited to the authority.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

from solders.account import Account
from solders.clock import Clock
from solders.compute_budget import set_compute_unit_limit
from solders.instruction import AccountMeta
from solders.instruction import Instruction as SolanaInstruction
from solders.keypair import Keypair
from solders.litesvm import LiteSVM
from solders.message import Message
from solders.pubkey import Pubkey
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.system_program import CreateAccountParams, create_account
from solders.transaction import VersionedTransaction
from solders.transaction_metadata import FailedTransactionMetadata, TransactionMetadata
from solders.transaction_status import InstructionErrorCustom, TransactionErrorInstructionError

from coordinator_program.onchain.budget import requested_units
from coordinator_program.onchain.instance import CoordinatorInstance, encode_instance, instance_address
from coordinator_program.program.build import DEFAULT_OUTPUT
from coordinator_program.spec import derived, rules
from coordinator_program.spec.bloom import build_filter, compute_key, participant_key, proof_parts
from coordinator_program.spec.config import Checkpoint, Config, Model
from coordinator_program.spec.errors import CoordinatorError
from coordinator_program.spec.instructions import (
    CloseRun,
    InitCoordinator,
    Instruction,
    JoinRun,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Witness,
    apply_then_tick,
    decode_instruction,
)
from coordinator_program.spec.selection import PROGRAM_ENTROPY
from coordinator_program.spec.state import ACCOUNT_SIZE, CoordinatorState, Phase, Role, encode_state

Result = TransactionMetadata | FailedTransactionMetadata
PROGRAM_PATH: Path = DEFAULT_OUTPUT
"""The committed .so: the tests exercise exactly what users deploy (CI checks it matches the sources)."""

FUNDS = 1_000 * 10**9
LAMPORTS_PER_SIGNATURE = 5_000
"""LiteSVM's transaction fee per signature: what the payer loses besides what its instructions move."""


def key(keypair: Keypair) -> bytes:
    return bytes(keypair.pubkey())


def instruction_error(result: Result) -> object:
    """The InstructionError of a failed transaction, whichever of its instructions failed."""
    assert isinstance(result, FailedTransactionMetadata), "the transaction was expected to fail"
    err = result.err()
    assert isinstance(err, TransactionErrorInstructionError), err
    return err.err


def logs(result: Result) -> str:
    meta = result.meta() if isinstance(result, FailedTransactionMetadata) else result
    return "\n".join(meta.logs())


class ProgramChain:
    """A LiteSVM with the coordinator program deployed, funded identities and a clock the caller sets.

    ``compute_limit``, when set, is requested (ComputeBudget's SetComputeUnitLimit) by every transaction: a
    witness proof tallies every client of the round, which past about 190 clients needs more than the default
    200,000 units of an instruction.
    """

    def __init__(self, compute_limit: int | None = None) -> None:
        self.compute_limit = compute_limit
        self.svm = LiteSVM()
        self.program_id = Pubkey.new_unique()
        self.svm.add_program(self.program_id, PROGRAM_PATH.read_bytes())
        self.slot = 0
        self.now = 0

    def fund(self, *keypairs: Keypair) -> None:
        for keypair in keypairs:  # set directly: LiteSVM's airdrop pool runs dry past about a thousand members
            self.svm.set_account(keypair.pubkey(), Account(FUNDS, b"", SYSTEM_PROGRAM_ID, False))

    def set_clock(self, now: int) -> None:
        """Move to the next slot at unix time ``now``."""
        self.slot += 1
        self.now = now
        self.svm.set_clock(Clock(self.slot, 0, 0, 0, now))

    def send(self, instructions: Sequence[SolanaInstruction], signers: Sequence[Keypair],
             units: int | None = None) -> Result:
        """One transaction paid by ``signers[0]``, asking for ``units`` compute units (else ``compute_limit``, else
        none); a fresh blockhash after it, so a repeat is not a duplicate."""
        unique = list({kp.pubkey(): kp for kp in signers}.values())
        limit = units or self.compute_limit
        budget = [] if limit is None else [set_compute_unit_limit(limit)]
        message = Message.new_with_blockhash([*budget, *instructions], unique[0].pubkey(),
                                             self.svm.latest_blockhash())
        result = self.svm.send_transaction(VersionedTransaction(message, unique))
        self.svm.expire_blockhash()
        return result

    def data(self, address: Pubkey) -> bytes:
        account = self.svm.get_account(address)
        assert account is not None, f"account {address} does not exist"
        return bytes(account.data)

    def account_rent(self) -> int:
        """The rent-exempt minimum of a coordinator account."""
        return self.svm.minimum_balance_for_rent_exemption(ACCOUNT_SIZE)

    def lamports(self, address: Pubkey) -> int:
        """The balance of ``address``; 0 for an account that does not exist (or no longer does)."""
        account = self.svm.get_account(address)
        return 0 if account is None else account.lamports

    def set_data(self, address: Pubkey, data: bytes, owner: Pubkey | None = None) -> None:
        """Overwrite an account (rent exempt for its new size), owned by the program unless told otherwise."""
        lamports = self.svm.minimum_balance_for_rent_exemption(len(data))
        self.svm.set_account(address, Account(lamports, data, owner or self.program_id, False))


@dataclasses.dataclass(frozen=True)
class RunAccounts:
    """The two accounts of a run on chain."""

    coordinator: Pubkey
    instance: Pubkey
    bump: int


def program_instruction(program_id: Pubkey, kind: type[Instruction], accounts: dict[str, Pubkey],
                        data: bytes) -> SolanaInstruction:
    """Instruction data for the program, with the accounts of ``kind`` in the order instructions.py (and the
    IDL) declares them."""
    metas = [AccountMeta(accounts[a.name], is_signer=a.signer, is_writable=a.mut) for a in kind.ACCOUNTS]
    return SolanaInstruction(program_id, data, metas)


def init_instructions(program_id: Pubkey, rent: int, payer: Keypair, coordinator: Keypair,
                      ix: InitCoordinator) -> tuple[list[SolanaInstruction], RunAccounts]:
    """The system create_account of the coordinator account (funded with ``rent``, the rent-exempt minimum of
    its size), then init_coordinator, as a client sends them."""
    instance, bump = instance_address(program_id, ix.run_id)
    create = create_account(CreateAccountParams(
        from_pubkey=payer.pubkey(), to_pubkey=coordinator.pubkey(), lamports=rent, space=ACCOUNT_SIZE,
        owner=program_id))
    init = program_instruction(program_id, InitCoordinator, {
        "payer": payer.pubkey(), "coordinatorInstance": instance, "coordinatorAccount": coordinator.pubkey(),
        "systemProgram": SYSTEM_PROGRAM_ID}, ix.encode())
    return [create, init], RunAccounts(coordinator.pubkey(), instance, bump)


class Replay:
    """One run driven on the program and on the specification in lockstep (see the module docstring)."""

    def __init__(self, chain: ProgramChain, authority: Keypair, run_id: str, join_authority: bytes = bytes(32),
                 now: int = 1_700_000_000) -> None:
        self.chain = chain
        self.authority = authority
        chain.fund(authority)
        chain.set_clock(now)
        self.state: CoordinatorState = rules.init_coordinator(run_id, key(authority), join_authority, now)
        coordinator = Keypair()  # signs its own creation, as the system program requires
        instructions, self.run = init_instructions(
            chain.program_id, chain.account_rent(), authority, coordinator,
            InitCoordinator(run_id, key(authority), join_authority))
        result = chain.send(instructions, [authority, coordinator])
        assert isinstance(result, TransactionMetadata), logs(result)
        self.units = result.compute_units_consumed()
        self.check()
        expected = CoordinatorInstance(run_id, bytes(self.run.coordinator), self.run.bump)
        assert chain.data(self.run.instance) == encode_instance(expected)

    @property
    def now(self) -> int:
        return self.chain.now

    def check(self) -> None:
        assert self.chain.data(self.run.coordinator) == encode_state(self.state), "program and specification differ"

    def load(self, state: CoordinatorState) -> None:
        """Put ``state`` in the run's account and in the specification alike (a state that would take many
        transactions to reach, such as a full ledger)."""
        account = self.chain.svm.get_account(self.run.coordinator)
        assert account is not None
        self.chain.svm.set_account(self.run.coordinator, Account(account.lamports, encode_state(state),
                                                                 account.owner, False))
        self.state = state
        self.check()

    def snapshot(self) -> dict[Pubkey, tuple[int, bytes]]:
        """Lamports and data of the run's two accounts, to prove that a rejected operation changed nothing."""
        return {address: (self.chain.lamports(address), self.chain.data(address))
                for address in (self.run.coordinator, self.run.instance)}

    def check_closed(self, before: dict[Pubkey, tuple[int, bytes]], authority_before: int, signatures: int) -> None:
        """Both accounts are gone and the authority gained their lamports (less the fee it paid).

        Gone means what an address that never held an account looks like: no lamports, no data, owned by
        the system program (a validator purges it; LiteSVM keeps listing it as such).
        """
        for address in before:
            account = self.chain.svm.get_account(address)
            assert account is None or (account.lamports, bytes(account.data), account.owner) == (
                0, b"", SYSTEM_PROGRAM_ID), f"closed account {address} still exists: {account}"
        reclaimed = sum(lamports for lamports, _ in before.values())
        gained = self.chain.lamports(self.authority.pubkey()) - authority_before
        assert gained == reclaimed - signatures * LAMPORTS_PER_SIGNATURE, "the rent did not go to the authority"

    def accounts(self, signer: Keypair, authorizer: Keypair | None) -> dict[str, Pubkey]:
        return {"signer": signer.pubkey(), "authorizer": (authorizer or signer).pubkey(),
                "coordinatorInstance": self.run.instance, "coordinatorAccount": self.run.coordinator}

    def apply(self, ix: Instruction, signer: Keypair, authorizer: Keypair | None = None,
              advance: int = 0) -> int | None:
        """Apply ``ix`` from ``signer`` ``advance`` seconds later on both; returns the error code, or None.

        Asserts that both accept it and leave identical bytes, or both reject it with the same code and
        the account unchanged. The accepted transaction's compute units are left in ``units``.
        """
        return self.apply_data(ix.encode(), type(ix), signer, authorizer, advance)

    def apply_data(self, data: bytes, kind: type[Instruction], signer: Keypair, authorizer: Keypair | None = None,
                   advance: int = 0) -> int | None:
        """``apply`` for raw instruction data, sent with the accounts of ``kind``: the specification decodes
        it first (as the TCP backend does), so malformed data must fail alike."""
        self.chain.set_clock(self.now + advance)
        before = self.snapshot()
        authority_before = self.chain.lamports(self.authority.pubkey())
        instruction = program_instruction(self.chain.program_id, kind, self.accounts(signer, authorizer), data)
        signers = [signer, authorizer or signer]
        result = self.chain.send([instruction], signers, requested_units(kind))  # as the clients ask
        try:
            ix = decode_instruction(data)
            if isinstance(ix, CloseRun):
                rules.close_run(self.state, key(signer))
            else:
                apply_then_tick(self.state, ix, key(signer), self.now, PROGRAM_ENTROPY, key(authorizer or signer))
        except CoordinatorError as exc:
            assert instruction_error(result) == InstructionErrorCustom(exc.code), f"{exc}\n{logs(result)}"
            assert self.snapshot() == before, f"a rejected {kind.NAME} changed the run's accounts"
            return exc.code
        assert isinstance(result, TransactionMetadata), f"the specification accepted {kind.NAME}:\n{logs(result)}"
        self.units = result.compute_units_consumed()
        if isinstance(ix, CloseRun):
            self.check_closed(before, authority_before, len({kp.pubkey() for kp in signers}))
        else:
            self.check()
        return None


class Swarm:
    """A replayed run and the keypairs of its members."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        self.members: dict[bytes, Keypair] = {}

    def new_members(self, n: int) -> list[Keypair]:
        """Funded keypairs, the same on every run (bloom false positives depend on the keys)."""
        first = len(self.members)
        keypairs = [Keypair.from_seed(hashlib.sha256(b"member %d" % i).digest()) for i in range(first, first + n)]
        self.replay.chain.fund(*keypairs)
        self.members.update({key(kp): kp for kp in keypairs})
        return keypairs

    def of(self, identity: bytes) -> Keypair:
        return self.members[identity]

    @property
    def state(self) -> CoordinatorState:
        return self.replay.state

    def filter_of(self, identities: list[bytes], worked: Sequence[bytes] = ()) -> bytes:
        """A participant filter naming ``identities`` present and ``worked`` as having done counted work."""
        keys = [participant_key(i) for i in identities] + [compute_key(i) for i in worked]
        return build_filter(self.state.config, keys)

    def proof(self, participant_bloom: bytes, part: int = 0) -> Instruction:
        """Part ``part`` of the proof instruction of the current phase (warmup or round) carrying
        ``participant_bloom``."""
        batches = self.filter_of([])
        if self.state.phase == Phase.Warmup:
            return WarmupWitness(participant_bloom, batches, part)
        return Witness(self.state.round.height, participant_bloom, batches, part)

    def proof_parts(self, participants: Sequence[bytes], worked: Sequence[bytes] = ()) -> list[Instruction]:
        """Every part of a proof naming ``participants`` (and the compute keys of ``worked``)."""
        parts = proof_parts(self.state.config, self.clients(), participants, worked, {})
        return [self.proof(participant_bloom, part) for part, (participant_bloom, _) in enumerate(parts)]

    def prove(self, participants: list[bytes], witnesses: list[bytes] | None = None,
              worked: Sequence[bytes] = ()) -> list[int | None]:
        """``witnesses`` (by default every elected witness) each send a whole proof, part by part, naming
        ``participants`` (and the compute keys of ``worked``); returns each one's first error, or None."""
        ixs = self.proof_parts(participants, worked)
        chosen = derived.witnesses(self.state) if witnesses is None else witnesses
        outcomes = []
        for witness in chosen:
            codes = [self.replay.apply(ix, self.of(witness)) for ix in ixs]
            outcomes.append(next((code for code in codes if code is not None), None))
        return outcomes

    def clients(self) -> list[bytes]:
        return [c.id for c in self.state.clients]


def training_swarm(config: Config, model: Model, workers: int = 3, trainers: int = 1,
                   run_id: str = "swarm") -> tuple[Swarm, Keypair]:
    """A permissionless run on chain and in the specification, configured, resumed and ticked into round 0 of
    its first epoch with ``workers`` auto-staged workers then ``trainers`` trainers; returns it and its
    authority."""
    authority = Keypair()
    swarm = Swarm(Replay(ProgramChain(), authority, run_id))
    apply = swarm.replay.apply
    assert apply(Update(config, model, Checkpoint()), authority) is None
    assert apply(SetPaused(False), authority) is None
    assert apply(Tick(), authority) is None
    for i, member in enumerate(swarm.new_members(workers + trainers)):
        assert apply(JoinRun(run_id, Role.Worker if i < workers else Role.Trainer), member) is None
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert apply(Tick(), authority, advance=config.warmup_time) is None
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 0
    return swarm, authority
