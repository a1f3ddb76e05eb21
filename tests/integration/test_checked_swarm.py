"""Whole runs whose stages average gradients every step, three workers per stage, one of them hostile: a liar, or
an attacker of its stage's averaging (the last two tests).

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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from coordinator_program.spec.state import Phase
from tests.integration.test_hostile_swarm import assert_none_removed, caught, start_run
from tests.integration.test_swarm import CommittedLosses, fail_with_logs, watch

if TYPE_CHECKING:
    from client.swarm.launcher import Swarm

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


def run_with_a_hostile_body_worker(tmp_path: Path, role: str, evidence: Callable[[Swarm], None],
                                   extra: dict[str, tuple[str, ...]] | None = None, config: str = CONFIG) -> None:
    """Run ``config``'s swarm with ``body10`` playing ``role`` of ``tests.adversarial.hostile``; assert that it is
    removed, no honest client is, the honest loss drops and ``evidence`` (the logs' account of how) holds."""
    from client.swarm.launcher import Swarm

    swarm = Swarm(tmp_path, config)
    clients = {f"{stage}{i}": ("worker", stage) for stage in ("head", "body1", "tail") for i in range(3)}
    clients["trainer"] = ("trainer", None)
    ids = start_run(swarm, clients, {"body10": role}, extra)
    honest = {name: id_ for name, id_ in ids.items() if name != "body10"}
    committed = CommittedLosses(swarm)
    try:
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 600, committed))
        rounds = [s for s in history if s.phase in (Phase.RoundTrain, Phase.RoundWitness)]
        assert_none_removed(rounds, honest)
        assert any(caught(s, ids["body10"]) for s in rounds), f"the {role} was never removed"
        evidence(swarm)
        losses = committed.curve(ids["trainer"])
        assert len(losses) >= 2 and losses[-1] < losses[0], losses
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        committed.close()
        swarm.stop()


@pytest.mark.slow
def test_a_lying_worker_is_caught_accused_and_removed(tmp_path: Path) -> None:
    def accused(swarm: Swarm) -> None:
        assert "accused 1 worker(s) of wrong answers" in swarm.log_text("trainer")

    run_with_a_hostile_body_worker(tmp_path, "liar", accused, {"trainer": ("--check-rate", "1")})


@pytest.mark.slow
def test_a_member_attacking_its_stage_s_averaging_is_accused_and_removed(tmp_path: Path) -> None:
    """Issue 20: ``overclaimer`` sends −60 × its gradient and seals a weight of twice the round's batch in every
    round, and a stranger beside it (off the roster) joins each round with that gradient times 1e3. Its honest
    groupmates refuse the stranger, drop the member from each all-reduce and average between themselves, and
    publish the member's sealed declaration in an accusation (``StageAverager.drain_lies``); the witnesses find
    the lie with the run's settings alone and leave it out of their proofs, and the health check removes it
    (each removal ends the epoch, every client being needed for ``min_clients``; it queues again and the next
    epoch goes on)."""
    def accused(swarm: Swarm) -> None:
        logs = swarm.log_text("body11") + swarm.log_text("body12")
        assert "of signing an averaging declaration or reduction no honest worker makes" in logs, \
            "no groupmate accused it"
        assert "its key is not on the stage's roster" in logs, "the stranger never met an honest worker"

    run_with_a_hostile_body_worker(tmp_path, "overclaimer", accused)


@pytest.mark.slow
def test_a_member_returning_false_reductions_is_audited_accused_and_removed(tmp_path: Path) -> None:
    """Issue 20: ``false-reducer`` returns its shard of every all-reduce shifted by 0.01 and signs that, within
    every bound its groupmates check. After each round each honest groupmate audits it with probability 1/4
    (``client.averaging.audit``), so a round escapes both with probability 9/16 and twelve rounds with 0.1%; an
    audit finds the result is not the robust mean of the inputs it signed for, the auditor publishes its signed
    statement in an accusation, and the witnesses, recomputing it, leave it out of their proofs until the health
    check removes it."""
    rounds = 12
    config = CONFIG.replace(f"rounds_per_epoch = {ROUNDS}", f"rounds_per_epoch = {rounds}").replace(
        f"total_steps = {ROUNDS}", f"total_steps = {rounds}")

    def accused(swarm: Swarm) -> None:
        logs = swarm.log_text("body11") + swarm.log_text("body12")
        assert "of signing an averaging declaration or reduction no honest worker makes" in logs, \
            "no groupmate accused it"

    run_with_a_hostile_body_worker(tmp_path, "false-reducer", accused, config=config)
