"""Issue 22 on the TCP server: a round of more clients than one tick credits ends in one of the server's ticks, which
runs the crediting ticks back to back (each stored) rather than a tick interval apart; and a witness's proof of
several parts, resent after a reply was lost, completes rather than stops at the part the server already holds."""

from __future__ import annotations

import asyncio
from pathlib import Path

from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.bloom import part_count
from coordinator_program.spec.config import RunSpec
from coordinator_program.spec.instructions import Tick
from coordinator_program.spec.state import Phase, Role, decode_state, encode_state
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore
from tests.spec.scenario import MODEL, RUN_ID, new_run, start_training
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
    spec = RunSpec(RUN_ID, LARGE, MODEL, state.checkpoints[0])
    clock = state.phase_start + LARGE.round_witness_time

    async def main() -> None:
        server = CoordinatorServer(spec, store, Keypair(), lambda: clock, join_authority=rules.NO_AUTHORITY)
        await server.tick_once()
        assert server.state.phase == Phase.RoundTrain and server.state.round.height == 1
        assert len(server.state.ledger) == 300 > 2 * limits.CREDIT_CLIENTS
        stored = decode_state(store.load(RUN_ID) or b"")
        assert stored.nonce == server.state.nonce == state.nonce + 3, "three ticks, each stored"

    asyncio.run(main())


def test_a_proof_resent_after_a_lost_reply_completes_on_the_real_server(tmp_path: Path) -> None:
    """The witness's first try got part 0 in and lost the reply; its resend (``Backend.prove``) skips the part the
    server already holds, which it refuses as a duplicate, and sends the rest: the proof counts."""
    keys = [Keypair() for _ in range(2 * limits.PART_CLIENTS + 4)]
    state = new_run(LARGE)
    for i, kp in enumerate(keys):
        me = bytes(kp.pubkey())
        rules.join(state, me, RUN_ID, Role.Trainer if i % 4 == 3 else Role.Worker, limits.NO_STAGE, me)
    now = start_training(state)
    everyone = [c.id for c in state.clients]
    parts = parts_of(state, everyone, everyone)
    assert len(parts) == part_count(len(everyone)) == 3
    witness = next(kp for kp in keys if bytes(kp.pubkey()) == derived.witnesses(state)[0])
    store = RunStore(tmp_path / "run.sqlite")
    store.save(RUN_ID, state.nonce, encode_state(state), bytes(32), Tick().encode())

    async def main() -> None:
        server = CoordinatorServer(spec=RunSpec(RUN_ID, LARGE, MODEL, state.checkpoints[0]), store=store,
                                   authority=Keypair(), clock=lambda: now, join_authority=rules.NO_AUTHORITY)
        port = await server.start(port=0)
        backend = TcpBackend(f"127.0.0.1:{port}", witness)
        try:
            await backend.connect()
            await backend.witness(state.round.height, *parts[0], 0)  # the first try: part 0 in, its reply lost
            await backend.prove(state.round.height, parts)
            assert server.state.round.parts[0] == 0b111 and server.state.round.witness_count == 1
        finally:
            await backend.close()
            await server.stop()

    asyncio.run(main())
