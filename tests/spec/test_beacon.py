"""The beacon's pure functions and when its commitments close (``coordinator_program.spec.beacon``, ``rules``)."""

from __future__ import annotations

import itertools

import pytest

from coordinator_program.spec import derived, reveals
from coordinator_program.spec.beacon import mix_reveal, seed_commitment, withholders
from coordinator_program.spec.errors import WrongPhase
from coordinator_program.spec.state import Health
from tests.spec.scenario import SMALL, join_pipeline, new_run, replace, start_training

A, B = b"\x01" * 32, b"\x02" * 32


def test_a_commitment_binds_the_committer_the_round_and_the_secret() -> None:
    base = seed_commitment(A, 7, b"s" * 32)
    assert len(base) == 32
    assert base != seed_commitment(B, 7, b"s" * 32), "a copied commitment must open for no one else"
    assert base != seed_commitment(A, 8, b"s" * 32), "nor be replayed in another round"
    assert base != seed_commitment(A, 7, b"t" * 32)


def test_the_reveals_are_the_same_in_every_order() -> None:
    secrets = [bytes([i]) * 32 for i in (3, 5, 9)]
    mixes = {bytes(32)}
    for order in itertools.permutations(secrets):
        mix = bytes(32)
        for secret in order:
            mix = mix_reveal(mix, secret)
        mixes.add(mix)
    assert len(mixes) == 2, "one value whatever the order (besides the empty mix)"


def test_withholders_are_the_committers_that_did_not_reveal() -> None:
    assert withholders(0b1011, 0b0001) == [1, 3]
    assert withholders(0b0110, 0b0110) == []


def test_commitments_close_at_a_quorum_or_once_every_healthy_witness_committed() -> None:
    state = new_run()  # three witnesses, a quorum of two
    join_pipeline(state, workers=4, trainers=1)
    start_training(state)
    first, second, third = derived.witnesses(state)
    reveals.commit_seed(state, first, 0, seed_commitment(first, state.round.seed, first))
    assert not reveals.commitments_closed(state)
    with pytest.raises(WrongPhase):  # a secret shown while a witness could still commit
        reveals.reveal_seed(state, first, 0, first)
    state.clients[state.client_index(third)].health = Health.Withdrawn  # it can no longer commit
    assert not reveals.commitments_closed(state), "the second may still commit"
    state.clients[state.client_index(third)].health = Health.Healthy
    reveals.commit_seed(state, second, 0, seed_commitment(second, state.round.seed, second))
    assert reveals.commitments_closed(state), "a quorum committed"
    with pytest.raises(WrongPhase):  # a commitment now could be chosen after a reveal
        reveals.commit_seed(state, third, 0, bytes(32))
    reveals.reveal_seed(state, first, 0, first)
    assert state.round.reveals == first


def test_commitments_close_once_every_healthy_witness_committed() -> None:
    state = new_run(replace(SMALL, witness_nodes=3, witness_quorum=3))
    join_pipeline(state, workers=4, trainers=1)
    start_training(state)
    first, second, third = derived.witnesses(state)
    for witness in (first, second):
        reveals.commit_seed(state, witness, 0, seed_commitment(witness, state.round.seed, witness))
    assert not reveals.commitments_closed(state)
    state.clients[state.client_index(third)].health = Health.Withdrawn  # leaving: it can no longer commit
    assert reveals.commitments_closed(state)
