"""A whole run with a hostile trainer and a hostile worker among honest clients (``tests.adversarial.hostile``).

Two workers per stage and two trainers on the real server, DHT, gRPC workers and witnesses. The hostile
trainer poisons its backwards, claims the honest trainer's receipts and tries to hide its commitments; the
hostile worker hijacks its stage peer's uid, publishes malformed reports and, when elected, proves empty
filters and health-checks everyone. The run must not notice: the honest loss drops, no honest client is
removed, and the copier is never counted, so the witnesses' health checks remove it. With every client
needed for ``min_clients``, each removal ends the epoch; the copier queues again and the next epoch goes on.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from client.identity import load_keypair
from coordinator_program.spec.state import CoordinatorState, Health, Phase
from tests.integration.test_swarm import CommittedLosses, fail_with_logs, watch

if TYPE_CHECKING:
    from client.swarm.launcher import Swarm

ROUNDS = 6
CONFIG = f"""
run_id = "it"
[config]
min_clients = 8
max_clients = 16
num_stages = 3
witness_nodes = 3
witness_quorum = 2
warmup_time = 30
max_round_train_time = 20
round_witness_time = 1
cooldown_time = 5
rounds_per_epoch = {ROUNDS}
total_steps = {ROUNDS}
global_batch_size = 16
[model]
n_layers = 3
n_heads = 2
d_model = 32
seq_len = 32
microbatch_size = 4
learning_rate = 0.01
"""
HOSTILE = (str(Path(__file__).parents[1] / "adversarial" / "hostile.py"),)


@pytest.mark.slow
def test_one_hostile_trainer_and_one_hostile_worker_cannot_stop_the_run(tmp_path: Path) -> None:
    from client.swarm.launcher import Swarm

    swarm = Swarm(tmp_path, CONFIG)
    clients = {f"{stage}{i}": ("worker", stage) for stage in ("head", "body1", "tail") for i in range(2)}
    clients |= {"trainer0": ("trainer", None), "trainer1": ("trainer", None)}
    hostile = {"body10": "worker", "trainer1": "trainer"}
    ids = start_run(swarm, clients, hostile)
    honest = {name: ids[name] for name in clients if name not in hostile}

    committed = CommittedLosses(swarm)
    try:
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 500, committed))
        rounds = [s for s in history if s.phase in (Phase.RoundTrain, Phase.RoundWitness)]
        assert_none_removed(rounds, honest)
        for epoch in {s.epoch for s in rounds}:
            if len({s.round.height for s in rounds if s.epoch == epoch}) < 2:
                continue  # a health check judges the previous round's proofs: an epoch of one round catches nobody
            assert any(caught(s, ids["trainer1"]) for s in rounds if s.epoch == epoch), \
                f"the copier was not caught in epoch {epoch}"
        losses = committed.curve(ids["trainer0"])
        assert len(losses) == ROUNDS and losses[-1] < losses[0], losses
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        committed.close()
        swarm.stop()


def caught(state: CoordinatorState, client: bytes) -> bool:
    """Whether ``client`` is out of the round or leaving it after a health check."""
    index = state.client_index(client)
    return index is None or state.clients[index].health != Health.Healthy


def start_run(swarm: Swarm, clients: dict[str, tuple[str, str | None]], hostile: dict[str, str],
              extra: dict[str, tuple[str, ...]] | None = None) -> dict[str, bytes]:
    """Start the server, the DHT and ``clients`` (name: role, stage), those named in ``hostile`` as that role of
    ``hostile.py``, with ``extra`` arguments by name; returns each client's key."""
    swarm.start_server()
    swarm.start_dht()
    keys = {name: swarm.start_client(name, role, stage, extra=(extra or {}).get(name, ()),
                                     command=HOSTILE + (hostile[name],) if name in hostile else ("-m", "client.cli"))
            for name, (role, stage) in clients.items()}
    return {name: bytes(load_keypair(key).pubkey()) for name, key in keys.items()}


def assert_none_removed(rounds: list[CoordinatorState], honest: dict[str, bytes]) -> None:
    """No honest client (name: key) is missing from any of ``rounds``."""
    for state in rounds:
        missing = [name for name, id_ in honest.items() if state.client_index(id_) is None]
        assert not missing, f"honest clients removed in round {state.epoch}.{state.round.height}: {missing}"
