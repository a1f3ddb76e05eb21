"""A whole run whose stages average gradients every step, three workers per stage, one of them lying.

The real server, DHT, gRPC workers, gradient averaging and witnesses; the lying worker (``tests.adversarial.hostile``,
``liar``) shifts half of its stage's outputs, signing them as its own. The trainer checks every microbatch
(``--check-rate 1``): the liar is found wrong by its stage's majority, accused, left out of the witnesses' proofs
and removed by the health check; no honest client is removed, and the honest loss drops.

Round 0 is the one whose replicas are identical for sure (one seed); a later round's are only where the stage's
gradient all-reduce succeeded, which a loaded machine can miss (each worker then steps on its own gradient and
three replicas disagree, accusing nobody). So a round carries 8 microbatches, in which the liar answers some ten
questions, half of them lies: it is caught in round 0 with all but certainty. RoundWitness lasts 5 s, the longest
matchmaking wait the run's averaging takes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator_program.spec.state import Phase
from tests.integration.test_hostile_swarm import assert_none_removed, caught, start_run
from tests.integration.test_swarm import CommittedLosses, fail_with_logs, watch

ROUNDS = 4
CONFIG = f"""
run_id = "it"
[config]
min_clients = 10
max_clients = 16
num_stages = 3
witness_nodes = 3
witness_quorum = 2
warmup_time = 30
max_round_train_time = 30
round_witness_time = 5
cooldown_time = 5
rounds_per_epoch = {ROUNDS}
total_steps = {ROUNDS}
global_batch_size = 32
[model]
n_layers = 3
n_heads = 2
d_model = 32
seq_len = 32
microbatch_size = 4
learning_rate = 0.01
grad_averaging = "full"
"""


@pytest.mark.slow
def test_a_lying_worker_is_caught_accused_and_removed(tmp_path: Path) -> None:
    from client.swarm.launcher import Swarm

    swarm = Swarm(tmp_path, CONFIG)
    clients = {f"{stage}{i}": ("worker", stage) for stage in ("head", "body1", "tail") for i in range(3)}
    clients["trainer"] = ("trainer", None)
    ids = start_run(swarm, clients, {"body10": "liar"}, {"trainer": ("--check-rate", "1")})
    honest = {name: id_ for name, id_ in ids.items() if name != "body10"}
    committed = CommittedLosses(swarm)
    try:
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 600, committed))
        rounds = [s for s in history if s.phase in (Phase.RoundTrain, Phase.RoundWitness)]
        assert_none_removed(rounds, honest)
        assert any(caught(s, ids["body10"]) for s in rounds), "the lying worker was never removed"
        assert "accused 1 worker(s) of wrong answers" in swarm.log_text("trainer")
        losses = committed.curve(ids["trainer"])
        assert len(losses) >= 2 and losses[-1] < losses[0], losses
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        committed.close()
        swarm.stop()
