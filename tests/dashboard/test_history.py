"""The dashboard's history of rounds, read back from the trainers' signed commitments on a real loopback DHT: a
dashboard started mid-run (or restarted) shows the rounds before it started, and its tokens/s is the trainers'
measured throughput, not whole-second phase times."""

from __future__ import annotations

import dataclasses

import pytest
from solders.keypair import Keypair

from client.dashboard.history import History, RoundResult
from client.dashboard.view import Timeline
from client.witness.records import Board, Commitment
from coordinator_program.spec.state import Phase
from tests.spec.scenario import SMALL, new_run

TRAINERS = [Keypair(), Keypair()]


def commit(board: Board, run_id: str, epoch: int, round_: int) -> None:
    """Both trainers' commitments for a round: the loss falls by round, the second trainer is the slower one."""
    for i, key in enumerate(TRAINERS):
        loss = 5.0 - epoch - 0.1 * round_ + i * 0.2
        record = Commitment.create(key, run_id=run_id, epoch=epoch, round=round_, start=8 * i, end=8 * i + 8,
                                   loss=loss, tokens=1024, seconds=0.5 + 0.25 * i, receipts=())
        assert board.publish(record, key)


def at(state, epoch: int, round_: int, phase: Phase):
    state.epoch, state.phase = epoch, phase
    state.round.height = round_
    return state


def test_a_dashboard_started_mid_run_reads_every_earlier_round(dht, new_dht, run_id) -> None:
    state = at(new_run(dataclasses.replace(SMALL, rounds_per_epoch=4)), 2, 0, Phase.RoundTrain)
    state.run_id = run_id  # the boards key records by the run's instance, which names it
    writer = Board(dht, state)
    for epoch, rounds in ((0, 3), (1, 2)):  # epoch 1 ended early, after 2 of its rounds
        for round_ in range(rounds):
            commit(writer, run_id, epoch, round_)
    commit(writer, run_id, 2, 0)

    fetched: list[tuple[int, int]] = []
    reader = Board(new_dht(), state)

    def fetch(epoch: int, round_: int):
        fetched.append((epoch, round_))
        return list(reader.fetch(Commitment, epoch, round_).values())

    history, timeline = History(fetch), Timeline()
    for result in history.read(state):
        timeline.record(result)
    assert [(p["epoch"], p["round"]) for p in timeline.losses()] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (2, 1)]
    first = timeline.losses()[0]["loss"]
    assert first == pytest.approx((5.0 + 5.2) / 2), "the sample-weighted mean of the trainers' losses"
    assert timeline.tokens_per_second() == pytest.approx(2048 / 0.75), \
        "the round's tokens over its slowest trainer's measured seconds"

    fetched.clear()
    commit(writer, run_id, 2, 1)
    results = history.read(at(state, 2, 1, Phase.RoundWitness))
    assert [(r.epoch, r.round) for r in results] == [(2, 0), (2, 1)]
    assert fetched == [(2, 0), (2, 1)], "ended rounds are not read again; the current round and the one just ended are"
    fetched.clear()
    history.read(at(state, 2, 1, Phase.Cooldown))
    history.read(at(state, 3, 1, Phase.WaitingForMembers))
    assert fetched == [(2, 1), (2, 2)], "an epoch that ended is read to its first round without commitments"


def test_the_timeline_rates_the_newest_round_that_says_its_time_and_stays_bounded() -> None:
    from client.dashboard.history import MAX_LOSS_POINTS

    timeline = Timeline()
    timeline.record(RoundResult(0, 0, 5.5, 4000, 2.0))
    timeline.record(RoundResult(0, 1, 5.4, 4000))  # an older trainer's commitment says no time
    assert timeline.tokens_per_second() == 2000.0
    for r in range(MAX_LOSS_POINTS + 10):
        timeline.record(RoundResult(1, r, 1.0, 1, 1.0))
    assert len(timeline.losses()) == MAX_LOSS_POINTS and timeline.losses()[-1]["round"] == MAX_LOSS_POINTS + 10


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), True, "1"])
def test_a_commitment_lying_about_its_seconds_is_refused(seconds) -> None:
    from client.witness.records import RecordError

    key = TRAINERS[0]
    honest = Commitment.create(key, run_id="r", epoch=0, round=0, start=0, end=8, loss=1.0, tokens=64, seconds=0.5)
    assert Commitment.from_value(honest.to_value()) == honest
    with pytest.raises(RecordError, match="commitment.seconds"):
        Commitment.from_value({**honest.to_value(), "seconds": seconds})
