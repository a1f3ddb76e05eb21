"""Faults mid all-reduce: a peer killed or stalled after its group formed is dropped for the round; the
others keep a partial result in which every element is either the reference average or the local value,
and the next round runs normally (no retry, training goes on).

The victim is made to stall deterministically: the test holds its averager's tensor lock, which hivemind's
averaging process needs to start the all-reduce. The group forms, the victim's process blocks inside the
round, and the others' sender and reducer timeouts drop it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from client.averaging.sparta import AveragingResult, AveragingStatus, SpartaAverager
from tests.averagers import FAST, average_together


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """Six equal tensors: hivemind gives each of the three reducers whole tensors, so the victim owns some."""
    generator = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.weight", torch.randn(10, 10, generator=generator)) for i in range(6)]


def values(named: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for _, t in named]


def wait_for(predicate, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def start_round(averager: SpartaAverager, index: int, weight: float, into: dict[int, AveragingResult],
                key: int) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.__setitem__(key, averager.average(index, weight)), daemon=True)
    thread.start()
    return thread


def classify(now: list[torch.Tensor], reference: list[torch.Tensor], local: list[torch.Tensor]) -> tuple[int, int]:
    """(elements equal to the reference average, elements equal to the local value); asserts there is no other."""
    averaged = kept = 0
    for n, r, old in zip(now, reference, local, strict=True):
        is_reference = (n - r).abs() <= 1e-6
        is_local = n == old
        assert bool((is_reference | is_local).all()), "an element is neither the average nor the local value"
        averaged += int((is_reference & ~is_local).sum())
        kept += int((is_local & ~is_reference).sum())
    return averaged, kept


def stall_victim(averagers: list[SpartaAverager], weights: list[float], *, kill: bool,
                 stall: float = 0.0) -> dict[int, AveragingResult]:
    """Run round 0 on every averager, the last one (the victim) stalled inside its all-reduce; with ``kill``
    its averaging process is then SIGKILLed there, otherwise it is released after ``stall`` seconds."""
    victim = averagers[-1]
    results: dict[int, AveragingResult] = {}
    threads = [start_round(victim, 0, weights[-1], results, len(averagers) - 1)]
    wait_for(lambda: victim.round_stage == "LOOKING_FOR_GROUP", "the victim to look for a group")
    lock = victim.averager.lock_averaged_tensors
    assert lock.acquire(timeout=5)
    try:
        threads += [start_round(averagers[i], 0, weights[i], results, i) for i in range(len(averagers) - 1)]
        wait_for(lambda: victim.round_stage == "RUNNING_ALLREDUCE", "the group to form")
        if kill:
            os.kill(victim.averager.pid, signal.SIGKILL)
        else:
            time.sleep(stall)
    finally:
        lock.release()
    for thread in threads:
        thread.join(timeout=30)
    assert len(results) == len(averagers), "a round did not return"
    return results


def test_a_peer_killed_mid_allreduce_is_dropped_and_the_others_keep_partial_results(make_averager) -> None:
    peers = [tensors(1), tensors(2), tensors(3)]
    weights = [1.0, 0.5, 1.0]
    local = [values(p) for p in peers]
    reference = [(1.0 * a + 0.5 * b) / 1.5 for a, b in zip(local[0], local[1], strict=True)]  # the survivors
    averagers = [make_averager(p, settings=FAST) for p in peers]

    results = stall_victim(averagers, weights, kill=True)

    assert [results[i].status for i in (0, 1)] == [AveragingStatus.AVERAGED] * 2
    assert all(results[i].reason.startswith("partial:") for i in (0, 1)), [results[i].reason for i in (0, 1)]
    assert all(results[i].group_size == 3 for i in (0, 1))  # the victim was in the group when it died
    for i in (0, 1):
        averaged, kept = classify(values(peers[i]), reference, local[i])
        assert averaged > 0 and kept > 0, "expected the victim's shard local and the rest averaged"
    victim = results[2]
    assert (victim.status, victim.reason) == (AveragingStatus.FAILED, "the averaging process died")
    assert victim.seconds < 10 and all(torch.equal(a, b) for a, b in zip(values(peers[2]), local[2], strict=True))

    # No retry, no lingering state: the survivors' next round is a normal one.
    before = [values(peers[0]), values(peers[1])]
    again = average_together(averagers[:2], 1, [1.0, 1.0])
    assert [(r.status, r.reason) for r in again] == [(AveragingStatus.AVERAGED, "")] * 2
    for p in peers[:2]:
        for now, a, b in zip(values(p), before[0], before[1], strict=True):
            torch.testing.assert_close(now, (a + b) / 2, rtol=0, atol=1e-6)
    # The victim, whose averaging process is gone, fails fast from now on and is told to withdraw.
    outcomes = [averagers[2].average(i, 1.0) for i in (2, 3)]
    assert [(o.status, o.remove) for o in outcomes] == [(AveragingStatus.FAILED, False), (AveragingStatus.FAILED, True)]


@pytest.mark.slow
def test_a_stalled_peer_is_dropped_and_everyone_recovers_next_round(make_averager) -> None:
    peers = [tensors(4), tensors(5), tensors(6)]
    local = [values(p) for p in peers]
    survivors_mean = [(a + b) / 2 for a, b in zip(local[0], local[1], strict=True)]
    averagers = [make_averager(p, settings=FAST) for p in peers]

    started = time.monotonic()
    results = stall_victim(averagers, [1.0, 1.0, 1.0], kill=False, stall=4.0)  # over the reducer timeout

    assert [results[i].status for i in (0, 1)] == [AveragingStatus.AVERAGED] * 2
    for i in (0, 1):
        averaged, kept = classify(values(peers[i]), survivors_mean, local[i])
        assert averaged > 0 and kept > 0
    # The stalled peer got nothing from the others' finished round; whatever it ended with is finite and, per
    # element, its own value or an average that includes it.
    everyone_mean = [(a + b + c) / 3 for a, b, c in zip(*local, strict=True)]
    for now, old, m3, m2 in zip(values(peers[2]), local[2], everyone_mean, survivors_mean, strict=True):
        assert bool(((now == old) | ((now - m3).abs() <= 1e-6) | ((now - m2).abs() <= 1e-6)).all())
    assert time.monotonic() - started < 30

    # The next round is a normal one and brings the three back to one state. Not to their mean: where the two
    # survivors now hold the same values and the third does not, the robust reduction (client.averaging.robust)
    # takes the two for a majority, as it would a liar; every element stays within what the three held.
    before = [values(p) for p in peers]
    again = average_together(averagers, 1, [1.0, 1.0, 1.0])
    assert [r.status for r in again] == [AveragingStatus.AVERAGED] * 3
    for now, other, a, b, c in zip(values(peers[0]), values(peers[2]), *before, strict=True):
        torch.testing.assert_close(now, other, rtol=0, atol=1e-6)
        low, high = torch.minimum(torch.minimum(a, b), c), torch.maximum(torch.maximum(a, b), c)
        assert bool(((now >= low - 1e-6) & (now <= high + 1e-6)).all())
