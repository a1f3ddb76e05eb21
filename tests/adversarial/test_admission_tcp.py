"""Admission on the TCP backend, attacked through the real coordinator server and the real auth service, both
on loopback: a run created with the auth service's key as its join authority admits a join only with that
service's countersignature, and the service countersigns only the join of a slot it granted, for that slot's
key, run, role and stage. The Hugging Face Hub is the stand-in (tests.fake_hub)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from client.backends.base import BackendError
from client.backends.tcp import TcpBackend
from client.join.auth import AuthError, AuthSession
from coordinator_program.spec import errors, limits
from coordinator_program.spec.config import parse_run_spec
from coordinator_program.spec.instructions import Instruction, JoinRun, Tick
from coordinator_program.spec.state import Role
from local_backend import protocol as p
from local_backend.auth.app import AuthHTTPServer
from local_backend.server import CoordinatorServer
from tests.join.test_auth import RUN, serving
from tests.local_backend.test_server import run_with_server

SPEC = parse_run_spec({
    "run_id": RUN,
    "config": {"min_clients": 4, "max_clients": 8, "num_stages": 3, "witness_nodes": 2, "witness_quorum": 2,
               "warmup_time": 60, "max_round_train_time": 30, "round_witness_time": 1, "cooldown_time": 1,
               "rounds_per_epoch": 3},
    "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
})
RunBody = Callable[[CoordinatorServer, str], Awaitable[None]]


def authority_of(service: AuthHTTPServer) -> bytes:
    return bytes(service.service.keypair.pubkey())


def session(service: AuthHTTPServer, token: str) -> AuthSession:
    """A worker's slot (each new slot of the service's three stages goes to the least occupied: head first)."""
    return AuthSession.open(service.url, Keypair(), RUN, token, "worker")


def with_run(tmp_path: Path, join_authority: bytes, body: RunBody) -> None:
    """The real server for run ``RUN`` with this join authority, on a free loopback port, around ``body``."""
    run_with_server(tmp_path, body, spec=SPEC, join_authority=join_authority)


async def connected(address: str, keypair: Keypair, authorizer: object = None) -> TcpBackend:
    backend = TcpBackend(address, keypair, authorizer=authorizer)  # type: ignore[arg-type]
    await backend.connect()
    return backend


def pending(server: CoordinatorServer) -> list[bytes]:
    return [joiner.id for joiner in server.state.pending]


class Forger:
    """Claims the join authority's key but signs with a key of its own."""

    def __init__(self, authority: bytes) -> None:
        self.authority = Pubkey.from_bytes(authority)

    def pubkey(self) -> Pubkey:
        return self.authority

    def sign_message(self, message: bytes) -> Signature:
        return Keypair().sign_message(message)


class Relay:
    """Mallory holds no slot; her co-signer has Alice, who holds one, ask the service to countersign Mallory's
    join: as it is (naming Mallory's key), or with Alice's key put in place of Mallory's."""

    def __init__(self, accomplice: AuthSession, *, rename: bool) -> None:
        self.accomplice, self.rename = accomplice, rename

    def pubkey(self) -> Pubkey:
        return self.accomplice.pubkey()

    def sign_message(self, message: bytes) -> Signature:
        if self.rename:
            at = len(p.JOIN_AUTHORIZATION_DOMAIN)
            message = message[:at] + bytes(self.accomplice.client.keypair.pubkey()) + message[at + 32:]
        return self.accomplice.sign_message(message)


def test_a_join_needs_the_auth_services_countersignature(fake_hub, tmp_path: Path) -> None:
    with serving(fake_hub) as service, serving(fake_hub) as other_service:
        alice, stranger = session(service, "tok-alice"), session(other_service, "tok-bob")

        async def body(server: CoordinatorServer, address: str) -> None:
            attempts = [(Keypair(), None),  # no countersignature at all
                        (Keypair(), Keypair()),  # co-signed by a key of its own
                        (stranger.client.keypair, stranger)]  # countersigned by another run's auth service
            for keypair, cosigner in attempts:
                backend = await connected(address, keypair, cosigner)
                with pytest.raises(errors.NotAuthorized):
                    await backend.join(Role.Worker, 0, 0)
                await backend.close()
            forged = await connected(address, Keypair(), Forger(authority_of(service)))
            with pytest.raises(BackendError, match="co-signature does not match"):
                await forged.join(Role.Worker, 0, 0)
            assert pending(server) == []
            honest = await connected(address, alice.client.keypair, alice)
            await honest.join(Role.Worker, alice.grant.stage, alice.grant.slot)
            assert pending(server) == [honest.identity]
            await asyncio.gather(forged.close(), honest.close())

        with_run(tmp_path, authority_of(service), body)


def test_a_slot_holder_cannot_get_another_key_admitted(fake_hub, tmp_path: Path) -> None:
    with serving(fake_hub) as service:
        alice = session(service, "tok-alice")

        async def body(server: CoordinatorServer, address: str) -> None:
            mallory = Keypair()
            asked = await connected(address, mallory, Relay(alice, rename=False))
            with pytest.raises(AuthError, match="a slot admits only the key it was granted to"):
                await asked.join(Role.Worker, alice.grant.stage, alice.grant.slot)
            renamed = await connected(address, mallory, Relay(alice, rename=True))  # the service signs this one
            with pytest.raises(BackendError, match="given for another key than this connection's"):
                await renamed.join(Role.Worker, alice.grant.stage, alice.grant.slot)
            assert pending(server) == []
            honest = await connected(address, alice.client.keypair, alice)  # Alice's own join is unharmed
            await honest.join(Role.Worker, alice.grant.stage, alice.grant.slot)
            assert pending(server) == [honest.identity]
            await asyncio.gather(asked.close(), renamed.close(), honest.close())

        with_run(tmp_path, authority_of(service), body)


JoinOf = Callable[[int], Instruction]
"""An instruction to have countersigned, given a deadline the service would countersign."""


@pytest.mark.parametrize("ix, refusal", [
    (lambda soon: JoinRun("run-2", Role.Worker, 0, 0, soon), "this service admits to run 'run-1'"),
    (lambda soon: JoinRun(RUN, Role.Trainer, limits.NO_STAGE, 0, soon), "the slot was granted for a worker"),
    (lambda soon: JoinRun(RUN, Role.Worker, 2, 0, soon), "the slot was granted stage 0"),
    (lambda soon: JoinRun(RUN, Role.Worker, limits.NO_STAGE, 0, soon), "the slot was granted stage 0"),
    (lambda soon: JoinRun(RUN, Role.Worker, 0, 1, soon), "this peer holds slot 0"),  # a slot another key holds
    (lambda soon: JoinRun(RUN, Role.Worker, 0, 0), "deadline must lie within the next 120 s"),  # never expires
    (lambda soon: JoinRun(RUN, Role.Worker, 0, 0, soon + 3600), "deadline must lie within the next 120 s"),
    (lambda soon: Tick(), "countersigns join_run only"),
], ids=["another-run", "another-role", "another-stage", "any-stage", "another-slot", "no-deadline",
        "far-deadline", "not-a-join"])
def test_a_countersignature_for_another_run_role_stage_or_slot_is_refused(fake_hub, ix: JoinOf,
                                                                         refusal: str) -> None:
    with serving(fake_hub) as service:
        alice = session(service, "tok-alice")
        assert alice.grant.stage == 0
        me = bytes(alice.client.keypair.pubkey())

        def authorization(instruction: Instruction) -> bytes:
            return p.join_authorization(me, p.request_message(bytes(32), 1, instruction.encode()))

        soon = int(time.time()) + 30
        good = authorization(JoinRun(RUN, Role.Worker, 0, 0, soon))
        assert alice.sign_message(good).verify(alice.pubkey(), good)  # the grant's own join is countersigned
        with pytest.raises(AuthError, match=refusal) as refused:
            alice.sign_message(authorization(ix(soon)))
        assert refused.value.code == "not_countersigned"
        with pytest.raises(AuthError, match="neither a TCP join authorization nor a Solana"):
            alice.sign_message(b"sign this for me")


def test_no_countersignature_without_a_live_slot(fake_hub) -> None:
    with serving(fake_hub) as service:
        alice = session(service, "tok-alice")
        ix = JoinRun(RUN, Role.Worker, 0, 0, int(time.time()) + 30)
        join = p.join_authorization(bytes(alice.client.keypair.pubkey()), p.request_message(bytes(32), 1, ix.encode()))
        alice.client.leave()
        with pytest.raises(AuthError, match="holds no slot") as refused:
            alice.sign_message(join)
        assert refused.value.code == "no_slot"
