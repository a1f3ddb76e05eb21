"""The contributor's seeding (``client.contributor.seeding``) against the real TCP server: an elected witness commits
to a secret as the round opens and reveals it once a quorum has, so the next seed holds every committed secret
and no honest witness is removed; a witness that lost its secret (restarted between the two) cannot reveal and
leaves at the round's end."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from client.contributor.context import ClientContext, RunnerOptions
from client.contributor.seeding import Seeding
from client.contributor.tasks import TaskSet
from coordinator_program.spec import derived
from coordinator_program.spec.bloom import build_filter, participant_key
from coordinator_program.spec.state import Phase, Role
from local_backend.server import CoordinatorServer
from tests.local_backend.test_server import SPEC, run_with_server

WARMUP_3S = dataclasses.replace(SPEC, config=dataclasses.replace(SPEC.config, warmup_time=3))
"""The server's test run with a warmup of 3 seconds: the reveals close at its end (the server's clock counts whole
seconds)."""


def seeding_of(backend: TcpBackend, keypair: Keypair) -> Seeding:
    tasks = TaskSet(lambda: "test", lambda why: None)
    return Seeding(ClientContext(backend, keypair, RunnerOptions(role=Role.Worker, initial_peers=[]), tasks))


def test_witnesses_commit_in_training_and_reveal_after_it(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str) -> None:
        keypairs = [Keypair() for _ in range(8)]
        clients = [TcpBackend(address, kp) for kp in keypairs]
        for i, c in enumerate(clients):  # six workers: two a stage
            await c.connect()
            await c.join(Role.Worker if i < 6 else Role.Trainer)
        seedings = {bytes(kp.pubkey()): seeding_of(c, kp) for c, kp in zip(clients, keypairs, strict=True)}
        state = await clients[0].wait_for(lambda s: s.phase == Phase.RoundTrain, 10)
        elected = derived.witnesses(state)
        for seeding in seedings.values():
            await seeding.act(state)  # only the elected commit, until a quorum has: the commitments close
        state = await clients[0].wait_for(lambda s: s.round.committed.bit_count() >= derived.quorum(s), 5)
        committed = [w for position, w in enumerate(elected) if state.round.committed >> position & 1]
        workers = {c.id for c in state.clients if c.role == Role.Worker}  # two a stage: any one may leave
        forgetful = [w for w in committed if w in workers][-1]
        by_id = {c.identity: c for c in clients}
        seedings[forgetful] = seeding_of(by_id[forgetful], keypairs[clients.index(by_id[forgetful])])  # restarted
        for seeding in seedings.values():  # the reveals need not wait for RoundWitness
            await seeding.act(state)
        assert server.state.phase == Phase.RoundTrain  # each reply came once the server applied it
        kept = state.round.committed & ~(1 << elected.index(forgetful))
        assert kept and server.state.round.revealed == kept, "every witness that kept its secret revealed"
        bloom = build_filter(state.config, [participant_key(c.identity) for c in clients])
        for witness in elected[:2]:  # a quorum ends training
            await by_id[witness].witness(state.round.height, bloom, bloom)
        after = await clients[0].wait_for(lambda s: s.phase == Phase.RoundTrain and s.round.height == 1, 10)
        assert set(elected) - {forgetful} <= {c.id for c in after.clients}, "no other witness is removed"
        assert forgetful not in {c.id for c in after.clients}, "a witness that could not reveal left"
        for c in clients:
            await c.close()

    run_with_server(tmp_path, body)


def test_joiners_commit_in_their_join_and_reveal_once_as_their_warmup_opens(tmp_path: Path, caplog) -> None:
    """Every seeding commits in its join; the warmup elects no one until they reveal. A state from before a reveal
    was taken, seen again, sends nothing and warns of nothing; a joiner that restarted (its secret lost) cannot
    reveal and leaves when the warmup ends; a later join commits to a fresh secret."""
    async def body(server: CoordinatorServer, address: str) -> None:
        keypairs = [Keypair() for _ in range(8)]
        clients = [TcpBackend(address, kp) for kp in keypairs]
        seedings = [seeding_of(c, kp) for c, kp in zip(clients, keypairs, strict=True)]
        for i, (c, seeding) in enumerate(zip(clients, seedings, strict=True)):  # six workers: two a stage
            await c.connect()
            await c.join(Role.Worker if i < 6 else Role.Trainer, commitment=seeding.join_commitment())
        state = await clients[0].wait_for(lambda s: s.phase == Phase.Warmup, 10)
        assert derived.revealing(state) and derived.witnesses(state) == []
        forgetful = bytes(keypairs[0].pubkey())
        seedings[0] = seeding_of(clients[0], keypairs[0])  # restarted: its join's secret is gone
        admitted = {c.id for c in state.clients}  # the server admits as soon as a pipeline is queued: the last may wait
        for seeding in seedings[1:]:
            await seeding.act(state)
            await seeding.act(state)  # the same stale state: nothing more is sent
        assert not any("cannot open" in r.message for r in caplog.records)
        await seedings[0].act(state)
        assert sum("cannot open" in r.message for r in caplog.records) == 1
        unopened = [c.id for c in server.state.clients if c.commitment != bytes(32)]
        assert forgetful in admitted and unopened == [forgetful], "every joiner revealed but the restarted one"
        assert derived.revealing(server.state)
        after = await clients[1].wait_for(lambda s: not derived.revealing(s), state.config.warmup_time + 5)
        assert forgetful not in {c.id for c in after.clients}, "a joiner that could not reveal left"
        assert len(derived.witnesses(after)) == min(after.config.witness_nodes, len(after.clients))
        revealed = seedings[1].join_revealed
        assert revealed is not None and seedings[1].join_commitment() != revealed, "a rejoin commits afresh"
        for c in clients:
            await c.close()

    run_with_server(tmp_path, body, spec=WARMUP_3S)
