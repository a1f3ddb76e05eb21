"""The min-heap of virtual runtime: least-loaded first, newcomers at the bottom, bans that expire."""

from __future__ import annotations

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
    counts = dict.fromkeys(seconds_per_unit, 0)
    for _ in range(tasks):
        chosen = router.choose(10.0)
        assert chosen is not None
        counts[chosen.uid] += 1
        router.report(chosen.uid, 10.0, 10.0 * seconds_per_unit[chosen.uid])
    return counts


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
