"""PowerGossip between a stage's two workers on real hivemind averagers over loopback: the pair meets on its mean
along the directions mixed, opposite moves keep the mean through a codec, and a lying partner's pull is bounded."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch

from client.averaging.gossip import GossipAverager, GossipResult
from client.averaging.gossip_rule import MOVE_BOUND, vector_part
from client.averaging.gradients import GradAveraging, GradientSettings
from client.averaging.sparta import AveragingStatus
from client.averaging.values import GradValues
from tests.averagers import STEADY, at_once

RANK2 = GradientSettings(GradAveraging.POWERSGD, rank=2, timeouts=STEADY)


def pair_models(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two replicas of a matrix and a vector: the matrices differ by a rank-2 matrix (what one round of rank 2
    mixes away), the vectors everywhere."""
    generator = torch.Generator().manual_seed(seed)
    matrix, vector = torch.randn(24, 32, generator=generator), torch.randn(40, generator=generator)
    apart = torch.randn(24, 2, generator=generator) @ torch.randn(2, 32, generator=generator)
    return [matrix, vector], [matrix + apart, vector + torch.randn(40, generator=generator)]


def named(values: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [("layers.0.fc.weight", values[0].clone()), ("layers.0.norm.weight", values[1].clone())]


def mix_together(averagers: Sequence[GossipAverager], params: Sequence[list[torch.Tensor]],
                 index: int) -> list[GossipResult]:
    return at_once([lambda a=a, p=p: a.mix(p, index) for a, p in zip(averagers, params, strict=True)],
                   timeout=60, what="a gossip round")


def norm(tensor: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


def unbounded(make, values, settings=RANK2, cls=GossipAverager):  # type: ignore[no-untyped-def]
    averager = make(named(values), settings, cls=cls)
    averager.bound = math.inf
    return averager


def test_a_pair_meets_on_its_mean_along_the_directions_it_mixes(make_grad_averager) -> None:
    first, second = pair_models(1)
    params = [[t.clone() for t in first], [t.clone() for t in second]]
    averagers = [unbounded(make_grad_averager, first), unbounded(make_grad_averager, second)]
    results = mix_together(averagers, params, index=3)
    assert [r.moved for r in results] == [True, True], [r.round.reason for r in results]
    mean_matrix = (first[0] + second[0]) / 2
    for p in params:  # a rank-2 difference is mixed away by one round of rank 2
        torch.testing.assert_close(p[0], mean_matrix, rtol=0, atol=1e-4)
    part = vector_part(40, 3)
    mixed = torch.zeros(40, dtype=torch.bool)
    mixed[part] = True
    for p, own in zip(params, (first, second), strict=True):
        torch.testing.assert_close(p[1][mixed], ((first[1] + second[1]) / 2)[mixed], rtol=0, atol=1e-5)
        assert torch.equal(p[1][~mixed], own[1][~mixed]), "an element outside the round's eighth moved"


def test_through_int8_the_pair_moves_oppositely_so_its_mean_stays(make_grad_averager) -> None:
    """A codec's rounding changes how far apart the two end, never their mean: both hold the same P̂ and move
    by exactly opposite amounts."""
    first, second = pair_models(2)
    generator = torch.Generator().manual_seed(9)
    second[0] = second[0] + 0.1 * torch.randn(24, 32, generator=generator)  # full rank: rank 2 cannot mix it all
    settings = dataclasses.replace(RANK2, values=GradValues.INT8)
    params = [[t.clone() for t in first], [t.clone() for t in second]]
    averagers = [unbounded(make_grad_averager, first, settings), unbounded(make_grad_averager, second, settings)]
    results = mix_together(averagers, params, index=0)
    assert all(r.moved for r in results), [r.round.reason for r in results]
    for i in range(2):
        torch.testing.assert_close(params[0][i] + params[1][i], first[i] + second[i], rtol=0, atol=1e-5)
    assert norm(params[0][0] - params[1][0]) < 0.5 * norm(first[0] - second[0])


class _Liar(GossipAverager):
    """A partner that sends, in place of its model, the honest model's plus a large change: what it wants its
    partner to become."""

    def _packed(self, params, index):  # type: ignore[no-untyped-def]
        generator = torch.Generator().manual_seed(5)
        return [value + 100 * torch.randn(value.shape, generator=generator) for value in super()._packed(params, index)]


@pytest.mark.parametrize("bound", [MOVE_BOUND, math.inf])
def test_a_lying_partner_moves_an_honest_worker_no_farther_than_its_own_training_could(make_grad_averager,
                                                                                       bound) -> None:
    """The honest worker trains (its parameters change by a small step after its averager starts), then mixes with
    a liar. With the bound, no tensor moves farther than ``MOVE_BOUND`` × that step; without it (the control) the
    liar drags it a hundred times as far."""
    first, _ = pair_models(3)
    honest = make_grad_averager(named(first), RANK2, cls=GossipAverager)
    honest.bound = bound
    liar = make_grad_averager(named(first), RANK2, cls=_Liar)
    step = [0.01 * torch.ones_like(t) for t in first]
    trained = [t + s for t, s in zip(first, step, strict=True)]
    params = [[t.clone() for t in trained], [t.clone() for t in first]]
    results = mix_together([honest, liar], params, index=0)
    assert results[0].moved, results[0].round.reason
    moves = [norm(after - before) for after, before in zip(params[0], trained, strict=True)]
    if bound == MOVE_BOUND:
        part = vector_part(40, 0)
        limits = [MOVE_BOUND * norm(step[0]), MOVE_BOUND * norm(step[1][part])]
        assert all(m <= limit * (1 + 1e-4) for m, limit in zip(moves, limits, strict=True)), (moves, limits)
        assert results[0].clipped == 2
    else:
        assert moves[0] > 100 * MOVE_BOUND * norm(step[0])


class _WeightZero(GossipAverager):
    """A partner that declares weight 0 (and sends its parts so)."""

    def average(self, grads, samples, index, weight, **kwargs):  # type: ignore[no-untyped-def]
        return super().average(grads, samples, index, 0.0, **kwargs)


class _Poisoner(GossipAverager):
    """A partner that declares its honest values' norm and sends NaN in their place."""

    def _load(self, grads, index, weight, work=()):  # type: ignore[no-untyped-def]
        declared = super()._load(grads, index, weight)
        with self._locked():
            for buffer in self._buffers:
                buffer.fill_(float("nan"))
        return declared


def test_a_partner_declaring_another_weight_than_one_mixes_nothing(make_grad_averager) -> None:
    """A weight-0 partner would make the mean this worker's own signed values, pulling it toward zero."""
    first, second = pair_models(4)
    params = [[t.clone() for t in first], [t.clone() for t in second]]
    averagers = [unbounded(make_grad_averager, first), unbounded(make_grad_averager, second, cls=_WeightZero)]
    results = mix_together(averagers, params, index=0)
    assert not results[0].moved
    assert all(torch.equal(p, t) for p, t in zip(params[0], first, strict=True))


def test_a_partner_sending_non_finite_values_moves_nothing(make_grad_averager) -> None:
    """Its parts are refused as non-finite, so the round is incomplete, and an incomplete round moves nothing (the
    local values an all-reduce keeps for a refused part would otherwise read as a move toward zero)."""
    first, second = pair_models(10)
    params = [[t.clone() for t in first], [t.clone() for t in second]]
    averagers = [unbounded(make_grad_averager, first), unbounded(make_grad_averager, second, cls=_Poisoner)]
    results = mix_together(averagers, params, index=0)
    assert not results[0].moved and results[0].round.status != AveragingStatus.SKIPPED, results[0].round
    assert all(torch.equal(p, t) for p, t in zip(params[0], first, strict=True))


def test_with_no_peer_in_the_stage_the_round_is_skipped_and_nothing_moves(make_grad_averager) -> None:
    first, _ = pair_models(5)
    params = [t.clone() for t in first]
    result = make_grad_averager(named(first), RANK2, cls=GossipAverager).mix(params, 0, peers=0)
    assert (result.round.status, result.moved) == (AveragingStatus.SKIPPED, False)
    assert all(torch.equal(p, t) for p, t in zip(params, first, strict=True))


class _Trio(GossipAverager):
    """A member whose matchmaking forms groups of three, as a leader that lies about the group could."""

    group_size = 3


def test_a_group_of_three_mixes_nothing(make_grad_averager) -> None:
    """A third member has no sign: with three, the mean of the signed values is no pair's difference."""
    models = [pair_models(6)[0], pair_models(7)[0], pair_models(8)[0]]
    params = [[t.clone() for t in m] for m in models]
    averagers = [unbounded(make_grad_averager, m, cls=_Trio) for m in models]
    results = mix_together(averagers, params, index=0)
    assert [r.moved for r in results] == [False] * 3
    assert [r.round.group_size for r in results] == [3] * 3  # the group did form: the pair check refused it
    for p, m in zip(params, models, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(p, m, strict=True))


def test_a_state_loaded_is_no_training_a_liar_may_match(make_grad_averager) -> None:
    """A worker that loads a state far from the one it was built with (a joiner taking its peers') starts counting
    its own change there: a lying partner's first round moves it by nothing, not by twice the distance loaded."""
    first, _ = pair_models(9)
    honest = make_grad_averager(named(first), RANK2, cls=GossipAverager)
    liar = make_grad_averager(named(first), RANK2, cls=_Liar)
    loaded = [t + 5.0 for t in first]
    honest.start_from(loaded)
    params = [[t.clone() for t in loaded], [t.clone() for t in first]]
    results = mix_together([honest, liar], params, index=0)
    assert results[0].moved and results[0].clipped == 2, results[0].round.reason
    assert all(torch.equal(p, t) for p, t in zip(params[0], loaded, strict=True))
