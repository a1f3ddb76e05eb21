"""Admission on Solana, attacked on ``psyswarm localnet`` (the real program in LiteSVM, over real RPC) and on the
real auth service: a run created with the service's key as join authority admits a join only co-signed by it;
the service co-signs only a transaction that is one join_run of the slot holder's own key into its run, role
and stage; and nobody can block a run id by sending lamports to its addresses before the run is created."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable

import pytest
from solana.rpc.async_api import AsyncClient
from solana.rpc.commitment import Confirmed
from solders.hash import Hash
from solders.instruction import AccountMeta
from solders.instruction import Instruction as SolanaInstruction
from solders.keypair import Keypair
from solders.message import Message
from solders.pubkey import Pubkey
from solders.system_program import TransferParams, transfer
from solders.transaction import VersionedTransaction
from typer.testing import CliRunner

from client.backends.solana import SolanaBackend
from client.cli import app
from client.commands.auth import coordinator_release
from client.join.auth import AuthError, AuthSession
from coordinator_program.onchain.instance import INSTANCE_SIZE, instance_address
from coordinator_program.onchain.program_id import PROGRAM_ID
from coordinator_program.spec import errors
from coordinator_program.spec.instructions import JoinRun
from coordinator_program.spec.rules import NO_AUTHORITY
from coordinator_program.spec.state import ACCOUNT_SIZE, Phase, Role
from tests.join.test_auth import serving
from tests.solana import conftest as solana

localnet = solana.localnet  # the session's chain, a fixture used by its name


async def send_lamports(chain: solana.Localnet, payer: Keypair, to: Pubkey, lamports: int) -> None:
    async with AsyncClient(chain.url) as client:
        blockhash = (await client.get_latest_blockhash()).value.blockhash
        message = Message.new_with_blockhash([transfer(TransferParams(from_pubkey=payer.pubkey(), to_pubkey=to,
                                                                      lamports=lamports))], payer.pubkey(), blockhash)
        sent = await client.send_transaction(VersionedTransaction(message, [payer]))
        await client.confirm_transaction(sent.value, Confirmed, 0.1)


def test_a_join_on_a_permissioned_run_needs_the_auth_services_countersignature(localnet: solana.Localnet,
                                                                              fake_hub) -> None:
    run_id = solana.new_run_id()
    with serving(fake_hub, run_id=run_id) as service:
        authority = service.service.keypair.pubkey()
        creator, alice, mallory = localnet.funded_keypairs(3)
        session = AuthSession.open(service.url, alice, run_id, "tok-alice", "worker")

        async def main() -> None:
            await SolanaBackend(localnet.url, creator, run_id).create_run(solana.run_spec(run_id), bytes(authority))
            for cosigner in (None, Keypair()):  # no co-signer, or one of Mallory's own
                attempt = SolanaBackend(localnet.url, mallory, run_id, authorizer=cosigner)
                await attempt.connect()
                with pytest.raises(errors.NotAuthorized):
                    await attempt.join(Role.Worker, 0, 0)
                await attempt.close()
            relayed = SolanaBackend(localnet.url, mallory, run_id, authorizer=session)  # Alice's slot, Mallory's key
            await relayed.connect()
            with pytest.raises(AuthError, match="a slot admits only the key it was granted to"):
                await relayed.join(Role.Worker, session.grant.stage, session.grant.slot)
            assert relayed.state.pending == []
            honest = SolanaBackend(localnet.url, alice, run_id, authorizer=session)
            await honest.connect()
            await honest.join(Role.Worker, session.grant.stage, session.grant.slot)
            assert [p.id for p in honest.state.pending] == [bytes(alice.pubkey())]
            # Her slot ends: the service's release path (a transaction the join authority signs and pays for)
            # withdraws her key from the program, and confirms a key already gone as well.
            await localnet.fund(service.service.keypair)
            release = coordinator_release(None, localnet.url, run_id, None, service.service.keypair)
            for _ in range(2):
                assert await asyncio.to_thread(release, [bytes(alice.pubkey())]) == {bytes(alice.pubkey())}
                await honest.wait_for(lambda state: not state.pending, timeout=30)
            await asyncio.gather(relayed.close(), honest.close())

        asyncio.run(main())
    status = CliRunner().invoke(app, ["status", "--url", localnet.url, "--run-id", run_id])
    assert f"admission: permissioned by {authority}" in re.sub(r"\s+", " ", status.output), status.output


def with_meta(ix: SolanaInstruction, index: int, **changes: object) -> SolanaInstruction:
    metas = list(ix.accounts)
    old = metas[index]
    metas[index] = AccountMeta(**{"pubkey": old.pubkey, "is_signer": old.is_signer, "is_writable": old.is_writable,
                                  **changes})
    return SolanaInstruction(ix.program_id, ix.data, metas)


def soon() -> int:
    """A deadline the service countersigns."""
    return int(time.time()) + 30


class Joins:
    """Join transactions of Alice (worker, stage 0) and variations an attacker would like co-signed."""

    def __init__(self, alice: Keypair, session: AuthSession, run_id: str) -> None:
        self.alice, self.session, self.run_id = alice, session, run_id
        self.authority = session.pubkey()

    def join(self, joiner: Keypair | None = None, ix: JoinRun | None = None) -> SolanaInstruction:
        backend = SolanaBackend("http://127.0.0.1:1", joiner or self.alice, self.run_id, authorizer=self.session)
        backend.coordinator_address = Pubkey.create_with_seed(Pubkey.new_unique(), self.run_id, PROGRAM_ID)
        return backend.instruction(ix or JoinRun(self.run_id, Role.Worker, 0, 0, soon()))

    def message(self, instructions: list[SolanaInstruction], payer: Keypair | None = None) -> bytes:
        return bytes(Message.new_with_blockhash(instructions, (payer or self.alice).pubkey(), Hash.default()))


ATTACKS: dict[str, tuple[Callable[[Joins, Keypair], bytes], str]] = {
    "another-key": (lambda j, mallory: j.message([j.join(mallory)], mallory), "a slot admits only the key"),
    "paid-by-another-key": (lambda j, mallory: j.message([j.join()], mallory), "the joiner must pay for its join"),
    "with-a-transfer-from-the-authority": (
        lambda j, mallory: j.message([j.join(), transfer(TransferParams(
            from_pubkey=j.authority, to_pubkey=mallory.pubkey(), lamports=10**9))]), "nothing else"),
    "authority-writable": (lambda j, mallory: j.message([with_meta(j.join(), 1, is_writable=True)]), "read-only"),
    "another-runs-instance": (lambda j, mallory: j.message([with_meta(
        j.join(), 2, pubkey=instance_address(PROGRAM_ID, "other-run")[0])]), "the instance run"),
    "another-program": (lambda j, mallory: j.message([SolanaInstruction(
        Pubkey.new_unique(), j.join().data, j.join().accounts)]), "not for the coordinator program"),
    "another-run": (lambda j, mallory: j.message([j.join(ix=JoinRun("other-run", Role.Worker, 0, 0, soon()))]),
                    "this service admits to run"),
    "another-stage": (lambda j, mallory: j.message([j.join(ix=JoinRun(j.run_id, Role.Worker, 1, 0, soon()))]),
                      "the slot was granted stage 0"),
    "another-slot": (lambda j, mallory: j.message([j.join(ix=JoinRun(j.run_id, Role.Worker, 0, 3, soon()))]),
                     "this peer holds slot 0"),
    "no-deadline": (lambda j, mallory: j.message([j.join(ix=JoinRun(j.run_id, Role.Worker, 0, 0))]),
                    "deadline must lie within"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_service_cosigns_only_a_lone_join_run_of_the_slots_own_key(fake_hub, attack: str) -> None:
    run_id = solana.new_run_id()
    with serving(fake_hub, run_id=run_id) as service:
        alice = Keypair()
        joins = Joins(alice, AuthSession.open(service.url, alice, run_id, "tok-alice", "worker"), run_id)
        honest = joins.message([joins.join()])
        assert joins.session.sign_message(honest).verify(joins.authority, honest)
        build, refusal = ATTACKS[attack]
        with pytest.raises(AuthError, match=refusal) as refused:
            joins.session.sign_message(build(joins, Keypair()))
        assert refused.value.code == "not_countersigned"


def test_create_run_succeeds_on_addresses_someone_funded_first(localnet: solana.Localnet) -> None:
    run_id = solana.new_run_id()
    attacker, creator = localnet.funded_keypairs(2)
    instance, _ = instance_address(PROGRAM_ID, run_id)
    coordinator = Pubkey.create_with_seed(creator.pubkey(), run_id, PROGRAM_ID)

    async def main() -> None:
        for address in (instance, coordinator):
            await send_lamports(localnet, attacker, address, 1)
        backend = SolanaBackend(localnet.url, creator, run_id)
        await backend.create_run(solana.run_spec(run_id), NO_AUTHORITY)
        assert backend.coordinator_address == coordinator and backend.state.phase == Phase.WaitingForMembers
        await backend.close()

    asyncio.run(main())
    for address, size in ((instance, INSTANCE_SIZE), (coordinator, ACCOUNT_SIZE)):
        reply = localnet.rpc("getAccountInfo", [str(address), {"encoding": "base64"}])["result"]["value"]
        rent = localnet.rpc("getMinimumBalanceForRentExemption", [size])["result"]
        assert reply["owner"] == str(PROGRAM_ID) and reply["lamports"] == rent, reply
