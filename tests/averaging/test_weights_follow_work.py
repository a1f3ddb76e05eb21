"""Weights that follow work, attacked against real hivemind averagers over loopback (issue 20, item 4).

In a round that credits work (``GradientSettings.round_samples``, as every coordinated run's gradient rounds
do), a groupmate's weight is at most the samples its trainer-signed Backward headers prove, each header naming
that groupmate as the worker it was sent to (``client.averaging.work``). Two honest workers prove samples 0-4
and 4-8 of round 0 (16 samples); the reverser claims the whole batch and sends -60x the honest mean gradient,
with:

- no evidence (it trained nothing): it averages with weight 0, and the honest workers apply exactly their own
  mean (on the old code it was admitted at 16 samples and the result was the robust reduction of all three);
- headers signed by its own key, or by the trainer for the next round's samples: they prove nothing, weight 0;
- trainer-signed headers altered, or signed for another stage or for a Forward: the signature does not hold
  for the round's run, stage and kind, and it is dropped;
- an honest worker's own headers, copied from the gathered declarations: they name that worker, so their
  signatures do not hold for the copier, and it is dropped like a forger (on the old code headers named no
  worker, and the copier was admitted with half their credit);
- more headers than the round has samples (a flood): dropped before a signature is checked.

No honest worker counts a failure in any of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from solders.keypair import Keypair

from client.averaging.gradients import GradAveraging, GradientSettings
from client.averaging.sparta import AveragingStatus
from client.averaging.work import evidence
from tests.averagers import FAST, signed_backwards
from tests.averaging.test_attacks import TRIO, _Reverser, reverser_round

ADMITTED = GradientSettings(GradAveraging.FULL, timeouts=TRIO, max_weight=16.0, round_samples=16)
DROPPED = dataclasses.replace(ADMITTED, timeouts=dataclasses.replace(FAST, min_matchmaking_time=3.0,
                                                                    matchmaking_timeout=8.0))
"""An honest leader refuses it, so groups of two form: with ``FAST``'s 4 s, one run in about seventeen found no
group at all on a loaded machine; a group found sooner ends matchmaking as soon. Where the liar leads, its group
waits 3 s for both honest workers (who then drop it and average as two): with ``FAST``'s 1 s, a loaded machine once
let it begin with one, who, dropping it, was left alone, while the other found no group."""


class _Claimant(_Reverser):
    """The reverser, declaring ``claim`` (entries in the declaration's form) as its evidence of work."""

    claim: list[Any] = []

    def _load(self, grads, index, weight, work=()):  # type: ignore[no-untyped-def]
        return {**super()._load(grads, index, weight), "work": self.claim}


def keys() -> list[Keypair]:
    """The keys of the two honest workers and the reverser, in ``reverser_round``'s order."""
    return [Keypair(), Keypair(), Keypair()]


def honest_work(make_grad_averager, run_id: str, workers: list[Keypair]) -> list[list[Any]]:
    trainer = make_grad_averager.trainer
    return [signed_backwards(trainer, run_id, "body1", 0, 4, per=2, worker=workers[0]),
            signed_backwards(trainer, run_id, "body1", 4, 8, per=2, worker=workers[1])]


def flat(value: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten() for t in value])


def test_a_member_that_trained_nothing_averages_with_weight_0(make_grad_averager, run_id: str) -> None:
    workers = keys()
    values, results, target = reverser_round(make_grad_averager, ADMITTED, 16.0, keys=workers,
                                             work=[*honest_work(make_grad_averager, run_id, workers), []])
    for value, result in zip(values, results, strict=True):
        assert result is not None and result.status == AveragingStatus.AVERAGED, result
        torch.testing.assert_close(flat(value), target, rtol=0, atol=1e-6)
        assert (result.group_size, result.samples, result.consecutive_failures) == (3, 8, 0)


def _altered(trainer: Keypair, run_id: str, liar: Keypair) -> list[Any]:
    entries = evidence(signed_backwards(trainer, run_id, "body1", 8, 12, worker=liar))
    entries[0][3] = 16  # the trainer signed samples 8-9; the copy claims 8-16
    return entries


def _claims(make_grad_averager, run_id: str, workers: list[Keypair]) -> dict[str, tuple[list[Any], GradientSettings]]:
    """Each forged or misused evidence of the reverser (``workers[2]``), with the settings under which its round
    forms (admitted at weight 0, or dropped)."""
    trainer, liar = make_grad_averager.trainer, workers[2]
    return {
        "own key": (evidence(signed_backwards(liar, run_id, "body1", 8, 16, per=2, worker=liar)), ADMITTED),
        "next round": (evidence(signed_backwards(trainer, run_id, "body1", 16, 32, per=2, worker=liar)), ADMITTED),
        "other stage": (evidence(signed_backwards(trainer, run_id, "body2", 8, 16, per=2, worker=liar)), DROPPED),
        "forward": (evidence(signed_backwards(trainer, run_id, "body1", 8, 16, per=2, kind="forward", worker=liar)),
                    DROPPED),
        "altered": (_altered(trainer, run_id, liar), DROPPED),
        "flood": (evidence(signed_backwards(trainer, run_id, "body1", 8, 9, worker=liar)) * 17, DROPPED),
    }


@pytest.mark.parametrize("claim", ["own key", "altered", "flood"] + [
    pytest.param(claim, marks=pytest.mark.slow) for claim in ("next round", "other stage", "forward")])
def test_evidence_that_proves_nothing_buys_nothing(make_grad_averager, run_id: str, claim: str) -> None:
    workers = keys()
    entries, settings = _claims(make_grad_averager, run_id, workers)[claim]
    liar = type("GradientAverager", (_Claimant,), {"claim": entries})
    values, results, target = reverser_round(make_grad_averager, settings, 16.0, attacker=liar, keys=workers,
                                             work=[*honest_work(make_grad_averager, run_id, workers), []])
    averaged = 0
    for value, result in zip(values, results, strict=True):
        assert result is not None and result.consecutive_failures == 0, result
        if result.status == AveragingStatus.AVERAGED:
            averaged += 1
            assert result.samples == 8 and result.group_size == (3 if settings is ADMITTED else 2), result
            torch.testing.assert_close(flat(value), target, rtol=0, atol=1e-6)
    assert averaged >= 1


def test_a_member_that_copies_another_s_evidence_is_credited_nothing(make_grad_averager, run_id: str) -> None:
    """The reverser declares the first honest worker's own evidence, as it finds it in the gathered declarations:
    each header names that worker, so none holds for the reverser, and it is dropped (by an honest leader before
    the group forms, or by both honest workers from the group it leads). The honest workers apply exactly their
    own mean and stand for their 8 samples. (The old code admitted it with half of samples 0-4, 2 of 8: a group
    of three whose result was the robust reduction of all three parts.)"""
    workers = keys()
    work = honest_work(make_grad_averager, run_id, workers)
    liar = type("GradientAverager", (_Claimant,), {"claim": evidence(work[0])})
    values, results, target = reverser_round(make_grad_averager, DROPPED, 16.0, attacker=liar, keys=workers,
                                             work=[*work, []])
    averaged = 0
    for value, result in zip(values, results, strict=True):
        assert result is not None and result.consecutive_failures == 0, result
        if result.status == AveragingStatus.AVERAGED:
            averaged += 1
            assert (result.group_size, result.samples) == (2, 8), result
            torch.testing.assert_close(flat(value), target, rtol=0, atol=1e-6)
    assert averaged >= 1
