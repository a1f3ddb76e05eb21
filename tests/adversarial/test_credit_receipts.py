"""Credit only for real work: trainers that quote receipts they were not issued, reuse one, or do not cover
their range exactly once are not counted by the real judge; the honest trainer beside them is."""

from __future__ import annotations

from client.witness.judge import judge_round
from tests.witness.rounds import (
    STAGES,
    commitment,
    honest_round,
    receipt,
    reports_of,
    run_with_keys,
    share_receipts,
    shares,
    uid_of,
    workers_by_stage,
)


def counted(evidence, client: bytes) -> bool:
    return client in evidence.participants and client in evidence.losses and client not in evidence.missing


def test_a_trainer_copying_another_trainers_receipts_is_not_counted() -> None:
    """Issue 11, item 4: receipts are public in the DHT; a copier claims its own range with them and loss 0.001."""
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    honest, copier = shares(state)
    stolen = list(commitments[honest.client.hex()].receipts)
    commitments[copier.client.hex()] = commitment(state, keys, copier, stolen, loss=0.001)
    evidence = judge_round(state, commitments, reports)
    assert counted(evidence, honest.client)
    assert not counted(evidence, copier.client) and not evidence.complete
    assert "issued to trainer" in evidence.why_missing[copier.client]
    assert evidence.batches == {commitments[honest.client.hex()].digest()}


def test_a_receipt_used_in_two_commitments_counts_only_for_the_trainer_it_was_issued_to() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    owner, borrower = shares(state)
    own = list(commitments[borrower.client.hex()].receipts)
    borrowed = commitments[owner.client.hex()].receipts[0]
    commitments[borrower.client.hex()] = commitment(state, keys, borrower, [*own, borrowed])
    evidence = judge_round(state, commitments, reports)
    assert counted(evidence, owner.client) and not counted(evidence, borrower.client)

    # The same receipt listed twice in one commitment covers its samples twice.
    twice = list(commitments[owner.client.hex()].receipts)
    commitments[owner.client.hex()] = commitment(state, keys, owner, [*twice, twice[0]])
    evidence = judge_round(state, commitments, reports)
    assert not counted(evidence, owner.client) and "repeat" in evidence.why_missing[owner.client]


def test_receipts_must_cover_the_range_exactly_once_in_every_stage() -> None:
    state, keys = run_with_keys()
    honest, trainer = shares(state)
    workers = workers_by_stage(state)
    full = share_receipts(state, keys, trainer)
    head = [r for r in full if r["stage"] == "head"]
    others = [r for r in full if r["stage"] != "head"]
    redone = receipt(state, keys, trainer.client, workers[0], head[0]["sample_start"], head[0]["sample_end"],
                     microbatch="ran-again")  # a second, genuine run of the same samples
    wider = receipt(state, keys, trainer.client, workers[0], trainer.end - 1, trainer.end + 3)
    cases = {
        "skip": others + head[1:],  # the head never ran the first microbatch
        "repeat": others + head + [redone],  # the head ran it twice (both reported)
        "end at": others + head[:-1] + [wider],  # the last head receipt runs past the range
        "stage": full + [receipt(state, keys, trainer.client, workers[0], trainer.start, trainer.end, stage="body9")],
        "did not sign": others + head[:-1] + [{**head[-1], "worker_uid": uid_of(workers[1], 1)}],
    }
    honest_receipts = share_receipts(state, keys, honest)
    for why, receipts in cases.items():
        evidence = judge_round(state, {
            honest.client.hex(): commitment(state, keys, honest, honest_receipts),
            trainer.client.hex(): commitment(state, keys, trainer, receipts),
        }, reports_of(state, keys, honest_receipts + [r for r in receipts if r["stage"] in STAGES]))
        assert counted(evidence, honest.client), why
        assert not counted(evidence, trainer.client) and why in evidence.why_missing[trainer.client], why


def test_a_commitment_must_claim_the_tokens_of_its_samples() -> None:
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    honest, inflated = shares(state)
    commitments[inflated.client.hex()] = commitment(state, keys, inflated, list(commitments[inflated.client.hex()]
                                                                               .receipts), tokens=10**9)
    evidence = judge_round(state, commitments, reports)
    assert counted(evidence, honest.client) and not counted(evidence, inflated.client)
