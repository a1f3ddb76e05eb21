"""The coordinator reached as a Solana program, on a cluster or on ``psyswarm localnet``.

- Instructions are built by anchorpy's ``Program`` from the committed IDL, with the accounts that
  ``coordinator_program.spec.instructions`` declares, and sent with solana-py's ``AsyncClient``; the client is
  the fee payer. A rejection by the program comes back as its custom error code, raised here as the same
  ``CoordinatorError`` the TCP backend raises; anything else (no funds, an unreachable node, an expired
  blockhash) is a ``BackendError`` that says what happened.
- A run is found from its id alone: the instance PDA ``["coordinator", run_id]`` names the coordinator
  account. ``create_run`` puts that account at ``create_with_seed(creator, run_id, program)`` so that the
  creator knows it offline and a second creation of the same run fails before any transaction. Anyone can
  send lamports to both addresses before the run exists, so neither is made with a CreateAccount (which fails
  on an address holding any): the client tops the coordinator account up to rent exemption and allocates it
  with its seed, and the program does the same for the instance PDA with the PDA's seeds.
- A run with a join authority needs each join_run co-signed by it. The authority co-signs the transaction
  itself: the backend builds the message, hands its bytes to the ``Cosigner`` (a keypair, or the client's
  session with the run's auth service, which checks the message and answers with its signature), and adds
  that signature as a ``Presigner``; the program checks nothing new, as the authorizer is a signer of join_run.
- The state is followed as Psyche's clients follow it: ``accountSubscribe`` over the cluster's websocket,
  ignoring notifications whose nonce is not newer (the base class does), and polling the account when the
  websocket is unavailable. After each instruction the account is read again, so the caller sees its effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from anchorpy import Context, Idl, Program, Provider, Wallet
from pyheck import snake
from solana.exceptions import SolanaRpcException
from solana.rpc.async_api import AsyncClient
from solana.rpc.commitment import Commitment, Confirmed
from solana.rpc.core import RPCException, TransactionExpiredBlockheightExceededError
from solana.rpc.types import TxOpts
from solana.rpc.websocket_api import SubscriptionError, connect
from solders.compute_budget import set_compute_unit_limit
from solders.errors import SignerError
from solders.instruction import Instruction as SolanaInstruction
from solders.keypair import Keypair
from solders.message import Message
from solders.presigner import Presigner
from solders.pubkey import Pubkey
from solders.rpc.errors import SendTransactionPreflightFailureMessage
from solders.rpc.responses import AccountNotification
from solders.signature import Signature
from solders.system_program import ID as SYSTEM_PROGRAM_ID
from solders.system_program import AllocateWithSeedParams, TransferParams, allocate_with_seed, transfer
from solders.transaction import VersionedTransaction
from solders.transaction_status import (
    InstructionErrorCustom,
    TransactionErrorFieldless,
    TransactionErrorInstructionError,
    TransactionErrorType,
)
from websockets.exceptions import WebSocketException

from client.backends.base import Backend, BackendError
from coordinator_program.onchain.budget import requested_units
from coordinator_program.onchain.idl import IDL_PATH
from coordinator_program.onchain.instance import decode_instance, instance_address
from coordinator_program.onchain.program_id import PROGRAM_ID
from coordinator_program.spec.config import RunSpec
from coordinator_program.spec.errors import BY_CODE
from coordinator_program.spec.instructions import (
    CloseRun,
    InitCoordinator,
    Instruction,
    JoinRun,
    SetPaused,
    Tick,
    Update,
)
from coordinator_program.spec.layout import LayoutError
from coordinator_program.spec.state import ACCOUNT_SIZE, decode_state

log = logging.getLogger("psyswarm.solana")

MONIKERS = {
    "localhost": "http://127.0.0.1:8899",
    "devnet": "https://api.devnet.solana.com",
    "testnet": "https://api.testnet.solana.com",
    "mainnet-beta": "https://api.mainnet-beta.solana.com",
}
"""The Solana CLI's ``--url`` monikers; their first letters are accepted too, as the CLI accepts them."""
POLL_INTERVAL = 1.0
POLLS_BEFORE_RESUBSCRIBING = 10
CONFIRM_POLL = 0.25
def resolve_url(url: str) -> str:
    """A moniker (localhost, devnet, testnet, mainnet-beta, or l/d/t/m) or an http(s) URL → the RPC URL."""
    for moniker, address in MONIKERS.items():
        if url in (moniker, moniker[0]):
            return address
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BackendError(f"--url must be an http(s) RPC URL or one of {', '.join(MONIKERS)}, not {url!r}")
    return url


def reason(exc: BaseException) -> str:
    """Why a request failed, never empty: solana-py's exceptions often carry their reason only in their cause."""
    for cause in (exc, exc.__cause__, exc.__context__):
        if cause is not None and str(cause).strip():
            return str(cause).strip()
    return type(exc).__name__


def websocket_url(rpc_url: str) -> str:
    """The pubsub URL the Solana CLI derives from an RPC URL: ws(s)://, and port + 1 when a port is given."""
    parts = urlsplit(rpc_url)
    netloc = parts.netloc
    if parts.port is not None:
        netloc = f"{netloc.rsplit(':', 1)[0]}:{parts.port + 1}"
    return urlunsplit(("wss" if parts.scheme == "https" else "ws", netloc, parts.path, parts.query, ""))


@functools.cache
def _idl() -> tuple[Idl, dict[str, Any]]:
    """The IDL as anchorpy parses it, and as JSON (whose type names drive the argument conversion)."""
    text = IDL_PATH.read_text()
    return Idl.from_json(text), json.loads(text)


class Cosigner(Protocol):
    """What co-signs a join: a ``Keypair``, or anything that signs like one (``client.join.auth.AuthSession``
    asks the run's auth service)."""

    def pubkey(self) -> Pubkey: ...

    def sign_message(self, message: bytes) -> Signature: ...


class SolanaBackend(Backend):
    """One run's coordinator on a Solana cluster, reached through its RPC and pubsub endpoints."""

    def __init__(self, url: str, keypair: Keypair, run_id: str, *, program_id: Pubkey = PROGRAM_ID,
                 authorizer: Cosigner | None = None, ws_url: str | None = None,
                 commitment: Commitment = Confirmed, poll_interval: float = POLL_INTERVAL) -> None:
        super().__init__()
        self.url = resolve_url(url)
        self.ws_url = ws_url or websocket_url(self.url)
        self.keypair, self.authorizer, self.run_id = keypair, authorizer, run_id
        self.program_id, self.commitment, self.poll_interval = program_id, commitment, poll_interval
        self.instance_address, _ = instance_address(program_id, run_id)
        self.coordinator_address: Pubkey | None = None
        self.client = AsyncClient(self.url, commitment=commitment)
        idl, self._idl_json = _idl()
        self.program = Program(idl, program_id, Provider(self.client, Wallet(keypair)))
        self._follower: asyncio.Task[None] | None = None

    @property
    def identity(self) -> bytes:
        return bytes(self.keypair.pubkey())

    # --- connecting and following ---------------------------------------------------------------------

    async def connect(self) -> None:
        """Find the run's coordinator account through its instance PDA, read it, and start following it.
        On failure the HTTP client is closed too, so that retrying with fresh backends leaks nothing."""
        try:
            data = await self._read(self.instance_address)
            if not data:  # no account, or only lamports someone sent to the address
                raise BackendError(f"run {self.run_id!r} does not exist on {self.url} (no instance account "
                                   f"{self.instance_address} under program {self.program_id}); create it with "
                                   "`psyswarm create-run`, or check --run-id and --program-id", permanent=True)
            try:
                self.coordinator_address = Pubkey.from_bytes(decode_instance(data).coordinator_account)
            except LayoutError as exc:
                raise BackendError(f"{self.instance_address} is not a coordinator instance: {exc}",
                                   permanent=True) from None
            await self.refresh()
        except BackendError:
            await self.client.close()
            raise
        self._follower = asyncio.create_task(self._follow())

    async def _read(self, address: Pubkey) -> bytes | None:
        try:
            account = (await self.client.get_account_info(address, encoding="base64")).value
        except (SolanaRpcException, RPCException, OSError) as exc:
            raise BackendError(f"cannot read {address} from the Solana RPC at {self.url}: {reason(exc)}") from None
        return None if account is None else bytes(account.data)

    async def refresh(self) -> None:
        """Read the coordinator account now and adopt it if it is newer."""
        assert self.coordinator_address is not None, "connect() first"
        await self._adopt(await self._read(self.coordinator_address))

    async def _adopt(self, data: bytes | None) -> None:
        if not data:  # a closed account reads as missing, and is notified as empty
            raise BackendError(f"run {self.run_id!r} was closed: its coordinator account "
                               f"{self.coordinator_address} is gone", permanent=True)
        try:
            state = decode_state(data)
        except LayoutError as exc:
            raise BackendError(f"the coordinator account does not decode: {exc}; update psyswarm to the run's "
                               "version", permanent=True) from None
        await self._publish(state)

    async def _follow(self) -> None:
        """Subscribe; while the websocket is unavailable, poll, then try subscribing again. Give up (closing
        the backend, so followers raise) only when the RPC itself cannot be read."""
        try:
            while True:
                try:
                    await self._subscribe()
                except (OSError, WebSocketException, TimeoutError, SubscriptionError) as exc:
                    log.info("no account subscription at %s (%s); polling every %.1f s", self.ws_url, exc,
                             self.poll_interval)
                for _ in range(POLLS_BEFORE_RESUBSCRIBING):
                    await asyncio.sleep(self.poll_interval)
                    await self.refresh()
        except BackendError as exc:
            await self._mark_closed(str(exc), permanent=exc.permanent)

    async def _subscribe(self) -> None:
        async with connect(self.ws_url, open_timeout=10) as ws:
            await ws.account_subscribe(self.coordinator_address, self.commitment, "base64")
            await ws.recv()  # the subscription id; an error reply raises here
            await self.refresh()  # whatever changed between the first read and the subscription
            async for messages in ws:
                for message in messages:
                    if isinstance(message, AccountNotification):
                        await self._adopt(bytes(message.result.value.data))

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        await self.client.close()

    # --- sending --------------------------------------------------------------------------------------

    def instruction(self, ix: Instruction) -> SolanaInstruction:
        """``ix`` as anchorpy builds it from the IDL, with the accounts its ACCOUNTS list names."""
        assert self.coordinator_address is not None, "connect() first"
        me = self.keypair.pubkey()
        known = {"signer": me, "payer": me, "authorizer": (self.authorizer or self.keypair).pubkey(),
                 "coordinatorInstance": self.instance_address, "coordinatorAccount": self.coordinator_address,
                 "systemProgram": SYSTEM_PROGRAM_ID}
        accounts = {snake(meta.name): known[meta.name] for meta in ix.ACCOUNTS}
        idl_ix = next(i for i in self._idl_json["instructions"] if snake(i["name"]) == ix.NAME)
        args = [self._to_anchor(arg["type"], getattr(ix, snake(arg["name"]))) for arg in idl_ix["args"]]
        return self.program.instruction[ix.NAME](*args, ctx=Context(accounts=accounts))

    def _to_anchor(self, idl_type: Any, value: Any) -> Any:
        """A specification value (bytes, str, IntEnum, dataclass) as anchorpy wants it for ``idl_type``."""
        if idl_type == "publicKey":
            return Pubkey.from_bytes(value)
        if isinstance(idl_type, str):
            return value
        if "array" in idl_type:
            element, size = idl_type["array"]
            if element == "u8":
                return list(value.encode().ljust(size, b"\0") if isinstance(value, str) else value)
            return [self._to_anchor(element, item) for item in value]
        name = idl_type["defined"]
        definition = next(t["type"] for t in self._idl_json["types"] if t["name"] == name)
        python_type = self.program.type[name]
        if definition["kind"] == "enum":
            return getattr(python_type, value.name)()
        return python_type(**{snake(f["name"]): self._to_anchor(f["type"], getattr(value, snake(f["name"])))
                              for f in definition["fields"]})

    async def submit(self, ix: Instruction) -> None:
        self._check_open()
        cosigner = self.authorizer if isinstance(ix, JoinRun) else None
        units = requested_units(type(ix))  # a tick may elect a round's witnesses: it asks for more than the default
        budget = [] if units is None else [set_compute_unit_limit(units)]
        await self._send([*budget, self.instruction(ix)], ix.NAME, cosigner)
        await self.refresh()

    async def _send(self, instructions: list[SolanaInstruction], what: str, cosigner: Cosigner | None = None) -> None:
        """One transaction paid and signed by this client, and co-signed by ``cosigner`` when given; returns once
        it is confirmed, raises if it failed."""
        try:
            latest = (await self.client.get_latest_blockhash()).value
            message = Message.new_with_blockhash(instructions, self.keypair.pubkey(), latest.blockhash)
            transaction = await self._signed(message, cosigner, what)
            sent = await self.client.send_transaction(
                transaction, TxOpts(skip_confirmation=True, preflight_commitment=self.commitment))
            statuses = await self.client.confirm_transaction(
                sent.value, self.commitment, CONFIRM_POLL, latest.last_valid_block_height)
        except RPCException as exc:
            raise self._rejection(exc.args[0], instructions, what) from None
        except TransactionExpiredBlockheightExceededError:
            raise BackendError(f"{what} was not confirmed before its blockhash expired; send it again") from None
        except (SolanaRpcException, OSError) as exc:
            raise BackendError(f"cannot reach the Solana RPC at {self.url}: {reason(exc)}") from None
        status = statuses.value[0]
        if status is not None and status.err is not None:
            raise self._failure(status.err, [], instructions, what)

    async def _signed(self, message: Message, cosigner: Cosigner | None, what: str) -> VersionedTransaction:
        """``message`` signed by this client and by ``cosigner`` (asked off the event loop: an auth service
        answers over HTTP)."""
        signers: list[Keypair | Presigner] = [self.keypair]
        if cosigner is not None and cosigner.pubkey() != self.keypair.pubkey():
            signature = await asyncio.to_thread(cosigner.sign_message, bytes(message))
            signers.append(Presigner(cosigner.pubkey(), signature))
        try:
            return VersionedTransaction(message, signers)
        except SignerError:  # only the co-signer's signature can fail to be one over this message
            raise BackendError(f"{what}: the co-signature of {signers[-1].pubkey()} does not verify over this "
                               "transaction") from None

    def _rejection(self, error: Any, instructions: list[SolanaInstruction], what: str) -> Exception:
        """The exception for an RPC error reply to sendTransaction."""
        if isinstance(error, SendTransactionPreflightFailureMessage) and error.data.err is not None:
            return self._failure(error.data.err, error.data.logs or [], instructions, what)
        return BackendError(f"the Solana RPC at {self.url} refused {what}: {getattr(error, 'message', error)}")

    def _failure(self, err: TransactionErrorType, logs: list[str], instructions: list[SolanaInstruction],
                 what: str) -> Exception:
        """The coordinator's own error when the program rejected an instruction; a BackendError otherwise."""
        if (isinstance(err, TransactionErrorInstructionError) and isinstance(err.err, InstructionErrorCustom)
                and instructions[err.index].program_id == self.program_id and err.err.code in BY_CODE):
            return BY_CODE[err.err.code]()
        if err in (TransactionErrorFieldless.AccountNotFound, TransactionErrorFieldless.InsufficientFundsForFee):
            return BackendError(f"{what}: {self.keypair.pubkey()} has no SOL to pay the fee on {self.url}; fund it "
                                f"first: `psyswarm airdrop -u {self.url} -k KEYPAIR_FILE` (localnet, devnet, testnet), "
                                "or send it SOL", permanent=True)
        detail = "; ".join(logs[-3:])
        return BackendError(f"{what} failed on chain: {err}" + (f" ({detail})" if detail else ""))

    # --- operations beyond the common interface -------------------------------------------------------

    async def close_run(self) -> None:
        """Close this run (its main authority, once it is halted): both of its accounts give their rent back to the
        signer and vanish, so there is no state to read afterwards; followers are told the run was closed."""
        self._check_open()
        await self._send([self.instruction(CloseRun())], CloseRun.NAME)
        await self._mark_closed(f"run {self.run_id!r} was closed", permanent=True)

    async def update(self, spec: RunSpec) -> None:
        """Replace the run's config, model and checkpoint (the main authority only, while the run is halted)."""
        await self.submit(Update(spec.config, spec.model, spec.checkpoint))

    async def create_run(self, spec: RunSpec, join_authority: bytes) -> None:
        """Create, configure and start this backend's run in one transaction, then connect to it.

        The transaction creates the coordinator account (too large to be created by the program), then runs
        init_coordinator, update, set_paused(false) and a tick, so a run is either created whole and waiting
        for members, or not at all. ``join_authority`` must co-sign every join (the run's auth service's key);
        ``rules.NO_AUTHORITY`` lets anyone join, which is for the creator to choose, so there is no default.
        """
        if spec.run_id != self.run_id:
            raise BackendError(f"the config describes run {spec.run_id!r}, not {self.run_id!r}")
        if await self._read(self.instance_address):  # lamports alone at the address (anyone may send them) are no run
            raise BackendError(f"run {self.run_id!r} already exists on {self.url} (instance {self.instance_address})")
        me = self.keypair.pubkey()
        self.coordinator_address = Pubkey.create_with_seed(me, self.run_id, self.program_id)
        steps = (InitCoordinator(self.run_id, bytes(me), join_authority),
                 Update(spec.config, spec.model, spec.checkpoint), SetPaused(False), Tick())
        await self._send([*await self._allocate_coordinator_account(), *map(self.instruction, steps)], "create-run")
        await self.connect()

    async def _allocate_coordinator_account(self) -> list[SolanaInstruction]:
        """The system instructions that make the coordinator account: a transfer of what rent exemption still
        lacks, then ``allocate_with_seed``, which also assigns it to the program.

        createAccountWithSeed would fail, and block the run id for ever, on an address that already holds
        lamports, and anyone may send some there. This way tolerates them, even ones sent after the balance was
        read: they only make the account hold more than it needs.
        """
        me, address = self.keypair.pubkey(), self.coordinator_address
        assert address is not None
        try:
            rent = (await self.client.get_minimum_balance_for_rent_exemption(ACCOUNT_SIZE)).value
            held = (await self.client.get_balance(address)).value
        except (SolanaRpcException, RPCException, OSError) as exc:
            raise BackendError(f"cannot reach the Solana RPC at {self.url}: {reason(exc)}") from None
        allocate = allocate_with_seed(AllocateWithSeedParams(
            address=address, base=me, seed=self.run_id, space=ACCOUNT_SIZE, owner=self.program_id))
        if held >= rent:
            return [allocate]
        return [transfer(TransferParams(from_pubkey=me, to_pubkey=address, lamports=rent - held)), allocate]
