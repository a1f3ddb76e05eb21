"""Dead clients coming back (issue 11, item 8): on the specification and the C program at once, and on the real
TCP server.

Before the fix a round that received no witness proof went to Cooldown with its clients still Healthy, and
Cooldown queued every Healthy client again. With every client killed, the server kept cycling through epochs
(the step rising with nobody alive), and admitted the dead beside the next real joiners. Separately, the server
withdraws a joiner whose connection closes, but a client whose connection closes mid-round stays in the epoch,
and the epoch's end queued it again, connected or not: the server admitted it.

The server tests run a real ``CoordinatorServer`` on loopback with real ``TcpBackend`` clients; a killed
client is one whose connection is closed, which is all the server sees of a SIGKILL. The server's clock is a
variable the test moves, so a run's phases pass in the half-second ticks of its own loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from coordinator_program.spec import derived, errors, rules
from coordinator_program.spec.bloom import build_filter, participant_key
from coordinator_program.spec.config import load_run_spec, parse_run_spec
from coordinator_program.spec.instructions import JoinRun, Tick
from coordinator_program.spec.state import CoordinatorState, Phase, Role
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore
from tests.program.coordinator_chain import training_swarm

EXAMPLE = load_run_spec(Path(__file__).resolve().parents[2] / "examples" / "state.toml")
CONFIG = EXAMPLE.config


def test_a_round_without_proof_withdraws_its_clients_for_good() -> None:
    swarm, authority = training_swarm(CONFIG, EXAMPLE.model)
    apply = swarm.replay.apply
    dead = swarm.clients()
    assert apply(Tick(), authority, advance=CONFIG.max_round_train_time) is None  # nobody proved anything
    assert apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    assert swarm.state.phase == Phase.Cooldown and swarm.state.clients == [], "the round's clients stayed"
    step = swarm.state.step
    assert apply(Tick(), authority, advance=CONFIG.cooldown_time) is None
    assert swarm.state.phase == Phase.WaitingForMembers and swarm.state.pending == [], "the dead were queued"
    for _ in range(3):  # no epoch starts with nobody alive, and the step stays
        assert apply(Tick(), authority, advance=CONFIG.cooldown_time) == errors.NothingToTick.code
    assert swarm.state.step == step

    for i, member in enumerate(swarm.new_members(4)):
        assert apply(JoinRun(swarm.state.run_id, Role.Trainer if i == 3 else Role.Worker), member) is None
    assert apply(Tick(), authority) is None and swarm.state.phase == Phase.Warmup
    assert not set(swarm.clients()) & set(dead), "dead clients were admitted beside the new ones"


# --- the TCP server -------------------------------------------------------------------------------------

SPEC = parse_run_spec({
    "run_id": "dead-clients",
    "config": {"min_clients": 4, "max_clients": 8, "witness_nodes": 3, "witness_quorum": 2, "warmup_time": 5,
               "max_round_train_time": 30, "round_witness_time": 2, "cooldown_time": 5, "rounds_per_epoch": 1},
    "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
})


class Clock:
    """The server's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def run_server(tmp_path: Path, body: Callable[[CoordinatorServer, str, Clock], Awaitable[None]]) -> None:
    async def main() -> None:
        clock = Clock()
        server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), Keypair(), clock=clock,
                                   join_authority=rules.NO_AUTHORITY)
        port = await server.start(port=0)
        try:
            await body(server, f"127.0.0.1:{port}", clock)
        finally:
            await server.stop()

    asyncio.run(main())


async def until(server: CoordinatorServer, done: Callable[[CoordinatorState], bool], timeout: float = 5.0) -> None:
    """Wait for the server's own ticks to bring its state to ``done``."""
    for _ in range(int(timeout / 0.05)):
        if done(server.state):
            return
        await asyncio.sleep(0.05)
    s = server.state
    raise AssertionError(f"the server stayed in {s.phase.name} with {len(s.clients)} clients, {len(s.pending)} queued")


async def join(address: str, workers: int, trainers: int) -> list[TcpBackend]:
    """Trainers first: the server admits as soon as the pipeline is complete, which is then at the last join."""
    clients = [TcpBackend(address, Keypair()) for _ in range(workers + trainers)]
    for i, client in enumerate(clients):
        await client.connect()
        await client.join(Role.Trainer if i < trainers else Role.Worker)
    return clients


async def train(server: CoordinatorServer, clock: Clock, address: str, workers: int,
                trainers: int) -> list[TcpBackend]:
    """Clients that join and are admitted, in round 0 of the epoch."""
    clients = await join(address, workers, trainers)
    await until(server, lambda s: s.phase == Phase.Warmup)
    clock.now += SPEC.config.warmup_time
    await until(server, lambda s: s.phase == Phase.RoundTrain)
    return clients


def test_server_keeps_no_client_of_a_round_nobody_proved(tmp_path: Path) -> None:
    async def body(server: CoordinatorServer, address: str, clock: Clock) -> None:
        dead = await train(server, clock, address, workers=3, trainers=1)
        for client in dead:  # every client is killed mid-round
            await client.close()
        clock.now += SPEC.config.max_round_train_time
        await until(server, lambda s: s.phase == Phase.RoundWitness)
        clock.now += SPEC.config.round_witness_time
        await until(server, lambda s: s.phase == Phase.Cooldown)
        assert server.state.clients == []
        clock.now += SPEC.config.cooldown_time
        await until(server, lambda s: s.phase == Phase.WaitingForMembers)
        step = server.state.step
        clock.now += 3 * SPEC.config.cooldown_time
        await asyncio.sleep(1.5)  # three of the server's ticks: no epoch starts with nobody alive
        assert (server.state.phase, server.state.step, server.state.pending) == (Phase.WaitingForMembers, step, [])

        fresh = await join(address, workers=3, trainers=1)
        await until(server, lambda s: s.phase == Phase.Warmup)
        assert sorted(c.id for c in server.state.clients) == sorted(c.identity for c in fresh)
        for client in fresh:
            await client.close()

    run_server(tmp_path, body)


def test_server_does_not_admit_a_queued_client_whose_connection_is_gone(tmp_path: Path) -> None:
    """The witnesses prove a round with everyone in it, so the epoch's end queues every client again; one of
    them was killed after the proofs. The next epoch must admit the live clients only."""
    async def body(server: CoordinatorServer, address: str, clock: Clock) -> None:
        clients = await train(server, clock, address, workers=3, trainers=2)
        state = server.state
        everyone = build_filter(state.config, [participant_key(c.id) for c in state.clients])
        victim = clients[0]  # a trainer: the pipeline stays complete without it
        elected = [c for c in clients if c.identity in derived.witnesses(state) and c is not victim]
        for witness in elected[:SPEC.config.witness_quorum]:  # three are elected: two stay alive
            await witness.witness(state.round.height, everyone, everyone)
        await until(server, lambda s: s.phase == Phase.RoundWitness)
        await victim.close()
        clock.now += SPEC.config.round_witness_time
        await until(server, lambda s: s.phase == Phase.Cooldown and s.client_index(victim.identity) is not None)
        clock.now += SPEC.config.cooldown_time
        await until(server, lambda s: s.phase == Phase.Warmup)
        admitted = {c.id for c in server.state.clients}
        assert victim.identity not in admitted, "a client with no connection was admitted"
        assert server.state.pending_index(victim.identity) is None
        assert admitted == {c.identity for c in clients if c is not victim}
        for client in clients:
            await client.close()

    run_server(tmp_path, body)
