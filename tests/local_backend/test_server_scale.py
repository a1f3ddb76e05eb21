"""Issue 22 on the TCP server: a round of more clients than one tick credits ends in one of the server's ticks, which
runs the crediting ticks back to back (each stored) rather than a tick interval apart."""

from __future__ import annotations

import asyncio
from pathlib import Path

from solders.keypair import Keypair

from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.config import RunSpec
from coordinator_program.spec.instructions import Tick
from coordinator_program.spec.state import Phase, decode_state, encode_state
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore
from tests.spec.scenario import MODEL, RUN_ID
from tests.spec.test_proof_parts import LARGE, parts_of, send, training


def test_the_server_ends_a_round_of_three_crediting_chunks_in_one_tick(tmp_path: Path) -> None:
    state, now = training(300)
    everyone = [c.id for c in state.clients]
    parts = parts_of(state, everyone, everyone)
    for w in derived.witnesses(state):
        send(state, w, parts)
    rules.tick(state, now, 1)
    assert state.phase == Phase.RoundWitness
    store = RunStore(tmp_path / "run.sqlite")
    store.save(RUN_ID, state.nonce, encode_state(state), bytes(32), Tick().encode())
    spec = RunSpec(RUN_ID, LARGE, MODEL, state.checkpoint)
    clock = state.phase_start + LARGE.round_witness_time

    async def main() -> None:
        server = CoordinatorServer(spec, store, Keypair(), lambda: clock, join_authority=rules.NO_AUTHORITY)
        await server.tick_once()
        assert server.state.phase == Phase.RoundTrain and server.state.round.height == 1
        assert len(server.state.ledger) == 300 > 2 * limits.CREDIT_CLIENTS
        stored = decode_state(store.load(RUN_ID) or b"")
        assert stored.nonce == server.state.nonce == state.nonce + 3, "three ticks, each stored"

    asyncio.run(main())
