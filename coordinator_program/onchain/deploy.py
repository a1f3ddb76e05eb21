"""Deploy the coordinator program through the upgradeable loader (BPF loader v3), as ``solana program deploy``
does, so that deploying needs no Solana CLI.

A deployment writes the program into a fresh *buffer* account, in chunks small enough for one transaction
each (a transaction is at most 1,232 bytes), and then either

- deploys it (DeployWithMaxDataLen) when nothing lives at the program's address yet: the loader creates the
  program-data account with room for twice the program (room for later, larger versions), copies the
  buffer into it and makes the program account executable; the payer becomes the upgrade authority; or
- upgrades the program already there (Upgrade), which only its upgrade authority (the payer) may do: the
  loader swaps the buffer's bytes into the existing program-data account.

Either way the buffer's rent comes back to the payer. Everything goes through JSON-RPC with solana-py's
``AsyncClient``, so the same code deploys to a cluster or to ``psyswarm localnet``. Every failure is a
``DeployError`` whose message says what to do; a deployment that fails after funding its buffer closes the
buffer, so that only fees are lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import httpx
from solana.exceptions import SolanaRpcException
from solana.rpc.async_api import AsyncClient
from solana.rpc.commitment import Confirmed
from solana.rpc.core import RPCException
from solana.rpc.types import TxOpts
from solders.hash import Hash
from solders.instruction import AccountMeta, Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.rpc.errors import SendTransactionPreflightFailureMessage
from solders.signature import Signature
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.system_program import CreateAccountParams, create_account
from solders.sysvar import CLOCK, RENT
from solders.transaction import VersionedTransaction
from solders.transaction_status import TransactionConfirmationStatus

from coordinator_program.spec.limits import SOLANA_TX_LIMIT

LOADER_V3 = Pubkey.from_string("BPFLoaderUpgradeab1e11111111111111111111111")
BUFFER_HEADER = 37
"""UpgradeableLoaderState::Buffer before the program bytes: u32 tag, Option<Pubkey> authority."""
PROGRAM_ACCOUNT_SIZE = 36
"""UpgradeableLoaderState::Program: u32 tag, the program-data address."""
PROGRAMDATA_HEADER = 45
"""UpgradeableLoaderState::ProgramData before the program bytes: u32 tag, u64 slot, Option<Pubkey> authority."""
_PROGRAM_TAG, _PROGRAMDATA_TAG = 2, 3
MAX_LEN_FACTOR = 2
"""A new program-data account holds this many times the program, as the Solana CLI's default, so that
upgrades to a larger program fit."""
LAMPORTS_PER_SIGNATURE = 5_000
"""The base fee of a signature on every cluster (no priority fee is paid)."""
RPC_TIMEOUT = 30.0
POLL_INTERVAL = 0.4
CONFIRM_TIMEOUT = 90.0
"""How long to wait for a batch of transactions before sending the unconfirmed ones again, for an RPC whose
block height does not advance while nothing is sent (a local chain)."""
SEND_ATTEMPTS = 5
MAX_STATUSES = 256
"""Signatures per getSignatureStatuses call (the RPC's limit)."""
LOG_LINES = 12
"""Program log lines quoted in an error (the loader's reason is at the end)."""

T = TypeVar("T")
Progress = Callable[[int, int], None]
"""Called with (chunks written, chunks in all) as the writes are confirmed."""


class DeployError(RuntimeError):
    """The deployment cannot go on; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class DeployResult:
    program_id: Pubkey
    upgraded: bool
    chunks: int
    signature: Signature
    """Of the transaction that deployed or upgraded the program."""


# --- loader-v3 instructions (UpgradeableLoaderInstruction: a bincode u32 tag, then the fields) -----------

def _loader(tag: int, payload: bytes, accounts: list[AccountMeta]) -> Instruction:
    return Instruction(LOADER_V3, tag.to_bytes(4, "little") + payload, accounts)


def _w(key: Pubkey, signer: bool = False) -> AccountMeta:
    return AccountMeta(key, is_signer=signer, is_writable=True)


def _r(key: Pubkey, signer: bool = False) -> AccountMeta:
    return AccountMeta(key, is_signer=signer, is_writable=False)


def programdata_address(program_id: Pubkey) -> Pubkey:
    return Pubkey.find_program_address([bytes(program_id)], LOADER_V3)[0]


def create_loader_account(payer: Pubkey, new: Pubkey, lamports: int, space: int) -> Instruction:
    """A system create_account of an account the loader will own (a buffer, or the program account)."""
    return create_account(CreateAccountParams(from_pubkey=payer, to_pubkey=new, lamports=lamports, space=space,
                                              owner=LOADER_V3))


def initialize_buffer(buffer: Pubkey, authority: Pubkey) -> Instruction:
    return _loader(0, b"", [_w(buffer), _r(authority)])


def write(buffer: Pubkey, authority: Pubkey, offset: int, chunk: bytes) -> Instruction:
    """Write ``chunk`` at ``offset`` of the program held by ``buffer`` (Write: u32 offset, then Vec<u8>)."""
    payload = offset.to_bytes(4, "little") + len(chunk).to_bytes(8, "little") + chunk
    return _loader(1, payload, [_w(buffer), _r(authority, signer=True)])


def deploy_with_max_data_len(payer: Pubkey, program_id: Pubkey, buffer: Pubkey, authority: Pubkey,
                             max_data_len: int) -> Instruction:
    accounts = [_w(payer, signer=True), _w(programdata_address(program_id)), _w(program_id), _w(buffer),
                _r(RENT), _r(CLOCK), _r(SYSTEM_PROGRAM_ID), _r(authority, signer=True)]
    return _loader(2, max_data_len.to_bytes(8, "little"), accounts)


def upgrade(program_id: Pubkey, buffer: Pubkey, authority: Pubkey, spill: Pubkey) -> Instruction:
    """Replace the program's code with the buffer's; the buffer's lamports go to ``spill``."""
    accounts = [_w(programdata_address(program_id)), _w(program_id), _w(buffer), _w(spill), _r(RENT), _r(CLOCK),
                _r(authority, signer=True)]
    return _loader(3, b"", accounts)


def close_buffer(buffer: Pubkey, recipient: Pubkey, authority: Pubkey) -> Instruction:
    return _loader(5, b"", [_w(buffer), _w(recipient), _r(authority, signer=True)])


def transaction_size(instructions: Sequence[Instruction], payer: Pubkey, signatures: int) -> int:
    """Bytes of the signed transaction: a compact signature count, the signatures, the message."""
    return 1 + 64 * signatures + len(bytes(Message.new_with_blockhash(instructions, payer, Hash.default())))


def write_chunk_size(payer: Pubkey) -> int:
    """The most program bytes one Write transaction, paid and signed by ``payer``, carries within the limit."""
    probe = 512  # long enough that the data's length prefix takes its two-byte form, as in a full chunk
    overhead = transaction_size([write(Pubkey.default(), payer, 0, bytes(probe))], payer, 1) - probe
    return SOLANA_TX_LIMIT - overhead


def sol(lamports: int) -> str:
    """Lamports as SOL for messages, to six decimals (a signature's fee is 0.000005 SOL)."""
    return f"{lamports / 10**9:,.6f} SOL"


# --- deploying over JSON-RPC ---------------------------------------------------------------------------

async def deploy(url: str, payer: Keypair, program_keypair: Keypair, program: bytes,
                 progress: Progress | None = None) -> DeployResult:
    """Deploy ``program`` at ``program_keypair``'s address, or upgrade the program already there.

    ``payer`` pays the rent and fees and is (or becomes) the upgrade authority.
    """
    async with AsyncClient(url, commitment=Confirmed, timeout=RPC_TIMEOUT) as client:
        return await _Deployment(client, url, payer, program_keypair, program, progress).run()


class _Deployment:
    """One deployment over one RPC connection: the checks, then the transactions, in order."""

    def __init__(self, client: AsyncClient, url: str, payer: Keypair, program_keypair: Keypair, program: bytes,
                 progress: Progress | None) -> None:
        self.client, self.url, self.payer, self.program = client, url, payer, program
        self.program_keypair = program_keypair
        self.program_id = program_keypair.pubkey()
        self.progress = progress or (lambda done, total: None)

    async def run(self) -> DeployResult:
        upgrading = await self._check_existing()
        size = write_chunk_size(self.payer.pubkey())
        chunks = {offset: self.program[offset:offset + size] for offset in range(0, len(self.program), size)}
        buffer_size = BUFFER_HEADER + len(self.program)
        buffer_rent = await self._rent(buffer_size)
        max_data_len = MAX_LEN_FACTOR * len(self.program)
        account_rent = 0 if upgrading else await self._rent(PROGRAM_ACCOUNT_SIZE)
        programdata_rent = 0 if upgrading else await self._rent(PROGRAMDATA_HEADER + max_data_len)
        fees = LAMPORTS_PER_SIGNATURE * (2 + len(chunks) + (1 if upgrading else 2))
        await self._check_funds(buffer_rent, account_rent + programdata_rent, fees)

        buffer = Keypair()
        payer = self.payer.pubkey()
        await self._send([create_loader_account(payer, buffer.pubkey(), buffer_rent, buffer_size),
                          initialize_buffer(buffer.pubkey(), payer)], [buffer], "creating the buffer")
        try:
            await self._write(buffer.pubkey(), chunks)
            if upgrading:
                final = [upgrade(self.program_id, buffer.pubkey(), payer, payer)]
                signature = await self._send(final, [], "upgrading the program")
            else:
                final = [create_loader_account(payer, self.program_id, account_rent, PROGRAM_ACCOUNT_SIZE),
                         deploy_with_max_data_len(payer, self.program_id, buffer.pubkey(), payer, max_data_len)]
                signature = await self._send(final, [self.program_keypair], "deploying the program")
        except DeployError as exc:
            raise DeployError(f"{exc}\n{await self._recover(buffer.pubkey())}") from None
        return DeployResult(self.program_id, upgrading, len(chunks), signature)

    # --- checks before spending anything --------------------------------------------------------------

    async def _check_existing(self) -> bool:
        """False when the program's address is free; True when it holds a program this payer may upgrade
        to the new code. Anything else is a DeployError, raised before anything is spent."""
        account = (await self._rpc("reading the program account", self.client.get_account_info(self.program_id))).value
        if account is None:
            return False
        data = bytes(account.data)
        if account.owner != LOADER_V3 or int.from_bytes(data[:4], "little") != _PROGRAM_TAG:
            raise DeployError(
                f"{self.program_id} already holds an account that is not an upgradeable program (owner "
                f"{account.owner}), so nothing can be deployed there; deploy to a new address with "
                "--program-keypair (psyswarm localnet loads the coordinator at the default address itself)")
        programdata = (await self._rpc("reading the program data", self.client.get_account_info(
            programdata_address(self.program_id)))).value
        stored = b"" if programdata is None else bytes(programdata.data)
        if int.from_bytes(stored[:4], "little") != _PROGRAMDATA_TAG:
            raise DeployError(f"program {self.program_id} was closed: it cannot be deployed again at that address")
        if stored[12] == 0:
            raise DeployError(f"program {self.program_id} is immutable (it has no upgrade authority)")
        authority = Pubkey.from_bytes(stored[13:45])
        if authority != self.payer.pubkey():
            raise DeployError(f"only the upgrade authority of program {self.program_id}, {authority}, may upgrade "
                              f"it; pass its keypair with --keypair (yours is {self.payer.pubkey()})")
        capacity = len(stored) - PROGRAMDATA_HEADER
        if capacity < len(self.program):
            raise DeployError(f"program {self.program_id} has room for {capacity:,} bytes, and the new program has "
                              f"{len(self.program):,}: extend its program data (`solana program extend "
                              f"{self.program_id} {len(self.program) - capacity}`) or deploy to a new address")
        return True

    async def _check_funds(self, buffer_rent: int, program_rent: int, fees: int) -> None:
        need = buffer_rent + program_rent + fees
        balance = (await self._rpc("reading the payer's balance", self.client.get_balance(self.payer.pubkey()))).value
        if balance < need:
            parts = [f"{sol(buffer_rent)} that the buffer holds until the end"]
            if program_rent:
                parts.append(f"{sol(program_rent)} for the program's accounts")
            parts.append(f"{sol(fees)} in fees")
            raise DeployError(
                f"insufficient funds: deploying needs {sol(need)} ({', '.join(parts)}), and {self.payer.pubkey()} "
                f"holds {sol(balance)}; fund it with {sol(need - balance)} more (on devnet: `solana airdrop`; "
                "on psyswarm localnet: --fund at start, or requestAirdrop)")

    # --- transactions ---------------------------------------------------------------------------------

    async def _rpc(self, what: str, request: Awaitable[T]) -> T:
        """Await an RPC call, turning transport and RPC failures into DeployErrors that say what was done."""
        try:
            return await request
        except SolanaRpcException as exc:
            cause = exc.__cause__
            if isinstance(cause, httpx.TransportError):
                raise DeployError(f"cannot reach the RPC server at {self.url} ({what}): {cause or type(cause)}; "
                                  "is the URL right and the node running?") from None
            raise DeployError(f"the RPC server at {self.url} failed while {what}: {cause or exc.error_msg}") from None
        except RPCException as exc:
            raise DeployError(f"{what}: {_rpc_error_text(exc.args[0] if exc.args else exc)}") from None

    async def _rent(self, size: int) -> int:
        return (await self._rpc("reading the rent", self.client.get_minimum_balance_for_rent_exemption(size))).value

    async def _blockhash(self) -> tuple[Hash, int]:
        latest = (await self._rpc("fetching a blockhash", self.client.get_latest_blockhash())).value
        return latest.blockhash, latest.last_valid_block_height

    def _sign(self, instructions: Sequence[Instruction], signers: Sequence[Keypair], blockhash: Hash) -> \
            VersionedTransaction:
        message = Message.new_with_blockhash(list(instructions), self.payer.pubkey(), blockhash)
        return VersionedTransaction(message, [self.payer, *signers])

    async def _submit(self, tx: VersionedTransaction, what: str, preflight: bool) -> Signature:
        opts = TxOpts(skip_preflight=not preflight, preflight_commitment=Confirmed)
        return (await self._rpc(what, self.client.send_raw_transaction(bytes(tx), opts))).value

    async def _send(self, instructions: Sequence[Instruction], signers: Sequence[Keypair], what: str) -> Signature:
        """Send one transaction (simulated first, so a failure comes with the program's logs) and wait until
        it is confirmed, sending it again with a new blockhash if the old one expires first."""
        for _ in range(SEND_ATTEMPTS):
            blockhash, last_valid = await self._blockhash()
            signature = await self._submit(self._sign(instructions, signers, blockhash), what, preflight=True)
            if await self._confirm({signature: what}, last_valid, lambda _: None):
                return signature
        raise DeployError(f"{what}: not confirmed after {SEND_ATTEMPTS} attempts; the cluster may be congested, "
                          "try again")

    async def _write(self, buffer: Pubkey, chunks: dict[int, bytes]) -> None:
        """Send every Write at once, then resend those not confirmed before their blockhash expired."""
        remaining = dict(chunks)
        total = len(chunks)
        sent: dict[Signature, int] = {}  # the offset each signature of the current attempt writes
        self.progress(0, total)

        def written(signature: Signature) -> None:
            del remaining[sent[signature]]
            self.progress(total - len(remaining), total)

        for _ in range(SEND_ATTEMPTS):
            blockhash, last_valid = await self._blockhash()
            sent = {}
            for offset, chunk in remaining.items():  # simulating each write would only slow them down
                tx = self._sign([write(buffer, self.payer.pubkey(), offset, chunk)], [], blockhash)
                sent[await self._submit(tx, _writing(offset), preflight=False)] = offset
            await self._confirm({s: _writing(offset) for s, offset in sent.items()}, last_valid, written)
            if not remaining:
                return
        raise DeployError(f"{len(remaining)} of {total} chunks were not confirmed after {SEND_ATTEMPTS} attempts; "
                          "the cluster may be congested, try again")

    async def _confirm(self, pending: dict[Signature, str], last_valid: int,
                       on_confirmed: Callable[[Signature], None]) -> bool:
        """Poll until every transaction is confirmed (True), or until their blockhash expired (False). One
        that landed with an error is a DeployError naming what it was doing."""
        waiting = dict(pending)
        deadline = time.monotonic() + CONFIRM_TIMEOUT
        while True:
            batch = list(waiting)[:MAX_STATUSES]
            statuses = (await self._rpc("confirming transactions", self.client.get_signature_statuses(batch))).value
            for signature, status in zip(batch, statuses, strict=True):
                if status is None:
                    continue
                if status.err is not None:
                    raise DeployError(f"{waiting[signature]} failed: {status.err}")
                if status.confirmation_status in (TransactionConfirmationStatus.Confirmed,
                                                  TransactionConfirmationStatus.Finalized):
                    del waiting[signature]
                    on_confirmed(signature)
            if not waiting:
                return True
            if time.monotonic() > deadline:
                return False
            height = (await self._rpc("reading the block height", self.client.get_block_height())).value
            if height > last_valid:
                return False
            await asyncio.sleep(POLL_INTERVAL)

    async def _recover(self, buffer: Pubkey) -> str:
        """After a failure: close the buffer so its rent comes back, and say whether that worked."""
        try:
            await self._send([close_buffer(buffer, self.payer.pubkey(), self.payer.pubkey())], [],
                             "closing the buffer")
        except DeployError as exc:
            return (f"The buffer {buffer} still holds its rent ({exc}); recover it with "
                    f"`solana program close {buffer}`.")
        return f"The buffer {buffer} was closed and its rent returned to {self.payer.pubkey()}."


def _writing(offset: int) -> str:
    return f"writing bytes {offset:,}+ of the program"


def _rpc_error_text(error: object) -> str:
    """An RPC error's message; for a failed simulation, with the end of the program logs (the reason)."""
    if isinstance(error, SendTransactionPreflightFailureMessage):
        logs = error.data.logs or []
        tail = "".join(f"\n  {line}" for line in logs[-LOG_LINES:])
        return f"{error.message}{tail}"
    return str(getattr(error, "message", error))
