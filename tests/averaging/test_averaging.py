"""SPARTA rounds on real hivemind averagers over loopback: weights, zero-weight groups, partitions, failures."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import pytest
import torch
from solders.keypair import Keypair

from client.averaging.sparta import AveragingStatus
from tests.averagers import FAST, PATIENT, STEADY, average_together


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [("layers.0.fc.weight", torch.randn(16, 8, generator=generator)),
            ("layers.0.fc.bias", torch.randn(16, generator=generator)),
            ("norm.weight", torch.randn(3, generator=generator))]


def values(named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for _, t in named]


def assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-6)


def test_weights_one_and_zero_give_the_weighted_mean(make_averager) -> None:
    peers = [tensors(1), tensors(2)]
    first = values(peers[0])
    averagers = [make_averager(p) for p in peers]
    results = average_together(averagers, 0, [1.0, 0.0])
    assert [r.status for r in results] == [AveragingStatus.AVERAGED] * 2
    assert [(r.group_size, r.total_weight) for r in results] == [(2, 1.0), (2, 1.0)]
    for named in peers:  # the weight-0 peer receives the average and adds nothing to it
        assert_all_close(values(named), first)
    assert results[0].delta_norm == 0.0 and results[1].delta_norm > 0


def test_weights_zero_four_six_zero_give_the_weighted_mean(make_averager) -> None:
    peers = [tensors(i) for i in range(4)]
    weights = [0.0, 0.4, 0.6, 0.0]
    expected = [0.4 * b + 0.6 * c for b, c in zip(values(peers[1]), values(peers[2]), strict=True)]
    averagers = [make_averager(p, settings=dataclasses.replace(STEADY, min_group_size=4)) for p in peers]
    results = average_together(averagers, 0, weights)
    assert {(r.status, r.group_size) for r in results} == {(AveragingStatus.AVERAGED, 4)}
    assert abs(results[0].total_weight - 1.0) < 1e-9
    for named in peers:
        assert_all_close(values(named), expected)


def test_a_group_whose_weights_are_all_zero_is_skipped_without_nan(make_averager) -> None:
    peers = [tensors(1), tensors(2)]
    before = [values(p) for p in peers]
    averagers = [make_averager(p) for p in peers]
    results = average_together(averagers, 0, [0.0, 0.0])
    assert {(r.status, r.reason, r.group_size) for r in results} == {
        (AveragingStatus.SKIPPED, "every weight in the group is 0", 2)}
    for named, old in zip(peers, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(values(named), old, strict=True))  # untouched: no NaN
    # The averagers are fine afterwards: the next round averages normally.
    results = average_together(averagers, 1, [1.0, 1.0])
    assert [r.status for r in results] == [AveragingStatus.AVERAGED] * 2
    assert all(torch.isfinite(t).all() for p in peers for t in values(p))


def test_a_round_averages_exactly_its_partition_and_p_rounds_cover_everything(make_averager) -> None:
    partitions = 4
    peers = [tensors(1), tensors(2)]
    averagers = [make_averager(p, partitions=partitions) for p in peers]
    masks = averagers[0].masks
    for index in range(5, 5 + partitions):  # any P consecutive rounds cover every partition once
        before = [values(p) for p in peers]
        results = average_together(averagers, index, [1.0, 1.0])
        assert [r.status for r in results] == [AveragingStatus.AVERAGED] * 2, results
        assert {r.partition for r in results} == {index % partitions}
        assert results[0].elements == sum(len(i) for i in masks.indices(index % partitions))
        for t, idx in enumerate(masks.indices(index % partitions)):
            inside = torch.zeros(before[0][t].numel(), dtype=torch.bool)
            inside[idx] = True
            mean = (before[0][t].view(-1) + before[1][t].view(-1)) / 2
            for p, old in zip(peers, before, strict=True):
                now = p[t][1].view(-1)
                torch.testing.assert_close(now[inside], mean[inside], rtol=0, atol=1e-6)
                assert torch.equal(now[~inside], old[t].view(-1)[~inside])  # outside the slice: untouched
    assert_all_close(values(peers[0]), values(peers[1]))


def test_a_group_of_every_roster_member_begins_at_once_and_one_short_waits_for_the_rest(make_averager) -> None:
    """Every member of the roster is in the group: no one else may join, so the round begins at once rather than
    after ``min_matchmaking_time``. With a member missing, the others wait it out, then average without it."""
    peers = [tensors(i) for i in (1, 2, 3)]
    averagers = [make_averager(p, settings=PATIENT) for p in peers]
    results = average_together(averagers, 0, [1.0, 1.0, 1.0])
    assert [(r.status, r.group_size) for r in results] == [(AveragingStatus.AVERAGED, 3)] * 3
    assert max(r.seconds for r in results) < PATIENT.min_matchmaking_time / 2, results

    make_averager.members.add(bytes(Keypair().pubkey()))  # type: ignore[attr-defined]  # on the roster, absent
    results = average_together(averagers, 1, [1.0, 1.0, 1.0])
    assert [(r.status, r.group_size) for r in results] == [(AveragingStatus.AVERAGED, 3)] * 3
    assert min(r.seconds for r in results) >= PATIENT.min_matchmaking_time * 0.9, results


def test_an_update_made_during_the_round_is_kept(make_averager) -> None:
    peers = [tensors(1), tensors(2)]
    mean = [(a + b) / 2 for a, b in zip(values(peers[0]), values(peers[1]), strict=True)]
    averagers = [make_averager(p) for p in peers]
    step_taken = threading.Event()

    def optimizer_step_mid_round() -> None:  # what a worker's step() does while the network round runs
        deadline = time.monotonic() + 10
        while averagers[0].round_stage != "LOOKING_FOR_GROUP" and time.monotonic() < deadline:
            time.sleep(0.01)
        with torch.no_grad():
            for _, t in peers[0]:
                t.add_(1.0)
        step_taken.set()

    stepper = threading.Thread(target=optimizer_step_mid_round)
    stepper.start()
    results = average_together(averagers, 0, [1.0, 1.0])
    stepper.join()
    assert step_taken.is_set() and [r.status for r in results] == [AveragingStatus.AVERAGED] * 2
    assert_all_close(values(peers[0]), [m + 1.0 for m in mean])  # the average, plus the step taken meanwhile
    assert_all_close(values(peers[1]), mean)


@pytest.mark.slow
def test_no_group_fails_the_round_without_counting_and_stages_never_mix(make_averager) -> None:
    """Two workers of different stages cannot find each other: each round fails (no group) but blames nobody,
    so the count toward ``remove`` stays 0; a same-stage peer arriving makes the next round succeed."""
    quick = dataclasses.replace(FAST, matchmaking_timeout=1.5, max_failures=2)
    head, body = tensors(1), tensors(2)
    before = [values(head), values(body)]
    averagers = [make_averager(head, stage="head", settings=quick), make_averager(body, settings=quick)]
    for attempt in (1, 2):
        results = [a.average(attempt, 1.0, peers=1) for a in averagers]  # sequential: they must not meet anyway
        assert {(r.status, r.consecutive_failures, r.remove) for r in results} == {(AveragingStatus.FAILED, 0, False)}
        assert all("no group" in r.reason for r in results)
    assert all(torch.equal(a, b) for a, b in zip(values(head), before[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(values(body), before[1], strict=True))

    alone = averagers[1].average(3, 1.0, peers=0)  # nobody else in the stage: skipped at once, not a failure
    assert (alone.status, alone.consecutive_failures, alone.group_size) == (AveragingStatus.SKIPPED, 0, 0)

    other_head = tensors(3)
    expected = [(a + b) / 2 for a, b in zip(values(head), values(other_head), strict=True)]
    pair = [averagers[0], make_averager(other_head, stage="head", settings=quick)]
    results = average_together(pair, 4, [1.0, 1.0])
    assert [(r.status, r.consecutive_failures, r.remove) for r in results] == [
        (AveragingStatus.AVERAGED, 0, False)] * 2
    assert_all_close(values(head), expected)


def test_an_averager_made_off_the_main_thread_works_and_leaves_ctrl_c_alone(make_averager) -> None:
    """The runner builds workers in a thread; hivemind's own start would fail there and ignore SIGINT."""
    handler = signal.getsignal(signal.SIGINT)
    peers = [tensors(1), tensors(2)]
    made: list = []
    maker = threading.Thread(target=lambda: made.append(make_averager(peers[0])))
    maker.start()
    maker.join(timeout=60)
    assert len(made) == 1 and signal.getsignal(signal.SIGINT) is handler
    mean = [(a + b) / 2 for a, b in zip(values(peers[0]), values(peers[1]), strict=True)]
    results = average_together([made[0], make_averager(peers[1])], 0, [1.0, 1.0])
    assert [r.status for r in results] == [AveragingStatus.AVERAGED] * 2
    assert_all_close(values(peers[0]), mean)
    assert signal.getsignal(signal.SIGINT) is handler
