"""The local chain's ledger rules, in process: its clock, the blockhash window, and a deployment through the
upgradeable loader (how the next step deploys to localnet, as ``solana program deploy`` does to a cluster)."""

from __future__ import annotations

import struct

from solders.hash import Hash
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.system_program import CreateAccountParams, TransferParams, create_account, transfer
from solders.sysvar import CLOCK, RENT
from solders.transaction import VersionedTransaction
from solders.transaction_status import InstructionErrorCustom, TransactionErrorFieldless

from coordinator_program.localnet.chain import RECENT_BLOCKHASHES, LocalChain
from coordinator_program.program.build import DEFAULT_OUTPUT
from coordinator_program.spec.errors import MalformedInstruction

LOADER_V3 = Pubkey.from_string("BPFLoaderUpgradeab1e11111111111111111111111")
SOL = 10**9


def signed(chain: LocalChain, payer: Keypair, instructions: list[Instruction], *others: Keypair,
           blockhash: Hash | None = None) -> VersionedTransaction:
    message = Message.new_with_blockhash(instructions, payer.pubkey(), blockhash or chain.latest_blockhash[0])
    return VersionedTransaction(message, [payer, *others])


def clock_sysvar(chain: LocalChain) -> tuple[int, int]:
    account = chain.account(CLOCK)
    assert account is not None
    slot, _, _, _, unix_timestamp = struct.unpack("<QqQQq", bytes(account.data))
    return slot, unix_timestamp


def test_each_block_takes_the_wall_clock_which_never_goes_back() -> None:
    now = [1_800_000_000.7]
    chain = LocalChain(clock=lambda: now[0])
    assert clock_sysvar(chain) == (0, 1_800_000_000)
    now[0] += 42
    chain.airdrop(Keypair().pubkey(), SOL)
    assert clock_sysvar(chain) == (1, 1_800_000_042)
    now[0] -= 100  # the host's clock stepped back: the chain's time does not
    chain.airdrop(Keypair().pubkey(), SOL)
    assert clock_sysvar(chain) == (2, 1_800_000_042)


def test_a_blockhash_is_accepted_for_a_window_of_blocks() -> None:
    chain = LocalChain()
    payer, receiver = Keypair(), Keypair()
    chain.airdrop(payer.pubkey(), SOL)
    first = chain.latest_blockhash[0]
    for _ in range(RECENT_BLOCKHASHES - 1):
        chain.airdrop(receiver.pubkey(), 1)
    payment = transfer(TransferParams(from_pubkey=payer.pubkey(), to_pubkey=receiver.pubkey(), lamports=5))
    accepted = chain.send(signed(chain, payer, [payment], blockhash=first))
    assert accepted is not None and accepted.err is None
    chain.airdrop(receiver.pubkey(), 1)
    late = signed(chain, payer, [transfer(TransferParams(from_pubkey=payer.pubkey(), to_pubkey=receiver.pubkey(),
                                                         lamports=6))], blockhash=first)
    assert chain.simulate(late).err == TransactionErrorFieldless.BlockhashNotFound
    assert chain.send(late, preflight=False) is None  # dropped, as a validator drops it
    assert chain.status(late.signatures[0]) is None


def test_a_program_deployed_through_loader_v3_runs_from_the_next_block() -> None:
    chain = LocalChain()
    payer, buffer, program = Keypair(), Keypair(), Keypair()
    chain.airdrop(payer.pubkey(), 100 * SOL)
    elf = DEFAULT_OUTPUT.read_bytes()

    def send(instructions: list[Instruction], *others: Keypair) -> None:
        outcome = chain.send(signed(chain, payer, instructions, *others))
        assert outcome is not None and outcome.err is None, outcome

    def owned_by_loader(account: Keypair, space: int) -> Instruction:
        return create_account(CreateAccountParams(from_pubkey=payer.pubkey(), to_pubkey=account.pubkey(),
                                                  lamports=chain.rent_exempt_minimum(space), space=space,
                                                  owner=LOADER_V3))

    def loader(tag: int, data: bytes, *accounts: tuple[Pubkey, bool, bool]) -> Instruction:
        return Instruction(LOADER_V3, struct.pack("<I", tag) + data, [AccountMeta(*a) for a in accounts])

    send([owned_by_loader(buffer, 37 + len(elf)),  # InitializeBuffer, then Write in chunks
          loader(0, b"", (buffer.pubkey(), False, True), (payer.pubkey(), False, False))], buffer)
    for offset in range(0, len(elf), 900):
        chunk = elf[offset:offset + 900]
        send([loader(1, struct.pack("<IQ", offset, len(chunk)) + chunk, (buffer.pubkey(), False, True),
                     (payer.pubkey(), True, False))])
    programdata, _ = Pubkey.find_program_address([bytes(program.pubkey())], LOADER_V3)
    send([owned_by_loader(program, 36),  # DeployWithMaxDataLen
          loader(2, struct.pack("<Q", len(elf)), (payer.pubkey(), True, True), (programdata, False, True),
                 (program.pubkey(), False, True), (buffer.pubkey(), False, True), (RENT, False, False),
                 (CLOCK, False, False), (SYSTEM_PROGRAM_ID, False, False), (payer.pubkey(), True, False))], program)

    call = Instruction(program.pubkey(), b"", [AccountMeta(payer.pubkey(), True, False)])
    ran = chain.simulate(signed(chain, payer, [call]))
    assert ran.err is not None and ran.err.err == InstructionErrorCustom(MalformedInstruction.code), ran.logs
