"""Per-step gradient averaging on real hivemind averagers over loopback: full and PowerSGD, weights, attacks."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from client.averaging.gradients import (
    GradAveraging,
    GradientAverager,
    GradientProcess,
    GradientResult,
    GradientSettings,
)
from client.averaging.robust import KAPPA
from client.averaging.sparta import AveragingStatus, SpartaSettings
from tests.averagers import PATIENT

QUICK = SpartaSettings(min_matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=4.0,
                       allreduce_timeout=8.0, chunk_timeout=1.5)
FULL = GradientSettings(GradAveraging.FULL, timeouts=QUICK)


def powersgd(rank: int) -> GradientSettings:
    return GradientSettings(GradAveraging.POWERSGD, rank=rank, timeouts=QUICK)


def named(seed: int, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """A matrix PowerSGD compresses, a vector it sends in full."""
    generator = torch.Generator().manual_seed(seed)
    return [("layers.0.fc.weight", scale * torch.randn(24, 32, generator=generator)),
            ("layers.0.fc.bias", scale * torch.randn(24, generator=generator))]


def low_rank(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Like ``named``, with the matrix of rank 2 plus noise, as layers' gradients nearly are."""
    generator = torch.Generator().manual_seed(seed)
    matrix = torch.randn(24, 2, generator=generator) @ torch.randn(2, 32, generator=generator)
    return [("layers.0.fc.weight", matrix + 0.01 * torch.randn(24, 32, generator=generator)),
            ("layers.0.fc.bias", torch.randn(24, generator=generator))]


def grads(pairs: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for _, t in pairs]


def weighted(values: Sequence[list[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    total = sum(weights)
    return [sum(w * v[i] for v, w in zip(values, weights, strict=True)) / total for i in range(len(values[0]))]


def together(averagers: Sequence[GradientAverager], values: Sequence[list[torch.Tensor]], index: int,
             weights: Sequence[float]) -> list[GradientResult]:
    """One round on every averager at once, as the workers of a stage run it before their step."""
    results: list[Any] = [None] * len(averagers)

    def run(i: int) -> None:
        results[i] = averagers[i].average(values[i], int(weights[i]), index, weights[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(r is not None for r in results), "a gradient round did not return"
    return results


def assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor], atol: float = 1e-5) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=atol)


def test_full_mode_gives_the_sample_weighted_average(make_grad_averager) -> None:
    pairs = [named(1), named(2)]
    values = [grads(p) for p in pairs]
    expected = weighted(values, [3.0, 1.0])
    averagers = [make_grad_averager(p) for p in pairs]
    results = together(averagers, values, 0, [3.0, 1.0])
    assert [(r.status, r.samples, r.group_size, r.complete) for r in results] == [
        (AveragingStatus.AVERAGED, 4, 2, True)] * 2
    for v in values:
        assert_close(v, expected)


def test_a_gradient_group_of_every_roster_member_begins_at_once(make_grad_averager) -> None:
    """As a SPARTA group does (``test_averaging``): every member holds a seat, so no one else may join and the
    round does not wait out ``min_matchmaking_time``."""
    pairs = [named(1), named(2), named(3)]
    values = [grads(p) for p in pairs]
    averagers = [make_grad_averager(p, dataclasses.replace(FULL, timeouts=PATIENT)) for p in pairs]
    results = together(averagers, values, 0, [1.0, 2.0, 1.0])
    assert [(r.status, r.group_size, r.complete) for r in results] == [(AveragingStatus.AVERAGED, 3, True)] * 3
    assert max(r.seconds for r in results) < PATIENT.min_matchmaking_time / 2, results
    assert all(torch.equal(a, b) for v in values[1:] for a, b in zip(values[0], v, strict=True))  # one average


def test_a_weight_zero_peer_receives_the_average_and_changes_nothing(make_grad_averager) -> None:
    settings = dataclasses.replace(FULL, timeouts=dataclasses.replace(QUICK, min_group_size=3))
    pairs = [named(1), named(2), named(3, scale=50.0)]  # the syncing worker's gradient is far off: it must not count
    values = [grads(p) for p in pairs]
    expected = weighted(values[:2], [2.0, 1.0])
    averagers = [make_grad_averager(p, settings) for p in pairs]
    results = together(averagers, values, 0, [2.0, 1.0, 0.0])
    assert {(r.status, r.samples, r.group_size) for r in results} == {(AveragingStatus.AVERAGED, 3, 3)}
    for v in values:
        assert_close(v, expected)


def test_powersgd_sends_a_rank_r_approximation_whose_error_feedback_recovers_the_average(
        make_grad_averager) -> None:
    """The same two gradients every step (each of rank 2, so their average has rank 4): each step's result has
    rank r, both workers get the same one, and error feedback re-sends what compression lost, so the mean of
    the results converges to the true average (without it the error would stay that of a rank-2 truncation)."""
    rank = 2
    pairs = [low_rank(1), low_rank(2)]
    truth = weighted([grads(p) for p in pairs], [1.0, 1.0])
    averagers = [make_grad_averager(p, powersgd(rank)) for p in pairs]
    assert averagers[0].shapes == [(24, 32), None]
    total = [torch.zeros_like(t) for t in truth]
    errors = []
    for step in range(6):
        values = [grads(p) for p in pairs]
        results = together(averagers, values, step, [1.0, 1.0])
        assert [(r.status, r.complete) for r in results] == [(AveragingStatus.AVERAGED, True)] * 2
        assert_close(values[0], values[1])
        assert torch.linalg.matrix_rank(values[0][0]) <= rank
        assert_close([values[0][1]], [truth[1]])  # the vector travels in full
        total = [a + b for a, b in zip(total, values[0], strict=True)]
        errors.append(float((total[0] / (step + 1) - truth[0]).norm() / truth[0].norm()))
    singular = torch.linalg.svdvals(truth[0])
    truncation = float(singular[rank:].norm() / singular.norm())  # the best any rank-2 step alone can do
    assert errors[0] >= truncation - 1e-4 and truncation > 0.3
    assert errors[-1] < truncation / 2, (errors, truncation)


def test_without_peers_the_round_is_skipped_and_the_local_gradient_kept(make_grad_averager) -> None:
    pairs = named(1)
    values = grads(pairs)
    result = make_grad_averager(pairs).average(values, 5, 0, 5.0, peers=0)
    assert (result.status, result.samples, result.group_size) == (AveragingStatus.SKIPPED, 5, 0)
    assert_close(values, grads(pairs), atol=0)


class _Poisoner(GradientAverager):
    """A groupmate that declares its honest gradient's norm, then sends ``POISON`` in its place."""

    poison = float("nan")

    def _load(self, grads, index, weight, work=()):  # type: ignore[no-untyped-def]
        declared = super()._load(grads, index, weight)
        with self._locked():
            for buffer in self._buffers:
                buffer.fill_(self.poison)
        return declared


class _HugePoisoner(_Poisoner):
    poison = 1e30


class _LiarAboutNorm(_Poisoner):
    """Declares the norm of what it really sends: 1e30-sized values, far beyond the group's typical norm."""

    poison = 1e30

    def _load(self, grads, index, weight, work=()):  # type: ignore[no-untyped-def]
        return super(_Poisoner, self)._load([torch.full_like(g, self.poison) for g in grads], index, weight)


@pytest.mark.parametrize("mode, attacker", [(mode, attacker) for mode in ("full", "powersgd")
                                            for attacker in (_Poisoner, _HugePoisoner, _LiarAboutNorm)
                                            if attacker is not _Poisoner]
                         + [pytest.param(mode, _Poisoner, marks=pytest.mark.slow) for mode in ("full", "powersgd")])
def test_a_poisoned_contribution_never_enters_an_honest_average(make_grad_averager, attacker, mode) -> None:
    """Three workers; the third sends NaN or 1e30 values (declaring an honest norm, or the huge one). A NaN part is
    refused; a huge one is clipped by the robust reduction (``client.averaging.robust``), and what the liar returns
    as a reducer must pass the honest peers' bound. Either way the honest workers end with finite gradients no
    farther from their honest mean than the reduction's bound: (1 + KAPPA) times their own disagreement (the
    coordinate median lies between the honest values, and the result within KAPPA honest spreads of it)."""
    settings = FULL if mode == "full" else powersgd(2)
    settings = dataclasses.replace(settings, timeouts=dataclasses.replace(QUICK, min_group_size=3))
    pairs = [low_rank(1), low_rank(2), low_rank(3)]
    values = [grads(p) for p in pairs]
    local = [grads(p) for p in pairs[:2]]
    averagers = [make_grad_averager(p, settings) for p in pairs[:2]]
    averagers.append(make_grad_averager(pairs[2], settings, cls=attacker))
    results = together(averagers, values, 0, [1.0, 1.0, 1.0])
    for value, result in zip(values[:2], results[:2], strict=True):
        assert all(bool(torch.isfinite(t).all()) for t in value)
        assert result.status == AveragingStatus.AVERAGED
    if mode == "full":
        honest = weighted(local, [1.0, 1.0])
        spread = _norm([a - b for a, b in zip(local[0], local[1], strict=True)])
        for value in values[:2]:
            assert _norm([v - h for v, h in zip(value, honest, strict=True)]) <= (1 + KAPPA) * spread + 1e-5
    else:  # the compressed average of the honest two: bounded by their gradients
        bound = max(_norm(g) for g in local)
        for value in values[:2]:
            assert _norm(value) <= (1 + KAPPA) * bound


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors])))


class _Saboteur(GradientProcess):
    """Honest in round 0; in round 1 it sends NaN in one phase only (a merely huge part would be clipped by the
    robust reduction, not refused: this one must be refused, so that the phase ends without it)."""

    phase = b"PHASE_Q"

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):  # type: ignore[no-untyped-def]
        if self._round.value == 1 and group_id is not None and group_id.endswith(self.phase):
            for tensor in tensors:
                tensor.fill_(float("nan"))
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)


class _SaboteurP(_Saboteur):
    phase = b"PHASE_P"


# hivemind names its RPC handlers after the averager's class: the saboteurs must answer to the honest name.
_Saboteur.__name__ = _SaboteurP.__name__ = GradientProcess.__name__


@pytest.mark.parametrize("saboteur", [_SaboteurP, pytest.param(_Saboteur, marks=pytest.mark.slow)])
def test_a_phase_that_loses_a_peer_restores_the_error_feedback_buffer(make_grad_averager, saboteur) -> None:
    """Round 0 completes and moves every error-feedback buffer; in round 1 a groupmate's contribution to one
    phase is refused, so that phase ends without it: the honest workers step with the partial result, and
    every worker that saw the phase fail has exactly its buffer from before round 1 (the backup), not a
    half-updated one."""
    settings = dataclasses.replace(powersgd(2), timeouts=dataclasses.replace(QUICK, min_group_size=3))
    pairs = [low_rank(1), low_rank(2), low_rank(3)]
    averagers = [make_grad_averager(p, settings) for p in pairs[:2]]
    averagers.append(make_grad_averager(pairs[2], settings, cls=type("Bad", (GradientAverager,),
                                                                       {"process_class": saboteur})))
    results = together(averagers, [grads(p) for p in pairs], 0, [1.0, 1.0, 1.0])
    assert [(r.status, r.complete) for r in results] == [(AveragingStatus.AVERAGED, True)] * 3
    before = [[e.clone() for e in a.errors] for a in averagers[:2]]
    assert all(float(e.norm()) > 0 for errors in before for e in errors)
    values = [grads(p) for p in pairs]
    results = together(averagers, values, 1, [1.0, 1.0, 1.0])
    assert any(not r.complete for r in results[:2])  # the saboteur's parts were refused
    for averager, result, value, errors in zip(averagers[:2], results[:2], values[:2], before, strict=True):
        assert result.status == AveragingStatus.AVERAGED
        assert all(bool(torch.isfinite(t).all()) for t in value)
        if not result.complete:  # this peer saw the phase fail: its buffer is the one from before the round
            assert all(torch.equal(now, old) for now, old in zip(averager.errors, errors, strict=True))
            assert all(torch.equal(now, old) for now, old in zip(averager.backup, errors, strict=True))
        # A peer that reduced none of the saboteur's parts, and got every part of its own back within bounds,
        # cannot tell the phase lost a peer: its result excludes the saboteur all the same, and its buffer
        # moved with the result it got, as in a complete round.
