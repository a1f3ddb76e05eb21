"""``psyswarm deploy`` against ``psyswarm localnet`` (a separate process, reached over JSON-RPC): a fresh deploy
that then runs the coordinator, upgrades, and the errors a user can meet."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import pytest
from solana.rpc.async_api import AsyncClient
from solders.instruction import Instruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.transaction import VersionedTransaction
from solders.transaction_status import InstructionErrorCustom, TransactionErrorInstructionError
from typer.testing import CliRunner

from client.cli import app
from client.identity import save_keypair
from coordinator_program.onchain import deploy
from coordinator_program.onchain.instance import CoordinatorInstance, encode_instance
from coordinator_program.onchain.program_id import PROGRAM_ID
from coordinator_program.program.build import DEFAULT_OUTPUT
from coordinator_program.spec import rules
from coordinator_program.spec.instructions import CloseRun, InitCoordinator
from coordinator_program.spec.state import ACCOUNT_SIZE, decode_state, encode_state
from tests.program.coordinator_chain import init_instructions, program_instruction
from tests.program.sbpf_harness import build_fixture, clang_missing
from tests.solana.conftest import Localnet

PROGRAM = DEFAULT_OUTPUT.read_bytes()
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Identity:
    """A keypair and its file: the CLI reads the file, the checks use the key."""

    keypair: Keypair
    path: str

    @property
    def key(self) -> Pubkey:
        return self.keypair.pubkey()


def identity(tmp_path: Path, name: str) -> Identity:
    keypair = Keypair()
    return Identity(keypair, str(save_keypair(keypair, tmp_path / f"{name}.json")))


@pytest.fixture
def payer(localnet: Localnet, tmp_path: Path) -> Identity:
    """A keypair file holding 10 SOL on the local chain (a deployment needs about 0.55)."""
    payer = identity(tmp_path, "payer")
    asyncio.run(localnet.fund(payer.keypair))
    return payer


def invoke(*args: str) -> tuple[int, str]:
    """Run the CLI in this process; the output without the frame typer draws around errors."""
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, re.sub(r"\s*[│╭╰─╮╯]+\s*", " ", result.output)


def cli_deploy(localnet: Localnet, payer: Identity, program: Identity) -> tuple[int, str]:
    return invoke("deploy", "--url", localnet.url, "--keypair", payer.path, "--program-keypair", program.path)


def query(localnet: Localnet, call: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """One or more RPC calls to the local chain, through the client every user of the chain has."""
    async def run() -> T:
        async with AsyncClient(localnet.url) as client:
            return await call(client)

    return asyncio.run(run())


def balance(localnet: Localnet, key: Pubkey) -> int:
    return query(localnet, lambda client: client.get_balance(key)).value


def rent(localnet: Localnet, size: int) -> int:
    return query(localnet, lambda client: client.get_minimum_balance_for_rent_exemption(size)).value


def account_data(localnet: Localnet, address: Pubkey) -> bytes | None:
    account = query(localnet, lambda client: client.get_account_info(address)).value
    return None if account is None else bytes(account.data)


async def signed(client: AsyncClient, instructions: Sequence[Instruction],
                 signers: Sequence[Keypair]) -> VersionedTransaction:
    """A transaction on a current blockhash, paid by ``signers[0]``."""
    blockhash = (await client.get_latest_blockhash()).value.blockhash
    return VersionedTransaction(Message.new_with_blockhash(list(instructions), signers[0].pubkey(), blockhash),
                                signers)


def send(localnet: Localnet, instructions: Sequence[Instruction], signers: Sequence[Keypair]) -> None:
    """Send one transaction and wait until it is confirmed."""
    async def run(client: AsyncClient) -> None:
        tx = await signed(client, instructions, signers)
        await client.confirm_transaction((await client.send_raw_transaction(bytes(tx))).value)

    query(localnet, run)


def run_and_close_a_coordinator(localnet: Localnet, authority: Keypair, program_id: Pubkey) -> None:
    """init_coordinator through ``program_id`` leaves the specification's state; close_run then removes both
    accounts: the deployed program is the coordinator."""
    coordinator = Keypair()
    init = InitCoordinator("deployed", bytes(authority.pubkey()), bytes(32))
    instructions, run = init_instructions(program_id, rent(localnet, ACCOUNT_SIZE), authority, coordinator, init)
    before = int(time.time())
    send(localnet, instructions, [authority, coordinator])
    created_at = decode_state(account_data(localnet, run.coordinator)).created_at  # the chain's clock (wall time)
    assert before - 1 <= created_at <= time.time() + 1
    state = rules.init_coordinator(init.run_id, init.main_authority, init.join_authority, created_at)
    assert account_data(localnet, run.coordinator) == encode_state(state)
    expected = CoordinatorInstance(init.run_id, bytes(run.coordinator), run.bump)
    assert account_data(localnet, run.instance) == encode_instance(expected)
    accounts = {"signer": authority.pubkey(), "coordinatorInstance": run.instance,
                "coordinatorAccount": run.coordinator}
    send(localnet, [program_instruction(program_id, CloseRun, accounts, CloseRun().encode())], [authority])
    assert account_data(localnet, run.coordinator) is None and account_data(localnet, run.instance) is None


def simulated_error(localnet: Localnet, payer: Keypair, program_id: Pubkey, data: bytes) -> object:
    """The error of a simulated call of ``program_id`` with ``data`` and no accounts."""
    async def simulate(client: AsyncClient) -> object:
        tx = await signed(client, [Instruction(program_id, data, [])], [payer])
        return (await client.simulate_transaction(tx)).value.err

    return query(localnet, simulate)


# --- deploying and upgrading ---------------------------------------------------------------------------


def chunks_of(program: bytes, payer: Identity) -> int:
    return -(-len(program) // deploy.write_chunk_size(payer.key))


def fees(signatures: int) -> int:
    return deploy.LAMPORTS_PER_SIGNATURE * signatures


def test_fresh_deploy_runs_the_coordinator(localnet: Localnet, payer: Identity, tmp_path: Path) -> None:
    program = identity(tmp_path, "program")
    before = balance(localnet, payer.key)
    code, output = cli_deploy(localnet, payer, program)
    assert code == 0, output
    chunks = chunks_of(PROGRAM, payer)
    assert "chunks written: 0/" in output and f"chunks written: {chunks}/{chunks} (100%)" in output
    assert f"program id: {program.key}" in output and f"--program-id {program.key}" in output
    # The buffer's rent came back; the program's two accounts keep theirs. Fees: buffer (payer and buffer
    # sign), the writes, the deployment (payer and program sign).
    kept = rent(localnet, deploy.PROGRAM_ACCOUNT_SIZE) + rent(localnet, deploy.PROGRAMDATA_HEADER + 2 * len(PROGRAM))
    assert before - balance(localnet, payer.key) == kept + fees(2 + chunks + 2)
    run_and_close_a_coordinator(localnet, payer.keypair, program.key)


@pytest.mark.skipif(clang_missing(), reason="clang-14 builds the fixture program the upgrade swaps in")
def test_upgrade_replaces_the_code_at_the_same_address(localnet: Localnet, payer: Identity, tmp_path: Path) -> None:
    program = identity(tmp_path, "program")
    assert cli_deploy(localnet, payer, program)[0] == 0
    other = build_fixture("minimal", tmp_path)  # returns Custom(data[0])
    result = asyncio.run(deploy.deploy(localnet.url, payer.keypair, program.keypair, other))
    assert result.upgraded and result.program_id == program.key
    assert simulated_error(localnet, payer.keypair, program.key, b"\x07") == TransactionErrorInstructionError(
        0, InstructionErrorCustom(7))
    before = balance(localnet, payer.key)
    code, output = cli_deploy(localnet, payer, program)
    assert code == 0 and "upgraded in" in output and f"program id: {program.key}" in output, output
    assert before - balance(localnet, payer.key) == fees(2 + chunks_of(PROGRAM, payer) + 1)  # the buffer's rent is back
    run_and_close_a_coordinator(localnet, payer.keypair, program.key)


@pytest.mark.skipif(clang_missing(), reason="clang-14 builds the small fixture program deployed first")
def test_upgrade_larger_than_the_room_left_is_refused_before_spending(localnet: Localnet, payer: Identity,
                                                                     tmp_path: Path) -> None:
    program = identity(tmp_path, "program")
    small = build_fixture("minimal", tmp_path)
    assert not asyncio.run(deploy.deploy(localnet.url, payer.keypair, program.keypair, small)).upgraded
    before = balance(localnet, payer.key)
    code, output = cli_deploy(localnet, payer, program)
    assert code == 1 and f"has room for {2 * len(small):,} bytes" in output and "solana program extend" in output
    assert balance(localnet, payer.key) == before


# --- errors: each changes nothing, or costs fees only ----------------------------------------------------


def test_missing_keypair_is_a_clear_error(localnet: Localnet, tmp_path: Path) -> None:
    missing = tmp_path / "nobody.json"
    code, output = invoke("deploy", "--url", localnet.url, "--keypair", str(missing))
    assert code == 2 and f"keypair file {missing} does not exist" in output, output


def test_insufficient_funds_say_how_much_is_needed(localnet: Localnet, tmp_path: Path) -> None:
    poor, program = identity(tmp_path, "poor"), identity(tmp_path, "program")

    async def airdrop(client: AsyncClient) -> None:
        await client.confirm_transaction((await client.request_airdrop(poor.key, 10**8)).value)

    query(localnet, airdrop)
    code, output = cli_deploy(localnet, poor, program)
    chunks = chunks_of(PROGRAM, poor)
    need = (rent(localnet, deploy.BUFFER_HEADER + len(PROGRAM)) + rent(localnet, deploy.PROGRAM_ACCOUNT_SIZE)
            + rent(localnet, deploy.PROGRAMDATA_HEADER + 2 * len(PROGRAM)) + fees(2 + chunks + 2))
    assert code == 1 and f"insufficient funds: deploying needs {deploy.sol(need)}" in output, output
    assert f"holds {deploy.sol(10**8)}" in output
    assert balance(localnet, poor.key) == 10**8 and account_data(localnet, program.key) is None


def test_unreachable_rpc_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on once the probe closes
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    code, output = invoke("deploy", "--url", url, "--keypair", identity(tmp_path, "payer").path,
                          "--program-keypair", identity(tmp_path, "program").path)
    assert code == 1 and f"cannot reach the RPC server at {url}" in output, output


def test_url_monikers_are_resolved_before_anything_is_sent(tmp_path: Path) -> None:
    """``localhost`` means the Solana CLI's local address; an unfunded payer makes sure nothing is spent there."""
    code, output = invoke("deploy", "--url", "localhost", "--keypair", identity(tmp_path, "payer").path,
                          "--program-keypair", identity(tmp_path, "program").path)
    assert code == 1 and " on http://127.0.0.1:8899," in output, output


def test_the_localnet_default_address_is_not_upgradeable(localnet: Localnet, payer: Identity) -> None:
    """localnet loads the coordinator at the default program id itself, with the non-upgradeable loader."""
    before = balance(localnet, payer.key)
    code, output = invoke("deploy", "--url", localnet.url, "--keypair", payer.path)
    assert code == 1 and f"{PROGRAM_ID} already holds an account that is not an upgradeable program" in output
    assert balance(localnet, payer.key) == before


def test_only_the_upgrade_authority_may_upgrade(localnet: Localnet, payer: Identity, tmp_path: Path) -> None:
    program, stranger = identity(tmp_path, "program"), identity(tmp_path, "stranger")
    asyncio.run(localnet.fund(stranger.keypair))
    assert cli_deploy(localnet, payer, program)[0] == 0
    before = balance(localnet, stranger.key)
    code, output = cli_deploy(localnet, stranger, program)
    assert code == 1 and f"only the upgrade authority of program {program.key}, {payer.key}" in output, output
    assert balance(localnet, stranger.key) == before


def test_a_program_the_loader_rejects_costs_fees_only(localnet: Localnet, payer: Identity, tmp_path: Path) -> None:
    """The loader's reason is shown, and the buffer is closed so that its rent comes back."""
    program = identity(tmp_path, "program")
    not_elf = b"\x7fELF" + bytes(3000)
    before = balance(localnet, payer.key)
    with pytest.raises(deploy.DeployError, match="(?s)Failed to parse ELF.*was closed and its rent returned"):
        asyncio.run(deploy.deploy(localnet.url, payer.keypair, program.keypair, not_elf))
    # buffer creation (2 signatures), the writes, closing the buffer; the failed deployment was only simulated
    assert before - balance(localnet, payer.key) == fees(2 + chunks_of(not_elf, payer) + 1)
    assert account_data(localnet, program.key) is None
