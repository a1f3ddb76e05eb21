"""DeMo gradient averaging: the codec (``client.averaging.demo``) alone, then real hivemind averagers over
loopback in DeMo mode (the union of declared indices, malformed declarations, the momentum's backup)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hivemind.averaging import DecentralizedAverager

from client.averaging import demo
from client.averaging.gradients import GradAveraging, GradientAverager, GradientProcess, GradientSettings
from client.averaging.sparta import AveragingStatus
from coordinator_program.spec import limits
from coordinator_program.spec.config import DEFAULT_DEMO_BETA_PERMILLE
from tests.averaging.test_gradients import QUICK, assert_close, grads, together

CHUNK, TOPK = 32, 4


def demo_settings(beta: float = 0.0, min_group_size: int = 2) -> GradientSettings:
    return GradientSettings(GradAveraging.DEMO, chunk=CHUNK, topk=TOPK, beta=beta,
                            timeouts=dataclasses.replace(QUICK, min_group_size=min_group_size))


def alike(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A matrix DeMo chunks (24 × 32: 24 chunks of 32) and a bias it sends in full, near a common gradient, as
    workers' gradients are (so that the robust reduction of three is their mean)."""
    common, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    return [("layers.0.fc.weight", torch.randn(24, 32, generator=common) + 0.1 * torch.randn(24, 32, generator=own)),
            ("layers.0.fc.bias", torch.randn(24, generator=common) + 0.1 * torch.randn(24, generator=own))]


def demo_average(values: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What a group of alike peers with momentum 0 ends with: the sign of the IDCT of the mean of their
    coefficients at the union of their top-k positions (and the bias averaged in full); and that union."""
    coefficients = [demo.encode(demo.chunked(v[0], CHUNK)) for v in values]
    union = demo.union([demo.top_positions(c, TOPK) for c in coefficients], CHUNK, TOPK)
    mean = torch.stack([c.reshape(-1)[union] for c in coefficients]).mean(0)
    matrix = demo.unchunked(demo.decode(demo.scatter(mean, union, coefficients[0])), values[0][0].shape)
    return [matrix.sign(), torch.stack([v[1] for v in values]).mean(0)], union


# ----- the codec -----

@pytest.mark.parametrize("chunk", [2, 7, 64, 128])
def test_the_dct_is_orthonormal_and_decode_inverts_encode(chunk: int) -> None:
    basis = demo.dct_basis(chunk)
    torch.testing.assert_close(basis @ basis.T, torch.eye(chunk), rtol=0, atol=1e-5)
    x = torch.randn(5, chunk, generator=torch.Generator().manual_seed(chunk))
    torch.testing.assert_close(demo.decode(demo.encode(x)), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(demo.encode(x).norm(), x.norm(), rtol=1e-5, atol=0)  # what the norm limits rely on


def test_chunking_pads_and_unchunking_restores() -> None:
    x = torch.randn(5, 7)
    chunks = demo.chunked(x, 8)
    assert chunks.shape == (5, 8) and float(chunks.reshape(-1)[35:].abs().sum()) == 0
    assert torch.equal(demo.unchunked(chunks, x.shape), x)
    assert demo.chunk_count((5, 7), 8) == 5
    assert demo.chunk_count((35,), 8) is None and demo.chunk_count((2, 3), 8) is None  # vectors, tiny tensors


def test_top_positions_are_each_chunk_s_largest_coefficients_ascending() -> None:
    coefficients = torch.tensor([[0.1, -5.0, 0.2, 3.0, 0.0, -0.3], [9.0, 0.0, 0.0, 0.0, 0.0, -8.0]])
    assert demo.top_positions(coefficients, 2) == [1, 3, 0, 5]
    assert demo.top_positions(coefficients[:1], 3) == [1, 3, 5]


def test_the_union_is_sorted_and_the_same_in_any_order() -> None:
    a, b = [0, 3, 1, 2], [3, 5, 1, 2]  # two chunks of 8, two positions each
    union = demo.union([a, b], 8, 2)
    assert union.tolist() == [0, 3, 5, 9, 10]
    assert torch.equal(demo.union([b, a], 8, 2), union)
    values = torch.arange(5, dtype=torch.float32) + 1
    assert demo.scatter(values, union, torch.zeros(2, 8)).reshape(-1).nonzero().reshape(-1).tolist() == union.tolist()


@pytest.mark.parametrize("declared, reason", [
    ("0123", "not a list"),
    ([0, 1, 2], "3 indices, not 4"),
    ([0, 1, 2, 3, 4], "5 indices, not 4"),
    ([0, 1, 2, 8], "outside [0, 8)"),
    ([-1, 1, 2, 3], "outside [0, 8)"),
    ([0, 1.0, 2, 3], "not all ints"),
    ([0, True, 2, 3], "not all ints"),
    ([0, "1", 2, 3], "not all ints"),
    ([1, 0, 2, 3], "not ascending and distinct"),
    ([1, 1, 2, 3], "not ascending and distinct"),
    ([0, 1, 2**64, 3], "outside [0, 8)"),
])
def test_a_malformed_index_declaration_is_refused_with_its_reason(declared: Any, reason: str) -> None:
    assert reason in demo.index_refusal(declared, 2, 8, 2)
    assert demo.index_refusal([0, 1, 2, 7], 2, 8, 2) == ""


@pytest.mark.parametrize("changes, message", [
    ({}, "chunk of 2..128"),
    ({"chunk": 256, "topk": 4}, "chunk of 2..128"),
    ({"chunk": 64, "topk": 64}, "topk of 1..chunk - 1"),
    ({"chunk": 64, "topk": 4, "beta": 1.0}, "beta must be in [0, 1)"),
    ({"chunk": 64, "topk": 4, "rank": 2}, "rank must be 1..64 with powersgd"),
])
def test_demo_settings_are_validated(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        GradientSettings(GradAveraging.DEMO, **changes)
    with pytest.raises(ValueError, match="chunk and topk must be 0 unless mode is demo"):
        GradientSettings(GradAveraging.FULL, chunk=64, topk=4)


def test_the_run_setting_s_bounds_and_default_are_the_client_s() -> None:
    """A run's on-chain description bounds DeMo's chunk, and fills a β its state.toml leaves out, as the client does;
    the specification imports no client, so only this test ties them."""
    assert limits.MAX_DEMO_CHUNK == demo.MAX_CHUNK
    assert DEFAULT_DEMO_BETA_PERMILLE / 1000 == GradientSettings().beta


# ----- real averagers -----

@pytest.mark.parametrize("peers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_demo_averages_the_peers_coefficients_at_the_union_of_their_indices(make_grad_averager, peers) -> None:
    """Momentum 0: each peer sends its gradient's DCT coefficients at the union U of the declared top-k positions;
    every peer ends with the sign of the IDCT of their mean at U (alike peers: the robust reduction is the mean),
    the bias averaged in full, and a momentum holding exactly what it did not send."""
    pairs = [alike(seed) for seed in range(1, peers + 1)]
    values = [grads(p) for p in pairs]
    expected, union = demo_average([grads(p) for p in pairs])
    assert TOPK * 24 < union.numel() < CHUNK * 24
    averagers = [make_grad_averager(p, demo_settings(min_group_size=peers)) for p in pairs]
    assert averagers[0].demo_chunks == [24, None]
    results = together(averagers, values, 0, [1.0] * peers)
    assert [(r.status, r.complete, r.group_size) for r in results] == [(AveragingStatus.AVERAGED, True, peers)] * peers
    for value in values:
        assert_close(value, expected)
    for averager, (_, own) in zip(averagers, (p[0] for p in pairs), strict=True):
        coefficients = demo.encode(demo.chunked(own, CHUNK))
        coefficients.reshape(-1)[union] = 0
        torch.testing.assert_close(averager.momenta[0], demo.decode(coefficients), rtol=0, atol=1e-5)


class _MalformedIndices(GradientProcess):
    """A roster member's averaging process that gathers ``malformed`` indices beside its sealed declaration."""

    malformed: Any = None

    async def _step(self, *, step, future_for_init):  # type: ignore[no-untyped-def]
        if self.malformed is None:  # the control: an honest peer
            return await super()._step(step=step, future_for_init=future_for_init)
        bandwidth, mode, user = self.serializer.loads(step.data_for_gather)
        declaration = {**self.serializer.loads(user), "idx": [self.malformed]}
        step._data_for_gather = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(declaration)])
        return await DecentralizedAverager._step(self, step=step, future_for_init=future_for_init)  # not the honest one


@pytest.mark.parametrize("malformed", [
    None,  # the control: it meets the others, so the liars below would too
    list(range(24 * TOPK + 1)),  # too many
    [CHUNK] * (24 * TOPK),  # out of range
    pytest.param([float(i % TOPK) for i in range(24 * TOPK)], marks=pytest.mark.slow),  # not ints
    pytest.param(list(range(TOPK)) * 24, marks=pytest.mark.slow),  # well-formed, but not those its seal covers
])
def test_a_peer_declaring_malformed_indices_is_dropped_and_the_others_average(make_grad_averager, malformed) -> None:
    """Three members, one gathering malformed indices (or others than its seal covers): an honest leader refuses
    it a place, an honest follower of it drops it, so it never shapes the union; the honest two average as if it
    were not there."""
    pairs = [alike(1), alike(2), alike(3)]
    expected, _ = demo_average([grads(p) for p in pairs[:2]])
    averagers = [make_grad_averager(p, demo_settings()) for p in pairs[:2]]
    bad = type(GradientProcess.__name__, (_MalformedIndices,), {"malformed": malformed})  # hivemind's RPC names
    averagers.append(make_grad_averager(pairs[2], demo_settings(),
                                        cls=type("Liar", (GradientAverager,), {"process_class": bad})))
    for index in range(3):  # the liar may lead a group one honest peer joined, leaving that peer alone a round
        values = [grads(p) for p in pairs]
        results = together(averagers, values, index, [1.0, 1.0, 1.0])
        if malformed is None:  # the control: a third peer that declares well-formed indices joins the group
            if [r.group_size for r in results] == [3, 3, 3]:
                return
            continue
        assert all(r.group_size <= 2 for r in results[:2])
        if [(r.status, r.group_size) for r in results[:2]] == [(AveragingStatus.AVERAGED, 2)] * 2:
            for value in values[:2]:
                assert_close(value, expected)
            return
        for averager in averagers[:2]:  # momentum 0 and no complete round: nothing moved
            assert float(averager.momenta[0].abs().sum()) == 0
    pytest.fail("the honest pair never averaged without the liar" if malformed else "the control never met")


class _Saboteur(GradientProcess):
    """Honest in round 0; in round 1 it sends NaN, which its groupmates' reducers refuse."""

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):  # type: ignore[no-untyped-def]
        if self._round.value == 1:
            for tensor in tensors:
                tensor.fill_(float("nan"))
        return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)


_Saboteur.__name__ = GradientProcess.__name__  # hivemind names its RPC handlers after the averager's class


def test_a_round_that_loses_a_peer_leaves_the_momentum_as_it_was(make_grad_averager) -> None:
    """Round 0 completes and moves every momentum; in round 1 a groupmate's parts are refused, so the all-reduce
    ends without it: the honest workers step with a finite partial result, and every one that saw the round
    incomplete keeps exactly its momentum from before round 1."""
    settings = demo_settings(beta=0.9, min_group_size=3)
    pairs = [alike(1), alike(2), alike(3)]
    averagers = [make_grad_averager(p, settings) for p in pairs[:2]]
    averagers.append(make_grad_averager(pairs[2], settings, cls=type("Bad", (GradientAverager,),
                                                                       {"process_class": _Saboteur})))
    results = together(averagers, [grads(p) for p in pairs], 0, [1.0, 1.0, 1.0])
    assert [(r.status, r.complete) for r in results] == [(AveragingStatus.AVERAGED, True)] * 3
    before = [[m.clone() for m in a.momenta] for a in averagers[:2]]
    assert all(float(m.norm()) > 0 for momenta in before for m in momenta)
    values = [grads(p) for p in pairs]
    results = together(averagers, values, 1, [1.0, 1.0, 1.0])
    assert any(not r.complete for r in results[:2])
    for averager, result, value, momenta in zip(averagers[:2], results[:2], values[:2], before, strict=True):
        assert result.status == AveragingStatus.AVERAGED
        assert all(bool(torch.isfinite(t).all()) for t in value)
        if not result.complete:
            assert all(torch.equal(now, old) for now, old in zip(averager.momenta, momenta, strict=True))
