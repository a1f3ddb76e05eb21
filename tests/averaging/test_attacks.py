"""Attacks on a stage's averaging, performed against real hivemind averagers over loopback (issue 20).

- a stranger (not on the stage's roster, with a key and a roster of its own that lists it) joins the SPARTA
  group with a chosen value and a weight of 1e30: it is refused and the honest members average among
  themselves;
- a stranger replays a member's sealed declaration: refused (the seal covers the member's peer id), and the
  member keeps its seat; a member running two peers under its one key holds one seat at most;
- a member declares another round, or a weight of -1: it is dropped from the round, the others average, and
  nobody is counted a failure (on the old code the whole group failed and honest workers were withdrawn);
- a member gathers a hivemind header (bandwidth, mode) that hivemind cannot take: it is dropped, and no
  honest round fails for it (on the old code every group it joined failed its all-reduce);
- a member overwrites with a chosen value and a weight of 1e30: the robust reduction keeps the honest result
  within the bound ``client.averaging.robust`` documents;
- a member that claims the round's whole batch sends -60x the honest gradient (its norm declared truthfully):
  the applied gradient still points with the honest mean; claiming more than the round's batch, it is dropped
  and adds nothing to it;
- in a SPARTA pair (where the robust reduction trusts both members) a member claims a weight of 1e30, or
  declares an honest weight and sends its parts with 1e30: the claim is refused above ``max_weight``, the
  parts for carrying another weight than declared, and the honest worker keeps its own parameters (on the
  old code they became the attacker's);
- a gradient groupmate whose contribution every reducer refuses (a norm out of line, or parts above the norm
  it declared) adds nothing to the samples the round reports (on the old code they counted its claim);
- a reducer returns an impossibly large part: only its shard keeps the local values, the rest of the tensor
  is averaged (on the old code every tensor it touched was reset to the local values).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import typing
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from solders.keypair import Keypair

from client.averaging.gradients import GradAveraging, GradientAverager, GradientProcess, GradientSettings
from client.averaging.membership import Membership, Roster, seal
from client.averaging.robust import KAPPA
from client.averaging.rounds import run_round
from client.averaging.sparta import AveragingStatus, SpartaAverager
from tests.averagers import FAST, PATIENT, average_together

TRIO = dataclasses.replace(FAST, min_group_size=3)  # the round waits for every peer the test starts


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [("layers.0.fc.weight", torch.randn(16, 8, generator=generator)),
            ("layers.0.fc.bias", torch.randn(16, generator=generator))]


def flat(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for _, t in named])


def mean(vectors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(vectors).mean(0)


def test_a_stranger_cannot_join_a_stage_s_averaging_or_move_it(make_averager) -> None:
    honest = [tensors(i) for i in range(3)]
    poison = [(name, torch.full_like(t, 7.0)) for name, t in tensors(9)]
    averagers = [make_averager(p, settings=TRIO) for p in honest]
    members = make_averager.members  # type: ignore[attr-defined]
    key = Keypair()  # the stranger believes it belongs: its own roster lists it
    stranger = make_averager(poison, keypair=key, enrol=False, settings=TRIO,
                             roster=lambda: Roster(0, frozenset(members) | {bytes(key.pubkey())}))
    for index in (0, 1):
        expected = mean([flat(p) for p in honest])
        results = average_together([*averagers, stranger], index, [1.0, 1.0, 1.0, 1e30])
        assert [(r.status, r.group_size) for r in results[:3]] == [(AveragingStatus.AVERAGED, 3)] * 3
        for named in honest:
            torch.testing.assert_close(flat(named), expected, rtol=0, atol=1e-5)
            assert not bool((flat(named) - 7.0).abs().lt(1e-3).any())
        assert all(r.consecutive_failures == 0 for r in results[:3])


@pytest.mark.slow
def test_a_member_s_declaration_replayed_by_a_stranger_is_refused(make_averager) -> None:
    """A stranger gathers a member's own sealed declaration (that member's round and weight, its seal over the
    member's peer id) and sends 7.0 everywhere: the seal does not hold for the stranger's peer id, so it is
    refused, and the member it copied keeps its seat (the key is not counted as declared twice)."""
    honest = [tensors(i) for i in range(3)]
    victim_key = Keypair()
    averagers = [make_averager(honest[0], keypair=victim_key, settings=TRIO),
                 *(make_averager(p, settings=TRIO) for p in honest[1:])]
    members = make_averager.members  # type: ignore[attr-defined]
    victim = averagers[0].averager
    stranger = make_averager([(name, torch.full_like(t, 7.0)) for name, t in tensors(9)], enrol=False,
                             settings=TRIO, roster=lambda: Roster(0, frozenset(members)))
    declare = stranger.averager.prepare_round

    def replay(index: int, declaration: dict[str, Any]) -> dict[str, Any]:
        declare(index, declaration)  # hands its process the roster and the round, as an honest peer's does
        return seal(Membership(victim_key, lambda: Roster(0, frozenset(members))), victim.prefix,
                    victim.peer_id.to_bytes(), 0, {"round": index, "weight": 1.0})

    stranger.averager.prepare_round = replay  # type: ignore[method-assign]
    expected = mean([flat(p) for p in honest])
    results = average_together([*averagers, stranger], 0, [1.0, 1.0, 1.0, 1.0])
    assert [(r.status, r.group_size) for r in results[:3]] == [(AveragingStatus.AVERAGED, 3)] * 3
    for named in honest:
        torch.testing.assert_close(flat(named), expected, rtol=0, atol=1e-5)


def test_a_member_running_two_peers_under_one_key_holds_one_seat_at_most(make_averager) -> None:
    """A member runs two averagers with its one key, both sending 7.0, to double its say. A leader begins as soon
    as every roster member holds a seat, a key counted once, so the twins cannot start a round without both honest
    workers; a key declared by two peers of a group seats neither. Either way the key holds one seat at most: the
    honest results stay within the bound of one member's overwrite (above), and no honest round fails for it."""
    honest = [tensors(1), tensors(2)]
    averagers = [make_averager(p) for p in honest]
    twin_key = Keypair()
    poison = [(name, torch.full_like(t, 7.0)) for name, t in tensors(3)]
    twins = [make_averager([(name, t.clone()) for name, t in poison], keypair=twin_key) for _ in range(2)]
    together = 0
    for index in range(3):
        inputs = [flat(p) for p in [*honest, poison]]
        centre = torch.stack(inputs).median(0).values
        bound = KAPPA * math.sqrt(sum(float((x - centre).square().sum()) for x in inputs[:2]))
        results = average_together([*averagers, *twins], index, [1.0] * 4)
        assert all(r.group_size <= 3 and r.consecutive_failures == 0 for r in results[:2]), results[:2]
        if all(r.status == AveragingStatus.AVERAGED for r in results[:2]):
            together += 1
            for named in honest:
                assert float((flat(named) - centre).norm()) <= bound * (1 + 1e-5)
        for twin in twins:  # every round from 7.0 again
            for t in twin.parameters:
                t.data.fill_(7.0)
    assert together >= 1


def test_a_member_running_two_peers_cannot_start_a_round_without_an_honest_member(make_averager) -> None:
    """The roster lists two honest workers and the twins' key; one honest worker is away. The twins and the other
    honest worker are three peers for three members, but two keys: the round waits out ``min_matchmaking_time``
    for the missing member instead of beginning at once without it."""
    honest = make_averager(tensors(1), settings=PATIENT)
    make_averager.members.add(bytes(Keypair().pubkey()))  # type: ignore[attr-defined]  # the honest worker away
    twin_key = Keypair()
    twins = [make_averager([(name, torch.full_like(t, 7.0)) for name, t in tensors(3)], keypair=twin_key,
                           settings=PATIENT) for _ in range(2)]
    results = average_together([honest, *twins], 0, [1.0] * 3)
    assert results[0].seconds >= 0.9 * PATIENT.min_matchmaking_time, results[0]
    assert results[0].consecutive_failures == 0


class _OtherRound(SpartaAverager):
    """A member that declares the round after the one it averages in."""

    def _step(self, averaging_index: int, weight: float) -> tuple[dict[Any, dict[str, Any]], str | None]:
        s = self.settings
        return run_round(self._averager, self._pipe, averaging_index, self.declaration(averaging_index, weight),
                         weight, matchmaking_timeout=s.matchmaking_timeout, allreduce_timeout=s.allreduce_timeout)

    def declaration(self, averaging_index: int, weight: float) -> dict[str, Any]:
        return {"round": averaging_index + 1, "weight": weight}


class _NegativeWeight(_OtherRound):
    def declaration(self, averaging_index: int, weight: float) -> dict[str, Any]:
        return {"round": averaging_index, "weight": -1.0}


@pytest.mark.slow
@pytest.mark.parametrize("malformed", [_OtherRound, _NegativeWeight])
def test_a_malformed_groupmate_is_dropped_and_nobody_honest_is_withdrawn(make_averager, malformed) -> None:
    """Three rounds in a row (``max_failures`` of the default settings): the malformed member never enters an
    honest average — an honest leader refuses it, and a group it leads drops it — and no honest worker ever
    counts a failure. (When it leads a group that only one honest worker joined, that worker finds no
    admitted groupmate and skips the round; the other finds no group: neither is anyone's fault.)"""
    honest = [tensors(1), tensors(2)]
    averagers = [make_averager(p) for p in honest]
    averagers.append(make_averager(tensors(3), cls=malformed))
    together = 0
    for index in range(3):
        before = [flat(p) for p in honest]
        results = average_together(averagers, index, [1.0, 1.0, 1.0])
        for result in results[:2]:
            assert (result.consecutive_failures, result.remove) == (0, False)
            assert result.refused <= 1 and result.group_size <= 2
        if all(r.status == AveragingStatus.AVERAGED for r in results[:2]):
            together += 1
            for named in honest:
                torch.testing.assert_close(flat(named), mean(before), rtol=0, atol=1e-5)
        else:
            assert all(torch.equal(flat(p), b) for p, b in zip(honest, before, strict=True))
    assert together >= 1


class _Header:
    """Stands for hivemind's ``AveragingMode`` in a liar's own process: what its gathered header declares."""

    def __init__(self, value: object) -> None:
        self.value = value


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("mode", _Header(7)), ("bandwidth", "fast")])
def test_a_member_s_malformed_hivemind_header_fails_no_honest_round(make_averager, field, value) -> None:
    """A member seals a valid declaration but gathers a hivemind header (bandwidth, mode) that hivemind's load
    balancing cannot take. On the old code every group it was admitted to failed its all-reduce for everyone
    ("all-reduce failed"), round after round; now it is dropped like any malformed groupmate."""
    honest = [tensors(1), tensors(2)]
    averagers = [make_averager(p) for p in honest]
    liar = make_averager(tensors(3))
    setattr(liar.averager, field, value)  # host side: hivemind serialises the header there, at each step
    together = 0
    for index in range(3):
        before = [flat(p) for p in honest]
        results = average_together([*averagers, liar], index, [1.0, 1.0, 1.0])
        for result in results[:2]:
            assert "all-reduce failed" not in result.reason, result.reason
            assert result.consecutive_failures == 0
        if all(r.status == AveragingStatus.AVERAGED for r in results[:2]):
            together += 1
            for named in honest:
                torch.testing.assert_close(flat(named), mean(before), rtol=0, atol=1e-5)
    assert together >= 1


def test_a_member_s_overwrite_stays_within_the_documented_bound(make_averager) -> None:
    """A member sends 7.0 everywhere with a weight of 1e30. The mean would hand every honest worker 7.0; the
    robust reduction keeps each honest result r within κ·(the honest parts' distances from the coordinate
    median m) of m, with every weight capped at the middle one."""
    honest = [tensors(1), tensors(2)]
    poison = [(name, torch.full_like(t, 7.0)) for name, t in tensors(3)]
    averagers = [make_averager(p, settings=TRIO) for p in [*honest, poison]]
    inputs = [flat(p) for p in [*honest, poison]]
    centre = torch.stack(inputs).median(0).values
    bound = KAPPA * math.sqrt(sum(float((x - centre).square().sum()) for x in inputs[:2]))
    results = average_together(averagers, 0, [1.0, 1.0, 1e30])
    honest_mean = mean(inputs[:2])
    for named, result in zip(honest, results[:2], strict=True):
        assert result.status == AveragingStatus.AVERAGED
        now = flat(named)
        assert float((now - centre).norm()) <= bound * (1 + 1e-5)
        # far nearer the honest mean than the attacker's value, which the old mean gave
        assert float((now - honest_mean).norm()) < 0.25 * float((inputs[2] - honest_mean).norm())


class _Overclaim(SpartaAverager):
    """A member that declares ``declared`` and sends its parts with weight 1e30."""

    declared = 1e30

    def _step(self, averaging_index: int, weight: float) -> tuple[dict[Any, dict[str, Any]], str | None]:
        s = self.settings
        return run_round(self._averager, self._pipe, averaging_index,
                         {"round": averaging_index, "weight": self.declared}, 1e30,
                         matchmaking_timeout=s.matchmaking_timeout, allreduce_timeout=s.allreduce_timeout)


@pytest.mark.parametrize("declared", [pytest.param(1e30, marks=pytest.mark.slow), 4.0], ids=["claimed", "sent"])
def test_a_member_cannot_outweigh_its_partner_in_a_sparta_pair(make_averager, declared) -> None:
    """A stage of two: an honest worker (weight 4, ``max_weight`` 16: what a worker can process between two
    rounds) and a member sending 7.0 everywhere with weight 1e30, declared as such or under an honest 4. The
    robust reduction trusts both members of a pair, so on the old code the honest parameters became 7.0 in one
    round; now the claim is refused before the all-reduce, and parts sent with another weight than declared
    are refused by the reducer, so the honest worker keeps its own values and counts no failure. (The member
    declares bandwidth 0 so that the honest worker reduces every part: what a liar returns for a part it
    reduces is the unverified-reducer limitation.)"""
    honest = tensors(1)
    before = flat(honest)
    averager = make_averager(honest, max_weight=16.0)
    liar = make_averager([(name, torch.full_like(t, 7.0)) for name, t in tensors(2)], max_weight=16.0,
                         cls=type("_Overclaim", (_Overclaim,), {"declared": declared}))
    liar.averager.bandwidth = 0.0  # hivemind gathers it with each step, from the host
    met = 0
    for index in range(2):
        result = average_together([averager, liar], index, [4.0, 4.0])[0]
        assert result.consecutive_failures == 0
        met += result.group_size == 2
        torch.testing.assert_close(flat(honest), before, rtol=0, atol=1e-6)
    # The parts' liar is admitted, so the pair meets; the claim's is refused before the group forms whenever
    # the honest worker leads, so it may never meet (on the old code it always did, and won).
    assert met >= 1 or declared > 16


class _Reverser(GradientAverager):
    """A member that trained nothing, claims the round's whole batch and sends -60x the honest mean gradient,
    declaring that contribution's norm truthfully."""

    honest_mean: list[torch.Tensor] = []

    def _load(self, grads, index, weight, work=()):  # type: ignore[no-untyped-def]
        return super()._load([-60.0 * g for g in self.honest_mean], index, weight)  # it did no work


def gradient_pairs(seed: int, shared: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """A worker's gradient: the stage's common direction plus this worker's minibatch noise."""
    generator = torch.Generator().manual_seed(seed)
    return [(name, s + 0.5 * torch.randn(s.shape, generator=generator))
            for name, s in zip(("layers.0.fc.weight", "layers.0.fc.bias"), shared, strict=True)]


def shared_gradient(rows: int = 24, cols: int = 32) -> list[torch.Tensor]:
    """The stage's common gradient direction, for a weight of (rows, cols) and a bias of rows."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(rows, cols, generator=generator), torch.randn(rows, generator=generator)]


def gradient_round(averagers: list[GradientAverager], values: list[list[torch.Tensor]],
                   weights: list[float], work: list[list[Any]] | None = None) -> list[Any]:
    """One gradient round (round 0) run by every averager at once, in place in ``values``, each proving its
    weight with ``work`` (signed Backward headers) if given; their results."""
    results: list[Any] = [None] * len(averagers)

    def run(i: int) -> None:
        results[i] = averagers[i].average(values[i], int(weights[i]), 0, weights[i],
                                          work=work[i] if work is not None else ())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def reverser_round(make_grad_averager, settings: GradientSettings, liar_weight: float, *,
                   liar_reduces: bool = True, attacker: type[_Reverser] | None = None,
                   work: list[list[Any]] | None = None, keys: Sequence[Keypair | None] = (None, None, None),
                   ) -> tuple[list[list[torch.Tensor]], list[Any], torch.Tensor]:
    """One gradient round of two honest workers (4 samples each) and a ``_Reverser`` (or ``attacker``) claiming
    ``liar_weight`` (declaring bandwidth 0 unless ``liar_reduces``, so that the honest workers reduce every
    part), each proving its weight with ``work`` if given and keyed with ``keys`` (None: a fresh key): the
    honest workers' gradients after it, their results, and the honest mean (flat)."""
    shared = shared_gradient()
    honest = [gradient_pairs(1, shared), gradient_pairs(2, shared)]
    honest_mean = [(a + b) / 2 for (_, a), (_, b) in zip(*honest, strict=True)]
    liar = type("GradientAverager", (attacker or _Reverser,), {"honest_mean": honest_mean})
    averagers = [make_grad_averager(p, settings, keypair=key) for p, key in zip(honest, keys[:2], strict=True)]
    averagers.append(make_grad_averager(gradient_pairs(3, shared), settings, cls=liar, keypair=keys[2]))
    if not liar_reduces:
        averagers[2].process.bandwidth = 0.0  # hivemind gathers it with each step, from the host
    values = [[t.clone() for _, t in p] for p in [*honest, gradient_pairs(3, shared)]]
    results = gradient_round(averagers, values, [4.0, 4.0, liar_weight], work)
    return values[:2], results[:2], torch.cat([t.flatten() for t in honest_mean])


@pytest.mark.parametrize("mode", ["full", "powersgd"])
def test_a_member_cannot_reverse_the_stage_s_gradient(make_grad_averager, mode) -> None:
    settings = GradientSettings(GradAveraging.FULL if mode == "full" else GradAveraging.POWERSGD,
                                rank=0 if mode == "full" else 4, timeouts=TRIO, max_weight=16.0)
    values, results, target = reverser_round(make_grad_averager, settings, 16.0)
    for value, result in zip(values, results, strict=True):
        assert result is not None and result.status == AveragingStatus.AVERAGED
        applied = torch.cat([t.flatten() for t in value])
        cosine = float(torch.nn.functional.cosine_similarity(applied, target, dim=0))
        assert cosine > 0.5, cosine


def test_a_member_claiming_more_than_the_round_s_batch_adds_nothing(make_grad_averager) -> None:
    """The reverser claims 1e6 samples, over ``max_weight`` (the round's global batch): it is dropped before the
    all-reduce (by an honest leader, or by both honest workers from the group it leads), so the honest workers
    get exactly their own mean (the old code admitted it: the robust reduction of three parts, near the honest
    mean but not equal to it), stand for their own 8 samples (not 1e6 + 8), and their round is complete.
    (Groups of two may form: an honest leader refuses the reverser before the group forms.)"""
    settings = GradientSettings(GradAveraging.FULL, timeouts=FAST, max_weight=16.0)
    values, results, target = reverser_round(make_grad_averager, settings, 1e6)
    averaged = 0
    for value, result in zip(values, results, strict=True):
        assert result is not None and result.refused <= 1 and result.consecutive_failures == 0
        if result.status == AveragingStatus.AVERAGED:
            averaged += 1
            assert (result.group_size, result.samples, result.complete) == (2, 8, True)
            torch.testing.assert_close(torch.cat([t.flatten() for t in value]), target, rtol=0, atol=1e-5)
    assert averaged >= 1


class _Understater(_Reverser):
    """The reverser declaring a hundredth of its contribution's norm: every part it sends is above it."""

    def _load(self, grads, index, weight, work=()):  # type: ignore[no-untyped-def]
        gather = super()._load(grads, index, weight)
        return {**gather, "norm": gather["norm"] / 100}


@pytest.mark.parametrize("attacker", [_Reverser, _Understater], ids=["out of line", "understated"])
def test_a_refused_groupmate_s_samples_are_not_counted(make_grad_averager, attacker) -> None:
    """A member with an honest weight (4 samples) whose contribution every honest reducer refuses — its declared
    norm is 60x the group's (above ``factor`` = 10 times the lower median), or its parts exceed the norm it
    declared — adds nothing to the gradient, so the samples the result stands for are the honest workers' 8,
    not 12 (the old code counted every admitted declaration)."""
    settings = GradientSettings(GradAveraging.FULL, timeouts=TRIO, max_weight=16.0, factor=10.0)
    values, results, target = reverser_round(make_grad_averager, settings, 4.0, liar_reduces=False,
                                             attacker=attacker)
    for value, result in zip(values, results, strict=True):
        assert result is not None and result.status == AveragingStatus.AVERAGED
        assert (result.group_size, result.samples) == (3, 8)
        torch.testing.assert_close(torch.cat([t.flatten() for t in value]), target, rtol=0, atol=1e-5)


class _HugeResults(GradientProcess):
    """A reducer that returns every averaged part with 1e6 added to each element."""

    async def rpc_aggregate_part(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(stream, context):
            if message.code == averaging_pb2.AVERAGED_PART:
                delta = deserialize_torch_tensor(message.tensor_part) + 1e6
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                                      tensor_part=serialize_torch_tensor(delta))
            yield message


def test_a_reducer_s_impossible_part_costs_only_its_own_shard(make_grad_averager) -> None:
    """Three workers, each reducing a third of a 768 x 512 weight (three of hivemind's 512 KiB parts); the third
    returns its shard with 1e6 added. The honest workers keep their local values on that shard only and share
    the honest reducers' averages on the rest, about two thirds; the old code reset the whole weight, which the
    liar's shard touched, to the local values, so they agreed on at most the 768 bias elements."""
    settings = GradientSettings(GradAveraging.FULL, timeouts=TRIO, max_weight=16.0)
    shared = shared_gradient(768, 512)
    pairs = [gradient_pairs(i, shared) for i in (1, 2, 3)]
    # hivemind names a peer's handlers after its class: the liar's must be called what an honest peer's is
    process = type("GradientProcess", (_HugeResults,), {})
    liar = type("GradientAverager", (GradientAverager,), {"process_class": process})
    averagers = [make_grad_averager(pairs[0], settings), make_grad_averager(pairs[1], settings),
                 make_grad_averager(pairs[2], settings, cls=liar)]
    values = [[t.clone() for _, t in p] for p in pairs]
    results = gradient_round(averagers, values, [4.0, 4.0, 4.0])
    assert all(r is not None and r.status == AveragingStatus.AVERAGED and not r.complete for r in results[:2])
    (a, b), (local_a, local_b) = ([torch.cat([t.flatten() for t in v]) for v in vs]
                                  for vs in (values[:2], [[t for _, t in p] for p in pairs[:2]]))
    averaged = a != local_a  # elsewhere each keeps exactly its local value
    assert torch.equal(averaged, b != local_b)
    assert 0.5 <= float(averaged.double().mean()) <= 0.8, float(averaged.double().mean())
    assert float((a[averaged] - b[averaged]).abs().max()) < 1e-4  # the same honest reducers' averages
    assert float(a.abs().max()) < 100
