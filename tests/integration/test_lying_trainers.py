"""A whole run with a trainer that sends plausible data that is not the run's (``tests.adversarial.hostile``'s
liar: real text, each sample answered with the next one's), or one that publishes presences alone (its idle
trainer), on the real server, DHT, gRPC workers and witnesses.

The liar's head refuses its tokens and publishes the evidence; the witnesses, who check it against the run's
dataset, leave it out of the epoch's first round although it publishes a presence, and the next round's health
check removes it: earlier than the rule for trainers that only publish presences, which removes the idle one
after its third round. The honest trainer's loss drops and no honest client is removed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client.identity import load_keypair
from client.witness.idle import IDLE_ROUNDS
from coordinator_program.spec.state import Phase
from tests.integration.test_hostile_swarm import CONFIG as HOSTILE_RUN
from tests.integration.test_hostile_swarm import HOSTILE, caught
from tests.integration.test_hostile_swarm import ROUNDS as HOSTILE_ROUNDS
from tests.integration.test_swarm import CommittedLosses, fail_with_logs, watch

ROUNDS = 5
CONFIG = (HOSTILE_RUN.replace("min_clients = 8", "min_clients = 4").replace("max_clients = 16", "max_clients = 8")
          .replace(f"= {HOSTILE_ROUNDS}\n", f"= {ROUNDS}\n")
          .replace("round_witness_time = 1\n", "round_witness_time = 3\n"))
"""The hostile swarm's run, for 5 clients: the liar's removal ends no epoch. Its first rounds end at their time
limit (the liar's batches never come), so the workers step and the witnesses prove only once the round is over: they
get 3 s, not 1, for a round without a quorum of proofs ends the epoch, and a loaded machine can take more than 1 s."""


@pytest.mark.slow
@pytest.mark.parametrize("kind, removed_by", [("wrong-data", 1), ("idle", IDLE_ROUNDS)])
def test_a_trainer_sending_other_text_or_nothing_is_removed(tmp_path: Path, kind: str, removed_by: int) -> None:
    """The liar is removed by the health check of the epoch's second round; the idle trainer, which publishes its
    presence each round and trains nothing, by that of the round after its third (``client.witness.idle``)."""
    from client.swarm.launcher import Swarm

    swarm = Swarm(tmp_path, CONFIG)
    swarm.start_server()
    swarm.start_dht()
    clients = {"head": ("worker", "head"), "body1": ("worker", "body1"), "trainer0": ("trainer", None),
               kind: ("trainer", None), "tail": ("worker", "tail")}
    keys = {}
    committed = CommittedLosses(swarm)
    try:
        for name, (role, stage) in clients.items():
            if name == "tail":  # the last, once the others are queued: every client enters the first epoch
                asyncio.run(watch(swarm, lambda s: len(s.pending) >= len(clients) - 1, 120))
            keys[name] = swarm.start_client(name, role, stage,
                                            command=HOSTILE + (kind,) if name == kind else ("-m", "client.cli"))
        ids = {name: bytes(load_keypair(key).pubkey()) for name, key in keys.items()}
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 400, committed))
        rounds = [s for s in history if s.phase in (Phase.RoundTrain, Phase.RoundWitness)]
        assert rounds, "the run never trained"
        rounds = [s for s in rounds if s.epoch == rounds[0].epoch]  # the first epoch, which the liar entered
        assert any(caught(s, ids[kind]) for s in rounds if s.round.height <= removed_by), \
            f"the {kind} trainer was not removed by the health check of round {removed_by}"
        assert not any(caught(s, ids[kind]) for s in rounds if s.round.height < removed_by), "removed too early"
        for state in rounds:
            removed = [n for n, id_ in ids.items() if n != kind and state.client_index(id_) is None]
            assert not removed, f"honest clients removed in round {state.round.height}: {removed}"
        refusal = "is not the run's dataset at those samples"  # a worker's; a witness says why it left one out
        assert (refusal in swarm.log_text("head")) == (kind == "wrong-data")
        assert refusal not in swarm.log_text("tail"), "the liar's requests never got past the head"
        ledger = {entry.id: entry for entry in history[-1].ledger}
        assert ledger[ids["trainer0"]].presence == ROUNDS, "the honest trainer was counted in every round"
        assert ids[kind] not in ledger or ledger[ids[kind]].compute == 0, f"the {kind} trainer earned compute"
        losses = committed.curve(ids["trainer0"])  # the last round's may be gone: clients leave when the run ends
        assert len(losses) >= ROUNDS - 1 and losses[-1] < losses[0], losses
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        committed.close()
        swarm.stop()
