"""A whole run with a trainer that sends plausible data that is not the run's (``tests.adversarial.hostile``'s
liar: real text, each sample answered with the next one's), on the real server, DHT, gRPC workers and witnesses.

Its head refuses its tokens and publishes the evidence; the witnesses, who check it against the run's dataset,
leave it out of the epoch's first round although it publishes a presence, and the next round's health check
removes it: earlier than the rule for trainers that only publish presences could (three rounds). The honest
trainer's loss drops and no honest client is removed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from client.identity import load_keypair
from coordinator_program.spec.state import Phase
from tests.integration.test_hostile_swarm import CONFIG as HOSTILE_RUN
from tests.integration.test_hostile_swarm import HOSTILE, caught
from tests.integration.test_hostile_swarm import ROUNDS as HOSTILE_ROUNDS
from tests.integration.test_swarm import CommittedLosses, fail_with_logs, watch

ROUNDS = 4
CONFIG = (HOSTILE_RUN.replace("min_clients = 8", "min_clients = 4").replace("max_clients = 16", "max_clients = 8")
          .replace(f"= {HOSTILE_ROUNDS}\n", f"= {ROUNDS}\n"))
"""The hostile swarm's run, for 5 clients: rounds are as short, and the liar's removal ends no epoch."""


@pytest.mark.slow
def test_a_trainer_sending_other_text_is_refused_accused_and_removed(tmp_path: Path) -> None:
    from client.swarm.launcher import Swarm

    swarm = Swarm(tmp_path, CONFIG)
    swarm.start_server()
    swarm.start_dht()
    clients = {"head": ("worker", "head"), "body1": ("worker", "body1"), "trainer0": ("trainer", None),
               "liar": ("trainer", None), "tail": ("worker", "tail")}
    keys = {}
    committed = CommittedLosses(swarm)
    try:
        for name, (role, stage) in clients.items():
            if name == "tail":  # the last, once the others are queued: every client enters the first epoch
                asyncio.run(watch(swarm, lambda s: len(s.pending) >= len(clients) - 1, 120))
            keys[name] = swarm.start_client(name, role, stage,
                                            command=HOSTILE + ("liar",) if name == "liar" else ("-m", "client.cli"))
        ids = {name: bytes(load_keypair(key).pubkey()) for name, key in keys.items()}
        history = asyncio.run(watch(swarm, lambda s: s.phase == Phase.Finished, 400, committed))
        rounds = [s for s in history if s.phase in (Phase.RoundTrain, Phase.RoundWitness)]
        assert rounds, "the run never trained"
        rounds = [s for s in rounds if s.epoch == rounds[0].epoch]  # the first epoch, which the liar entered
        assert any(caught(s, ids["liar"]) for s in rounds if s.round.height <= 1), \
            "the liar was not removed by the health check of round 1"
        for state in rounds:
            removed = [n for n, id_ in ids.items() if n != "liar" and state.client_index(id_) is None]
            assert not removed, f"honest clients removed in round {state.round.height}: {removed}"
        refusal = "is not the run's dataset at those samples"  # a worker's; a witness says why it left one out
        assert refusal in swarm.log_text("head")
        assert refusal not in swarm.log_text("tail"), "the liar's requests never got past the head"
        losses = committed.curve(ids["trainer0"])
        assert len(losses) == ROUNDS and losses[-1] < losses[0], losses
    except (AssertionError, TimeoutError, RuntimeError) as exc:
        fail_with_logs(swarm, exc)
    finally:
        committed.close()
        swarm.stop()
