"""The min-heap of virtual runtime: least-loaded first, newcomers at the bottom, bans that expire, work charged
rather than waits, and a backward claimed from its forward's worker."""

from __future__ import annotations

import dataclasses
import random

import pytest

from client.pipeline.discovery import STATE_UP, WorkerRecord
from client.pipeline.router import LANE_SLACK, StageFinder, StageRouter


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


def measured(router: StageRouter, seconds: dict[str, float]) -> None:
    """One task answered by each worker, taking ``seconds`` per unit of work: every worker measured."""
    for uid, per_unit in seconds.items():
        router.choose(1.0, exclude=set(seconds) - {uid})
        router.report(uid, 1.0, 0.0, per_unit)


def test_a_microbatch_keeps_its_lane_where_the_runtime_alone_would_alternate() -> None:
    """Two equal replicas, a round whose microbatches came from the stage before as a, a, b, b: each goes to its lane,
    two and two. Without a lane the runtime alone alternates them, so two of the four cross to the other chain."""
    lanes, alone = StageRouter("body1"), StageRouter("body1")
    for router in (lanes, alone):
        router.update([record("a"), record("b")])
        measured(router, {"a": 0.01, "b": 0.01})
        router.begin_round()
    assert [lanes.choose(4.0, prefer=uid).uid for uid in "aabb"] == list("aabb")
    assert [alone.choose(4.0).uid for _ in range(4)] in (list("abab"), list("baba"))


def test_a_lane_gives_way_once_its_worker_is_dealt_more_than_the_slack_beyond_the_others() -> None:
    """Every microbatch arriving in lane a (an uneven stage before): a takes ``LANE_SLACK`` + 1, then one goes to b,
    and a never gets more than that beyond b's share."""
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    measured(router, {"a": 0.01, "b": 0.01})
    router.begin_round()
    chosen = [router.choose(4.0, prefer="a").uid for _ in range(8)]
    assert chosen[:LANE_SLACK + 2] == ["a"] * (LANE_SLACK + 1) + ["b"]
    for n in range(1, 9):
        assert chosen[:n].count("a") - chosen[:n].count("b") <= LANE_SLACK + 1, chosen


@pytest.mark.parametrize(("speed", "kept"), [(0.6, True), (0.4, False)])
def test_a_lane_whose_worker_is_measured_slow_gives_way(speed: float, kept: bool) -> None:
    """A lane's worker at 0.6 of its peer's throughput keeps the lane (``LANE_SPEED``: equal replicas on a loaded
    machine measure up to twice apart); at 0.4 of it, the work goes by runtime."""
    router = StageRouter("body1")
    router.update([record("a"), record("b")])
    measured(router, {"a": 0.01 / speed, "b": 0.01})
    router.begin_round()
    router.choose(4.0, exclude={"a"})
    router.choose(4.0, exclude={"b"})  # one task each, a's priced at its lower throughput: b is the least-loaded
    assert (router.choose(4.0, prefer="a").uid == "a") is kept


def test_a_banned_or_excluded_lane_is_not_taken() -> None:
    clock = FakeClock()
    router = StageRouter("body1", clock=clock)
    router.update([record("a"), record("b")])
    measured(router, {"a": 0.01, "b": 0.01})
    assert router.choose(4.0, exclude={"a"}, prefer="a").uid == "b"
    router.ban("a")
    assert router.choose(4.0, prefer="a").uid == "b"
    clock.now += router.ban_seconds + 1
    assert router.choose(4.0, prefer="a").uid == "a"


class Directory:
    """Two workers in each of three stages, as the DHT's directory would announce them."""

    stages = ("head", "body1", "tail")

    def workers(self, stage: str) -> list[WorkerRecord]:
        return [dataclasses.replace(record(f"{stage}.{i}"), stage=stage) for i in range(2)]


def pipeline_rounds(finder: StageFinder, rounds: int, *, lanes: bool) -> list[list[tuple[str, ...]]]:
    """Rounds of four microbatches in flight through three stages, their steps taken in a random order, each task
    taking 30% more or less than its work: each round's microbatches' workers, stage by stage. Without ``lanes`` each
    stage is dealt by runtime alone."""
    noise = random.Random(11)
    busy: dict[str, float] = {}
    now = 0.0
    dealt = []
    for _ in range(rounds):
        for router in finder.routers.values():
            router.begin_round()
        paths: list[list[WorkerRecord]] = [[] for _ in range(4)]
        while any(len(path) < len(Directory.stages) for path in paths):
            path = noise.choice([p for p in paths if len(p) < len(Directory.stages)])
            stage = Directory.stages[len(path)]
            chosen = finder.pick(stage, 4.0, set(), path[-1] if path and lanes else None)
            busy[chosen.uid] = max(busy.get(chosen.uid, now), now) + 0.04 * noise.uniform(0.7, 1.3)
            finder.routers[stage].report(chosen.uid, 4.0, now, busy[chosen.uid])
            path.append(chosen)
        now = max(busy.values())
        dealt.append([tuple(r.uid for r in path) for path in paths])
    return dealt


def test_every_microbatch_keeps_its_lane_and_every_stage_is_dealt_evenly() -> None:
    """Three stages of two equal replicas, four microbatches a round whose steps interleave at random: with lanes every
    microbatch stays on the i-th worker of every stage and every stage is dealt two and two; dealt by runtime alone,
    each stage is still even, but microbatches cross from one chain to another."""
    kept = pipeline_rounds(StageFinder(Directory(), Directory.stages), 100, lanes=True)[1:]
    for paths in kept:
        assert all(len({uid[-1] for uid in path}) == 1 for path in paths), paths
        for position in range(3):
            assert sorted(path[position][-1] for path in paths) == ["0", "0", "1", "1"], paths
    crossed = pipeline_rounds(StageFinder(Directory(), Directory.stages), 100, lanes=False)[1:]
    crossings = sum(len({uid[-1] for uid in path}) > 1 for paths in crossed for path in paths)
    assert crossings >= 100, f"dealt by runtime alone, {crossings} of 396 microbatches crossed"
