"""The beacon's pure functions and when its commitments close (``coordinator_program.spec.beacon``, ``rules``)."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from coordinator_program.spec import derived, limits, reveals, rules
from coordinator_program.spec.beacon import join_commitment, mix_reveal, seed_commitment, withholders
from coordinator_program.spec.errors import WrongPhase
from coordinator_program.spec.selection import elect_witnesses, next_seed, witness_ticket
from coordinator_program.spec.state import Health, Role
from tests.spec.scenario import RUN_ID, SMALL, ident, join_pipeline, new_run, replace, start_training

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


def test_keys_ground_for_a_first_epoch_win_its_warmup_seats_only_by_chance_once_joiners_reveal() -> None:
    """Three keys ground to hold the lowest tickets under the seed a first epoch's warmup would have had without the
    joiners' secrets win every seat under it (3 of 3). With seven honest joiners committing to secrets, over 240
    draws of those secrets, the ground keys win every seat about as often as three keys of ten drawn at random would
    (1 in 120): the grinding bought nothing."""
    config = replace(SMALL, min_clients=8, max_clients=16, witness_nodes=3, witness_quorum=2)
    honest = [ident(i) for i in range(1, 8)]
    foreseen = next_seed(new_run(config).round.seed, 11)
    best = min(witness_ticket(foreseen, key) for key in honest)
    ground = [key for key in (hashlib.sha256(b"ground %d" % i).digest() for i in range(20_000))
              if witness_ticket(foreseen, key) < best][:3]
    assert len(ground) == 3
    everyone = honest + ground
    assert {everyone[i] for i in elect_witnesses(foreseen, everyone, 3)} == set(ground), "the attack, unrevealed"
    wins = 0
    for draw in range(240):
        state = new_run(config)
        secret = {key: hashlib.sha256(b"%d" % draw + key).digest() for key in honest}
        for i, key in enumerate(honest):
            role = Role.Trainer if i == 6 else Role.Worker
            rules.join(state, key, RUN_ID, role, limits.NO_STAGE, key, commitment=join_commitment(key, secret[key]))
        for key in ground:
            rules.join(state, key, RUN_ID, Role.Trainer, limits.NO_STAGE, key)
        rules.tick(state, 0, 11)
        assert state.round.seed == foreseen and derived.witnesses(state) == []
        for key in honest:
            reveals.reveal_seed(state, key, 0, secret[key])
        rules.tick(state, 0, 11)
        wins += set(derived.witnesses(state)) == set(ground)
    assert wins <= 8, f"the ground keys won every seat in {wins} of 240 draws, where chance gives about 2"
