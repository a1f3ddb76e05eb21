"""Issue 22 on the real program: a proof in parts, attacked. A run of 130 clients (two parts) in LiteSVM, replayed on
the specification alongside: a quorum of witnesses each sending only part of its proof must neither end the round
nor count; a part sent twice, or one the round does not have, is refused with the account unchanged; and a round
whose end credits more clients than a tick does takes ticks that refuse any late proof."""

from __future__ import annotations

import dataclasses

from coordinator_chain import Swarm, training_swarm
from solders.keypair import Keypair

from coordinator_program.spec import derived, errors, limits
from coordinator_program.spec.config import bloom_params, filter_capacity
from coordinator_program.spec.instructions import Tick
from coordinator_program.spec.state import Phase
from tests.spec.scenario import MODEL, SMALL

SLICES, BITS = bloom_params(filter_capacity(limits.MAX_CLIENTS), 0.0009)
CONFIG = dataclasses.replace(SMALL, max_clients=limits.MAX_CLIENTS, min_clients=5, witness_nodes=5, witness_quorum=3,
                             bloom_slices=SLICES, bloom_bits_per_slice=BITS, global_batch_size=100)


def swarm_of_two_parts() -> tuple[Swarm, Keypair]:
    swarm, authority = training_swarm(CONFIG, MODEL, workers=100, trainers=30, run_id="parts")
    assert len(swarm.clients()) == 130 > limits.PART_CLIENTS
    return swarm, authority


def test_partial_and_repeated_parts_never_count_on_chain() -> None:
    swarm, authority = swarm_of_two_parts()
    apply = swarm.replay.apply
    first, second = swarm.proof_parts(swarm.clients())
    witnesses = derived.witnesses(swarm.state)
    for w in witnesses[:CONFIG.witness_quorum]:  # a quorum, each one part short
        assert apply(first, swarm.of(w)) is None
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.witness_count == 0
    assert apply(Tick(), authority) == errors.NothingToTick.code
    assert apply(first, swarm.of(witnesses[0])) == errors.DuplicateWitness.code
    beyond = dataclasses.replace(second, part=2)
    assert apply(beyond, swarm.of(witnesses[0])) == errors.BadFilter.code
    assert apply(second, swarm.of(witnesses[0])) is None
    assert swarm.state.round.witness_count == 1 and swarm.state.phase == Phase.RoundTrain
    assert apply(second, swarm.of(witnesses[0])) == errors.DuplicateWitness.code


def test_a_round_of_two_chunks_ends_in_two_ticks_and_refuses_late_proofs_between() -> None:
    swarm, authority = swarm_of_two_parts()
    apply = swarm.replay.apply
    witnesses = derived.witnesses(swarm.state)
    assert swarm.prove(swarm.clients(), witnesses[:CONFIG.witness_quorum]) == [None] * CONFIG.witness_quorum
    assert swarm.state.phase == Phase.RoundWitness  # the quorum's last part ticked
    assert apply(Tick(), authority, advance=CONFIG.round_witness_time) is None
    assert swarm.state.phase == Phase.RoundWitness and swarm.state.round.credited == limits.CREDIT_CLIENTS
    late = swarm.proof_parts(swarm.clients())[0]
    assert apply(late, swarm.of(witnesses[-1])) == errors.WrongPhase.code
    assert apply(Tick(), authority) is None
    assert swarm.state.phase == Phase.RoundTrain and swarm.state.round.height == 1
    assert len(swarm.state.ledger) == len(swarm.clients())
