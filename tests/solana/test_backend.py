"""The Solana backend (anchorpy + solana-py) against ``psyswarm localnet`` in another process, over real HTTP and
websocket: creating a run, joining, ticking, following the state, and every kind of rejection."""

from __future__ import annotations

import asyncio
import base64

import pytest
from anchorpy import Context
from anchorpy.error import ProgramError
from solders.keypair import Keypair

from client.backends.base import BackendError
from client.backends.solana import SolanaBackend
from coordinator_program.spec import errors
from coordinator_program.spec.instructions import JoinRun
from coordinator_program.spec.rules import NO_AUTHORITY
from coordinator_program.spec.state import Phase, Role, encode_state
from tests.solana.conftest import Localnet, new_run_id, run_spec


async def created_run(localnet: Localnet, authority: Keypair | None = None) -> SolanaBackend:
    """A new run on the chain, waiting for members, connected as its (funded) authority."""
    if authority is None:
        authority = Keypair()
        await localnet.fund(authority)
    run_id = new_run_id()
    backend = SolanaBackend(localnet.url, authority, run_id)
    await backend.create_run(run_spec(run_id), NO_AUTHORITY)
    return backend


async def connected(localnet: Localnet, run_id: str, keypair: Keypair | None = None, **options) -> SolanaBackend:
    backend = SolanaBackend(localnet.url, keypair or Keypair(), run_id, **options)
    await backend.connect()
    return backend


def account_bytes(localnet: Localnet, backend: SolanaBackend) -> bytes:
    reply = localnet.rpc("getAccountInfo", [str(backend.coordinator_address), {"encoding": "base64"}])
    return base64.b64decode(reply["result"]["value"]["data"][0])


def test_create_join_and_tick_into_warmup(localnet: Localnet) -> None:
    async def main() -> None:
        creator = await created_run(localnet)
        run_id = creator.run_id
        assert creator.state.phase == Phase.WaitingForMembers
        assert creator.state.main_authority == creator.identity and creator.state.config.min_clients == 4
        # an observer that can only learn of changes through its subscription: it never polls
        observer = await connected(localnet, run_id, poll_interval=3600)
        warmup = asyncio.create_task(observer.wait_for(lambda s: s.phase == Phase.Warmup, timeout=10))
        keypairs = [Keypair() for _ in range(4)]
        await localnet.fund(*keypairs)
        members = [await connected(localnet, run_id, keypair) for keypair in keypairs]
        for member, role in zip(members, [Role.Worker] * 3 + [Role.Trainer], strict=True):
            await member.join(role)
        assert [p.id for p in members[-1].state.pending] == [m.identity for m in members]
        await members[0].tick()
        state = members[0].state
        assert state.phase == Phase.Warmup
        assert sorted(c.stage for c in state.clients if c.role == Role.Worker) == [0, 1, 2]
        seen = await warmup
        assert seen.nonce == state.nonce
        assert account_bytes(localnet, observer) == encode_state(observer.state) == encode_state(state)
        for backend in [creator, observer, *members]:
            await backend.close()

    asyncio.run(main())


def test_rejections_are_the_coordinators_errors(localnet: Localnet) -> None:
    async def main() -> None:
        creator = await created_run(localnet)
        joiner = Keypair()
        await localnet.fund(joiner)
        member = await connected(localnet, creator.run_id, joiner)
        nonce = member.state.nonce
        with pytest.raises(errors.WrongRunId):
            await member.submit(JoinRun("another-run", Role.Worker))
        with pytest.raises(errors.NothingToTick):
            await member.tick()
        with pytest.raises(errors.NotAuthorized):
            await member.set_paused(True)
        with pytest.raises(errors.NotAuthorized):
            await member.update(run_spec(creator.run_id))
        with pytest.raises(errors.InvalidJoin):
            await member.join(Role.Worker, stage=9)
        assert member.state.nonce == nonce  # nothing was applied
        await member.join(Role.Trainer)
        with pytest.raises(errors.AlreadyJoined):
            await member.join(Role.Trainer)
        with pytest.raises(errors.NotHalted):  # the authority itself, but the run is not paused
            await creator.update(run_spec(creator.run_id))
        await creator.set_paused(True)
        assert creator.state.pause_requested
        for backend in (creator, member):
            await backend.close()

    asyncio.run(main())


def test_failures_outside_the_rules_are_backend_errors(localnet: Localnet) -> None:
    async def main() -> None:
        creator = await created_run(localnet)
        with pytest.raises(BackendError, match="already exists"):
            again = SolanaBackend(localnet.url, creator.keypair, creator.run_id)
            await again.create_run(run_spec(creator.run_id), NO_AUTHORITY)
        with pytest.raises(BackendError, match="does not exist"):
            await connected(localnet, new_run_id())
        broke = await connected(localnet, creator.run_id)  # a keypair with no SOL
        with pytest.raises(BackendError, match="no SOL"):
            await broke.join(Role.Trainer)
        with pytest.raises(BackendError, match="cannot read"):
            await SolanaBackend("http://127.0.0.1:1", Keypair(), creator.run_id).connect()
        for backend in (creator, broke):
            await backend.close()

    asyncio.run(main())


def test_polling_when_no_subscription_is_possible(localnet: Localnet) -> None:
    async def main() -> None:
        creator = await created_run(localnet)
        poller = await connected(localnet, creator.run_id, ws_url="ws://127.0.0.1:1", poll_interval=0.1)
        await creator.set_paused(True)
        paused = await poller.wait_for(lambda s: s.pause_requested, timeout=5)
        assert paused.nonce == creator.state.nonce
        for backend in (creator, poller):
            await backend.close()

    asyncio.run(main())


def test_states_whose_nonce_is_not_newer_are_ignored(localnet: Localnet) -> None:
    async def main() -> None:
        creator = await created_run(localnet)
        before = account_bytes(localnet, creator)
        await creator.set_paused(True)
        after = creator.state.nonce
        await creator._adopt(before)  # a late notification, as a subscription may deliver one
        assert creator.state.nonce == after and creator.state.pause_requested
        await creator.close()

    asyncio.run(main())


def test_the_contributor_joins_through_the_solana_backend(localnet: Localnet) -> None:
    from client.contributor.context import RunnerOptions
    from client.contributor.runner import Contributor

    async def main() -> None:
        creator = await created_run(localnet)
        keypair = Keypair()
        await localnet.fund(keypair)
        backend = await connected(localnet, creator.run_id, keypair)
        contributor = Contributor(backend, keypair, RunnerOptions(role=Role.Trainer, initial_peers=[]))
        await contributor.on_state(backend.state)  # not yet queued: it joins
        queued = await creator.wait_for(lambda s: s.pending_index(backend.identity) is not None, timeout=10)
        assert queued.pending[queued.pending_index(backend.identity)].role == Role.Trainer
        await contributor.shutdown()
        for b in (creator, backend):
            await b.close()

    asyncio.run(main())


def test_anchorpys_own_rpc_and_account_paths_work_on_localnet(localnet: Localnet) -> None:
    async def main() -> None:
        creator = await created_run(localnet)
        program, me = creator.program, creator.keypair.pubkey()
        instance = await program.account["CoordinatorInstance"].fetch(creator.instance_address)
        assert instance.coordinator_account == creator.coordinator_address
        with pytest.raises(ProgramError) as rejected:  # anchorpy reads the code with the IDL's error table
            await program.rpc["tick"](ctx=Context(accounts={"signer": me,
                                                            "coordinator_account": creator.coordinator_address}))
        assert rejected.value.code == errors.NothingToTick.code
        await program.rpc["set_paused"](True, ctx=Context(accounts={
            "signer": me, "coordinator_instance": creator.instance_address,
            "coordinator_account": creator.coordinator_address}))
        paused = await creator.wait_for(lambda s: s.pause_requested, timeout=5)  # seen through the subscription
        assert paused.phase == Phase.WaitingForMembers
        await creator.close()

    asyncio.run(main())
