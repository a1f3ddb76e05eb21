"""The min-heap of virtual runtime: least-loaded first, newcomers at the bottom, bans that expire, work charged
rather than waits, and a backward claimed from its forward's worker."""

from __future__ import annotations

import random

import pytest

from client.pipeline.discovery import STATE_UP, WorkerRecord
from client.pipeline.router import StageRouter


def record(uid: str, pubkey: str = "aa") -> WorkerRecord:
    return WorkerRecord(
        run_id="r",
        stage="body1",
        uid=uid,
        address=f"{uid}:1",
        sync_phase=0,
        load=0,
        throughput=0.0,
        model="m",
        pubkey=pubkey,
        expires=0.0,
        state=STATE_UP,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def simulate(router: StageRouter, seconds_per_unit: dict[str, float], tasks: int) -> dict[str, int]:
    """Tasks one after the other, each answered after its worker's compute time."""
    counts = dict.fromkeys(seconds_per_unit, 0)
    now = 0.0
    for _ in range(tasks):
        chosen = router.choose(10.0)
        assert chosen is not None
        counts[chosen.uid] += 1
        sent, now = now, now + 10.0 * seconds_per_unit[chosen.uid]
        router.report(chosen.uid, 10.0, sent, now)
    return counts


def rounds(router: StageRouter, rounds: int, microbatches: int, forward: float, *, jitter: float = 0.0,
           fresh: bool = False) -> list[dict[str, int]]:
    """Rounds of ``microbatches`` sent at once, as a trainer with that many in flight sends them: each forward
    is chosen (charged with its backward too), then claimed back for its backward. Each worker runs its
    forwards, then its backwards (three times as long), one at a time, each task taking up to ``jitter`` (a
    fraction) more or less than its work. With ``fresh`` each round begins as a trainer's does
    (``begin_round``). Returns each round's split."""
    noise = random.Random(7)
    splits = []
    start = 0.0
    for _ in range(rounds):
        if fresh:
            router.begin_round()
        chosen = [router.choose(1.0 + 3.0) for _ in range(microbatches)]
        split = {uid: [r.uid for r in chosen].count(uid) for uid in sorted({r.uid for r in chosen})}
        finished = start
        for uid, count in split.items():
            now = start
            for _ in range(count):
                now += forward * noise.uniform(1 - jitter, 1 + jitter)
                router.report(uid, 1.0, start, now)
            backward_sent = now
            for record in [r for r in chosen if r.uid == uid]:
                assert router.claim(record) == record
                now += 3 * forward * noise.uniform(1 - jitter, 1 + jitter)
                router.report(uid, 3.0, backward_sent, now)
            finished = max(finished, now)
        start = finished
        splits.append(split)
    return splits


def test_faster_worker_gets_proportionally_more_work() -> None:
    router = StageRouter("body1")
    router.update([record("fast"), record("slow")])
    counts = simulate(router, {"fast": 0.001, "slow": 0.004}, 100)
    assert counts["fast"] > 3 * counts["slow"] > 0


def test_newcomer_enters_at_the_bottom_of_the_heap() -> None:
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    simulate(router, {"a": 0.01, "b": 0.01}, 10)
    router.update([record("a"), record("b"), record("new")])
    # With zero runtime the newcomer would take every request; at the bottom it waits its turn.
    first_picks = [router.choose(10.0).uid for _ in range(2)]
    assert "new" not in first_picks


def test_ban_expires_and_a_new_identity_is_unbanned() -> None:
    clock = FakeClock()
    router = StageRouter("body1", ban_seconds=30.0, clock=clock)
    router.update([record("a")])
    router.ban("a")
    assert router.choose(1.0) is None
    assert router.counts() == (1, 1)
    clock.now += 29.0
    assert router.choose(1.0) is None
    clock.now += 2.0
    assert router.choose(1.0).uid == "a"
    router.ban("a")
    router.update([record("a", pubkey="bb")])  # the uid rejoined with another identity
    assert router.choose(1.0).uid == "a"


def test_exclusion_and_departure() -> None:
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    assert router.choose(1.0, exclude={"a"}).uid == "b"
    assert router.choose(1.0, exclude={"a", "b"}) is None
    router.update([record("b")])
    assert {router.choose(1.0).uid for _ in range(5)} == {"b"}


def test_heap_stays_small_over_many_updates() -> None:
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    simulate(router, {"a": 0.001, "b": 0.002}, 1000)
    assert len(router._heap) <= 4 * 2 + 16


def test_tasks_sent_at_once_are_charged_their_work_not_their_wait() -> None:
    """Four tasks sent together to one worker are answered after 1, 2, 3 and 4 s: it worked 4 s, not 10."""
    router = StageRouter("body1", default_throughput=1.0)  # estimates right from the start, for exact figures
    router.update([record("a"), record("b")])
    for _ in range(4):
        router.choose(1.0, exclude={"b"})
    for position in range(1, 5):
        router.report("a", 1.0, 0.0, float(position))
    assert router._workers["a"].vruntime == pytest.approx(4.0)
    assert router._workers["a"].throughput == pytest.approx(1.0)


def test_concurrent_rounds_are_shared_not_taken_in_turns() -> None:
    """Two equal replicas, four microbatches in flight per round, one replica a task ahead at the start: the
    rounds settle to two and two. Charging a backward when it is sent rather than with its forward's choice,
    or charging latencies (which count the wait behind the trainer's own earlier tasks), the replicas take
    whole rounds, or 3 and 1, in turns for ever: each steps on few samples or none every other round."""
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    router.choose(1.0, exclude={"b"})
    router.report("a", 1.0, -0.05, 0.0)
    splits = rounds(router, 30, 4, 0.05)
    assert all(split == {"a": 2, "b": 2} for split in splits[3:]), splits


def test_each_round_is_shared_evenly_however_the_last_one_went() -> None:
    """Two equal replicas whose tasks take 30% more or less than their work: a trainer beginning each round afresh
    deals every round two and two. Carried over from round to round, the runtimes balance the replicas over all
    rounds, so a replica a microbatch ahead gets one fewer next time: here 15 of 100 rounds go three and one.
    A replica stepping on a quarter of the batch steps Adam on a noisier gradient, and SPARTA's replicas end
    further from one process."""
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    splits = rounds(router, 100, 4, 0.05, jitter=0.3, fresh=True)
    assert all(split == {"a": 2, "b": 2} for split in splits[1:]), splits
    carried = StageRouter("body1")
    carried.update([record("a"), record("b")])
    uneven = [s for s in rounds(carried, 100, 4, 0.05, jitter=0.3)[1:] if s != {"a": 2, "b": 2}]
    assert len(uneven) >= 8, "the jitter should unbalance rounds whose runtimes are carried over"


def test_a_faster_replica_still_gets_more_of_each_round() -> None:
    """Afresh each round, work still follows throughput: a replica three times as fast takes three of four."""
    router = StageRouter("body1")
    router.update([record("fast"), record("slow")])
    splits = []
    start = 0.0
    for _ in range(10):
        router.begin_round()
        chosen = [router.choose(4.0).uid for _ in range(4)]
        splits.append(chosen.count("fast"))
        finished = start
        for uid in set(chosen):  # each answers its tasks in turn, the slow one taking three times as long a task
            now = start
            for _ in range(chosen.count(uid)):
                now += 4.0 * (0.003 if uid == "slow" else 0.001)
                router.report(uid, 4.0, start, now)
            finished = max(finished, now)
        start = finished
    assert all(count == 3 for count in splits[2:]), splits


def test_claim_returns_the_same_worker_while_it_is_usable() -> None:
    clock = FakeClock()
    router = StageRouter("body1", clock=clock)
    router.update([record("a"), record("b")])
    chosen = router.choose(4.0)
    runtime = router._workers[chosen.uid].vruntime
    assert router.claim(chosen) == chosen
    assert router._workers[chosen.uid].vruntime == runtime  # charged with the forward's choice
    router.ban(chosen.uid)
    assert router.claim(chosen) is None
    clock.now += router.ban_seconds + 1
    assert router.claim(chosen) == chosen
    other = ({"a", "b"} - {chosen.uid}).pop()
    router.update([record(chosen.uid, pubkey="bb"), record(other)])  # the uid is another identity's now
    assert router.claim(chosen) is None
    router.update([record(other)])
    assert router.claim(record(other)) is not None and router.claim(chosen) is None


def test_an_unmeasured_worker_has_one_task_until_it_answers() -> None:
    """A burst of microbatches while a newcomer is unmeasured: priced at the default throughput it would take
    half of them however slow it is; it takes one, and more only once its answer has priced it."""
    router = StageRouter("body1")
    router.update([record("fast")])
    simulate(router, {"fast": 0.001}, 5)
    router.update([record("fast"), record("new")])
    burst = [router.choose(10.0).uid for _ in range(10)]
    assert burst.count("new") == 1
    router.report("new", 10.0, 0.0, 2.0)  # it is slow: 2 s for what fast does in 0.01 s
    assert [router.choose(10.0).uid for _ in range(10)].count("new") == 0


def test_a_sole_unmeasured_worker_still_gets_every_task() -> None:
    router = StageRouter("body1")
    router.update([record("only")])
    assert [r.uid for r in (router.choose(1.0) for _ in range(3))] == ["only"] * 3


def test_an_answer_removes_what_its_task_was_charged() -> None:
    """Four tasks charged at the default price, the first answered after 1 s: the three still outstanding are
    priced at the measured throughput (1 s each), not cancelled by subtracting the new price from the old
    charge (which left the runtime near zero, below a worker that had done far less)."""
    router = StageRouter("body1", default_throughput=100.0)
    router.update([record("a")])
    for _ in range(4):
        router.choose(1.0)
    router.report("a", 1.0, 0.0, 1.0)
    assert router._workers["a"].vruntime == pytest.approx(4.0)
    for answered in (2.0, 3.0, 4.0):
        router.report("a", 1.0, 0.0, answered)
    assert router._workers["a"].vruntime == pytest.approx(4.0)
    assert router._workers["a"].outstanding == 0.0


def test_a_failed_attempt_releases_its_charge() -> None:
    router = StageRouter("body1", default_throughput=1.0)
    router.update([record("a"), record("b")])
    router.choose(5.0, exclude={"b"})
    router.release("a", 5.0)
    assert router._workers["a"].vruntime == pytest.approx(router._workers["b"].vruntime)
    router.choose(5.0, exclude={"b"})
    router.ban("a")
    assert router._workers["a"].outstanding == 0.0
