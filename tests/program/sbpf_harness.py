"""Shared by the toolchain tests and the compute-unit benchmark: build fixture programs, run them in LiteSVM.

Kept out of conftest.py so that bench_compute_units.py, a plain script, can use the same code.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from solders.account import Account
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.litesvm import FeatureSet, LiteSVM
from solders.message import Message
from solders.pubkey import Pubkey
from solders.transaction import VersionedTransaction
from solders.transaction_metadata import FailedTransactionMetadata, TransactionMetadata

from coordinator_program.onchain import deploy
from coordinator_program.program.build import CLANG, build_shared_object

FIXTURES = Path(__file__).resolve().parent / "fixtures"

MEASURED: dict[str, int] = {}
"""Compute units per fixture scenario, filled by the tests and printed in pytest's terminal summary."""


def clang_missing() -> bool:
    return shutil.which(CLANG) is None


def fixture_sources(name: str) -> list[Path]:
    """A fixture is fixtures/<name>.c, or every .c file of fixtures/<name>/ (a multi-object program)."""
    single = FIXTURES / f"{name}.c"
    return [single] if single.exists() else sorted((FIXTURES / name).glob("*.c"))


def build_fixture(name: str, out_dir: Path) -> bytes:
    return build_shared_object(fixture_sources(name), out_dir / f"{name}.so")


# Features that, when active in LiteSVM's all-enabled set, stop loader-v3 from deploying SBPFv0 programs.
_V0_DEPLOY_BLOCKERS = {
    Pubkey.from_string("8Cb77yHjPWe9wuWUfXeh6iszFGCDGNCoFk3tprViYHNm"),
    Pubkey.from_string("EmhbpdVtZ2hWRGFWBDjn2i3SJD8Z36z4mpMcZJEnebnP"),
}


class DeployError(RuntimeError):
    """Loader-v3 refused the program; the message carries the loader's logs (its real reason)."""


class Chain:
    """A LiteSVM with one deployed program and a funded payer: what every fixture test starts from.

    ``add_program`` installs the ELF directly and is lenient (it resolves unknown syscalls lazily and
    panics without detail on a bad ELF). ``via_loader_v3`` instead deploys the way ``solana program
    deploy`` does (buffer, Write, DeployWithMaxDataLen), so the loader's strict deployment checks apply.
    """

    def __init__(self, program: bytes, via_loader_v3: bool = False) -> None:
        self.payer = Keypair()
        if via_loader_v3:
            all_enabled = FeatureSet.all_enabled()
            active = {k: v for k, v in all_enabled.active.items() if k not in _V0_DEPLOY_BLOCKERS}
            features = FeatureSet(active, set(all_enabled.inactive) | _V0_DEPLOY_BLOCKERS)
            self.svm = LiteSVM.default().with_builtins(features).with_lamports(10**18).with_sysvars()
            self.svm.airdrop(self.payer.pubkey(), 100_000_000_000)
            self.program_id = self._deploy(program)
        else:
            self.svm = LiteSVM()
            self.program_id = Pubkey.new_unique()
            self.svm.add_program(self.program_id, program)
            self.svm.airdrop(self.payer.pubkey(), 10_000_000_000)

    def _deploy(self, program: bytes) -> Pubkey:
        """The loader-v3 transactions of ``coordinator_program.onchain.deploy``, sent straight to the VM."""
        buffer, program_keypair = Keypair(), Keypair()
        payer = self.payer.pubkey()
        space = deploy.BUFFER_HEADER + len(program)
        rent = self.svm.minimum_balance_for_rent_exemption
        self._submit([deploy.create_loader_account(payer, buffer.pubkey(), rent(space), space),
                      deploy.initialize_buffer(buffer.pubkey(), payer)], [buffer])
        chunk = deploy.write_chunk_size(payer)
        for offset in range(0, len(program), chunk):
            self._submit([deploy.write(buffer.pubkey(), payer, offset, program[offset:offset + chunk])], [])
        program_id = program_keypair.pubkey()
        size = deploy.PROGRAM_ACCOUNT_SIZE
        self._submit([deploy.create_loader_account(payer, program_id, rent(size), size),
                      deploy.deploy_with_max_data_len(payer, program_id, buffer.pubkey(), payer, len(program))],
                     [program_keypair])
        # a program deployed in a slot can be invoked from the next one on
        self.svm.warp_to_slot(self.svm.get_clock().slot + 2)
        return program_id

    def _submit(self, instructions: list[Instruction], signers: list[Keypair]) -> None:
        message = Message.new_with_blockhash(instructions, self.payer.pubkey(), self.svm.latest_blockhash())
        result = self.svm.send_transaction(VersionedTransaction(message, [self.payer, *signers]))
        if isinstance(result, FailedTransactionMetadata):
            raise DeployError(f"{result.err()}: " + " | ".join(result.meta().logs()))
        self.svm.expire_blockhash()

    def program_account(self, size: int, owner: Pubkey | None = None) -> Pubkey:
        """A rent-exempt account of ``size`` zero bytes, owned by the program unless told otherwise."""
        key = Pubkey.new_unique()
        lamports = self.svm.minimum_balance_for_rent_exemption(size)
        self.svm.set_account(key, Account(lamports, bytes(size), owner or self.program_id, False))
        return key

    def data(self, key: Pubkey) -> bytes:
        account = self.svm.get_account(key)
        assert account is not None, f"account {key} does not exist"
        return bytes(account.data)

    def send(
        self, accounts: Sequence[AccountMeta], data: bytes, signers: Sequence[Keypair] = ()
    ) -> TransactionMetadata | FailedTransactionMetadata:
        """One instruction to the program, paid by the payer; a fresh blockhash so repeats are not dups."""
        instruction = Instruction(self.program_id, data, list(accounts))
        message = Message.new_with_blockhash([instruction], self.payer.pubkey(), self.svm.latest_blockhash())
        result = self.svm.send_transaction(VersionedTransaction(message, [self.payer, *signers]))
        self.svm.expire_blockhash()
        return result


def ok(result: TransactionMetadata | FailedTransactionMetadata) -> TransactionMetadata:
    """The success metadata, or an assertion error carrying the program's logs."""
    assert isinstance(result, TransactionMetadata), f"{result.err()}\n" + "\n".join(result.meta().logs())
    return result


def failed(result: TransactionMetadata | FailedTransactionMetadata) -> FailedTransactionMetadata:
    assert isinstance(result, FailedTransactionMetadata), "the transaction was expected to fail"
    return result


def writable(key: Pubkey, signer: bool = False) -> AccountMeta:
    return AccountMeta(key, is_signer=signer, is_writable=True)


def readonly(key: Pubkey, signer: bool = False) -> AccountMeta:
    return AccountMeta(key, is_signer=signer, is_writable=False)
