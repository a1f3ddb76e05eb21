"""One lying witness against the coordinator (issue 11, item 5), on the specification and the C program at once.

Every operation goes through ``Replay``: a real transaction to the program in LiteSVM and the same operation on
the specification, whose account bytes must stay identical (both must also refuse the same operations with the
same error). The run is the shipped example's (``examples/state.toml``), in round 0 with three workers and a
trainer, three of whom are the round's witnesses. The attacker is one of those witnesses: it sends an empty,
truncated or false participant filter, then health-checks the clients its filter left out. Before the fix the
example's quorum of one let its proof end round 0 at once, and a health check needed only as many filters
holding a client as proofs had come, up to the quorum, so its empty filter beside a single honest proof got
every honest client removed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.witness.judge import unhealthy_clients
from coordinator_program.spec import derived, errors
from coordinator_program.spec.config import Checkpoint, load_run_spec, validate_config
from coordinator_program.spec.instructions import HealthCheck, Tick, Update
from coordinator_program.spec.state import Health, Phase
from tests.program.coordinator_chain import ProgramChain, Replay, training_swarm

EXAMPLE = load_run_spec(Path(__file__).resolve().parents[2] / "examples" / "state.toml")
CONFIG = EXAMPLE.config
THREE_WITNESSES = dataclasses.replace(CONFIG, witness_nodes=3, witness_quorum=2)
"""The example's witnesses, spelled out: the health rule is attacked with a quorum the old code accepted too."""


@pytest.mark.parametrize(("witnesses", "quorum"), [(2, 1), (4, 2)], ids=["one of two", "two of four"])
def test_a_quorum_that_is_not_a_strict_majority_is_refused(witnesses: int, quorum: int) -> None:
    """The old example (one proof of two witnesses settled a round) and a tie are refused at validation, by
    ``psyswarm validate-config`` (config.py) and by the program's update alike; the example itself passes."""
    weak = dataclasses.replace(CONFIG, witness_nodes=witnesses, witness_quorum=quorum)
    with pytest.raises(errors.InvalidConfig, match="witness_quorum: must be a strict majority"):
        validate_config(weak)
    authority = Keypair()
    replay = Replay(ProgramChain(), authority, EXAMPLE.run_id)
    assert replay.apply(Update(weak, EXAMPLE.model, Checkpoint()), authority) == errors.InvalidConfig.code
    assert replay.apply(Update(CONFIG, EXAMPLE.model, Checkpoint()), authority) is None
    assert 2 * CONFIG.witness_quorum > CONFIG.witness_nodes


LIES = ["empty", "names only itself"]


@pytest.mark.parametrize("lie", LIES)
def test_one_witness_proof_does_not_end_the_round(lie: str) -> None:
    """The liar first sends its filter one byte short (refused, changing nothing), then whole."""
    swarm, authority = training_swarm(CONFIG, EXAMPLE.model)
    liar = derived.witnesses(swarm.state)[0]
    bloom = swarm.filter_of([] if lie == "empty" else [liar])
    assert swarm.replay.apply(swarm.proof(bloom[:-1]), swarm.of(liar)) == errors.BadFilter.code
    assert swarm.replay.apply(swarm.proof(bloom), swarm.of(liar)) is None
    assert swarm.state.phase == Phase.RoundTrain
    assert swarm.replay.apply(Tick(), authority) == errors.NothingToTick.code
    assert swarm.replay.apply(Tick(), authority, advance=CONFIG.max_round_train_time - 1) == \
        errors.NothingToTick.code
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 0


@pytest.mark.parametrize("lie", LIES)
def test_one_witness_cannot_get_honest_clients_removed(lie: str) -> None:
    """The attacker's false filter and one honest proof make the quorum (the third witness is silent); in
    round 1 it health-checks every client its filter left out, and every check is refused."""
    swarm, authority = training_swarm(THREE_WITNESSES, EXAMPLE.model)
    liar, honest, _silent = derived.witnesses(swarm.state)
    assert swarm.prove([] if lie == "empty" else [liar], [liar]) == [None]
    assert swarm.prove(swarm.clients(), [honest]) == [None]
    assert swarm.state.phase == Phase.RoundWitness  # a quorum of proofs, one of them honest
    assert swarm.replay.apply(Tick(), authority, advance=THREE_WITNESSES.round_witness_time) is None
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 1

    assert unhealthy_clients(swarm.state) == [], "the client would health-check clients the rule keeps"
    for target in swarm.clients():
        if target != liar:
            assert swarm.replay.apply(HealthCheck(target), swarm.of(liar)) == errors.ClientHealthy.code
    assert all(c.health == Health.Healthy for c in swarm.state.clients)
    assert swarm.prove(swarm.clients()).count(None) >= THREE_WITNESSES.witness_quorum
    assert swarm.replay.apply(Tick(), authority, advance=THREE_WITNESSES.round_witness_time) is None
    assert swarm.state.round.height == 2 and len(swarm.state.clients) == 4


def test_one_witness_cannot_shield_a_client_a_quorum_left_out() -> None:
    """The control: the rule still removes. Two honest witnesses leave a silent client out, the attacker names
    it, and the health check (which ``unhealthy_clients`` finds, as the program judges) removes it. The old
    rule removed it too; this guards against a fix that would remove no one."""
    swarm, authority = training_swarm(THREE_WITNESSES, EXAMPLE.model, workers=4)
    elected = derived.witnesses(swarm.state)
    silent = next(c for c in swarm.clients() if c not in elected)
    liar, *honest = elected
    assert swarm.prove(swarm.clients(), [liar]) == [None]
    assert swarm.prove([c for c in swarm.clients() if c != silent], honest) == [None, None]
    assert swarm.replay.apply(Tick(), authority, advance=THREE_WITNESSES.round_witness_time) is None
    assert unhealthy_clients(swarm.state) == [silent]
    checker = next(c for c in swarm.clients() if c != silent)
    assert swarm.replay.apply(HealthCheck(silent), swarm.of(checker)) is None
    assert swarm.state.clients[swarm.state.client_index(silent)].health == Health.Unhealthy
