"""A trainer's presence: a trainer that could not finish its round (a stage emptied under it) is present, and so
not a health-check target, but earns no batch; a presence that is not the trainer's own, or not of this round,
makes no one present, and neither does one beside a false commitment."""

from __future__ import annotations

from client.witness.judge import judge_round
from client.witness.records import Presence
from coordinator_program.spec.bloom import contains_raw, participant_key
from coordinator_program.spec.state import Role
from tests.spec.scenario import SMALL
from tests.witness.rounds import commitment, honest_round, run_with_keys, shares, workers_by_stage


def presence(state, keys, client: bytes, **changes: object) -> Presence:
    fields = dict(run_id=state.run_id, epoch=state.epoch, round=state.round.height)
    return Presence.create(keys[client], **{**fields, **changes})


def test_a_stalled_trainer_is_present_without_credit() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    stalled, finished = shares(state)
    del commitments[stalled.client.hex()]  # its stage emptied: it never completed its share
    presences = {t.client.hex(): presence(state, keys, t.client) for t in (stalled, finished)}
    evidence = judge_round(state, commitments, reports, presences)
    assert stalled.client in evidence.participants and stalled.client not in evidence.losses
    assert not evidence.complete and evidence.missing == [stalled.client], "its batch is still missing"
    assert len(evidence.batches) == 1, "only the finished trainer's commitment earns a batch"
    [(participants, _)] = evidence.filters(state)
    assert contains_raw(participants, participant_key(stalled.client), SMALL.bloom_slices, SMALL.bloom_bits_per_slice)


def test_without_a_presence_the_stalled_trainer_is_missing_as_before() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    stalled = shares(state)[0]
    del commitments[stalled.client.hex()]
    assert stalled.client not in judge_round(state, commitments, reports).participants


def test_a_presence_counts_only_for_its_author_as_a_trainer_of_this_round() -> None:
    state, keys = run_with_keys()
    trainer, other = (c.id for c in state.clients if c.role == Role.Trainer)
    worker = next(c.id for c in state.clients if c.role == Role.Worker)
    forged = {
        other.hex(): presence(state, keys, trainer),  # the trainer's record filed under another trainer
        worker.hex(): presence(state, keys, worker),  # a worker posing as a trainer
    }
    evidence = judge_round(state, {}, {}, forged)
    assert not {trainer, other, worker} & evidence.participants
    for stale in (presence(state, keys, trainer, round=state.round.height + 1),
                  presence(state, keys, trainer, epoch=state.epoch + 1),
                  presence(state, keys, trainer, run_id="another-run")):
        assert trainer not in judge_round(state, {}, {}, {trainer.hex(): stale}).participants


def test_a_false_commitment_voids_the_presence_but_a_worker_that_died_costs_its_trainers_nothing() -> None:
    """A copier quotes the receipts another trainer was issued: it signed a lie, and its presence counts for
    nothing (the health checks remove it). A trainer whose worker died before reporting what it issued holds that
    worker's signed receipts: it is counted in full; the dead worker is absent, and earns nothing."""
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    copier, victim = shares(state)
    stolen = commitments[victim.client.hex()]
    commitments[copier.client.hex()] = commitment(state, keys, copier, list(stolen.receipts))
    presences = {t.client.hex(): presence(state, keys, t.client) for t in (copier, victim)}
    evidence = judge_round(state, commitments, reports, presences)
    assert copier.client not in evidence.participants and "issued to trainer" in evidence.why_missing[copier.client]
    assert victim.client in evidence.participants and victim.client in evidence.losses

    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    body = workers_by_stage(state)[1]
    del reports[body.hex()]  # it died before reporting what it issued
    evidence = judge_round(state, commitments, reports)
    assert {s.client for s in shares(state)} <= evidence.computed and evidence.missing == []
    assert body not in evidence.participants | evidence.computed and body not in evidence.charged
    assert not evidence.complete and evidence.unreported == {body}, "a witness waits for its report till RoundWitness"
