"""A whole run on ``psyswarm localnet``: real ``join-run --url`` contributors (three stage workers and a trainer)
train through the Solana program, with ``tick --url --every`` as the ticker (clients do not tick by
themselves yet). About half a minute: torch and hivemind start in six processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.solana import SolanaBackend
from client.identity import save_keypair
from client.swarm.launcher import Swarm
from coordinator_program.spec.config import parse_run_spec
from coordinator_program.spec.rules import NO_AUTHORITY
from coordinator_program.spec.state import CoordinatorState, Phase
from tests.solana.conftest import Localnet, new_run_id

TIMEOUT = 300.0


def tiny_spec(run_id: str):
    return parse_run_spec({
        "run_id": run_id,
        "config": {"min_clients": 4, "max_clients": 8, "num_stages": 3, "witness_nodes": 2, "witness_quorum": 2,
                   "warmup_time": 30, "max_round_train_time": 30, "round_witness_time": 1, "cooldown_time": 2,
                   "rounds_per_epoch": 3, "total_steps": 3, "global_batch_size": 8},
        "model": {"n_layers": 3, "n_heads": 2, "d_model": 32, "seq_len": 32, "microbatch_size": 8,
                  "learning_rate": 0.01},
    })


@pytest.mark.slow
def test_a_run_trains_to_the_end_through_the_program(localnet: Localnet, tmp_path: Path) -> None:
    run_id = new_run_id()
    authority = Keypair()
    keys = {name: Keypair() for name in ("head", "body1", "tail", "trainer", "ticker")}
    swarm = Swarm(tmp_path, "")
    history: list[CoordinatorState] = []

    async def create_and_watch() -> None:
        await localnet.fund(authority, *keys.values())
        creator = SolanaBackend(localnet.url, authority, run_id)
        await creator.create_run(tiny_spec(run_id), NO_AUTHORITY)
        try:
            swarm.start_dht()
            for name, key in keys.items():
                path = str(save_keypair(key, tmp_path / "keys" / f"{name}.json"))
                target = ["--url", localnet.url, "--run-id", run_id, "--keypair", path]
                if name == "ticker":
                    swarm._spawn(name, "tick", *target, "--every", "1s")  # the Swarm helper speaks --server only
                    continue
                role = ["--role", "trainer"] if name == "trainer" else ["--role", "worker", "--stage", name]
                swarm._spawn(name, "join-run", *target, *role, "--initial-peer", swarm.peer, "--threads", "1",
                             "--checkpoint-dir", str(tmp_path / "checkpoints"))
            async for state in creator.updates():
                history.append(state)
                if state.phase == Phase.Finished:
                    return
        finally:
            await creator.close()

    try:
        asyncio.run(asyncio.wait_for(create_and_watch(), TIMEOUT))
        phases = [s.phase for s in history]
        assert Phase.Warmup in phases and Phase.RoundTrain in phases and Phase.Cooldown in phases, phases
        final = history[-1]
        assert final.step == 3
        assert any(s.round.witnessed for s in history), "no witness proof reached the program"
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        logs = "\n".join(f"--- {name}\n{swarm.log_text(name)[-2500:]}" for name in swarm.procs)
        pytest.fail(f"{exc!r}\n{[s.phase.name for s in history]}\n{logs}")
    finally:
        swarm.stop()
