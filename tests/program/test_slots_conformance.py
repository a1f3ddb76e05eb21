"""Conformance of the join authority's slots (issue 21): the C program against the specification on a permissioned
run, for joins that name a slot and a deadline, ``release_slot`` and withdrawals in any order, with epochs
starting and ending between them. Every operation is replayed on both (``Replay``), which demands the same
outcome and byte-identical accounts; the invariant checked after each is the one the cap rests on: no slot holds
two live keys (a joiner, or a healthy client)."""

from __future__ import annotations

import dataclasses
from collections import Counter

from coordinator_chain import ProgramChain, Replay, Swarm, key
from hypothesis import HealthCheck as HypothesisHealthCheck
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.keypair import Keypair

from coordinator_program.spec import errors, limits
from coordinator_program.spec.config import Checkpoint
from coordinator_program.spec.instructions import JoinRun, ReleaseSlot, SetPaused, Tick, Update, Withdraw
from coordinator_program.spec.state import CoordinatorState, Health, Phase, Role
from tests.spec.scenario import MODEL, SMALL

RUN = "slots.run"
CONFIG = dataclasses.replace(SMALL, warmup_time=5, max_round_train_time=5,
                             round_witness_time=2, cooldown_time=2)
OUTCOMES: Counter[tuple[str, int | None]] = Counter()

member = st.integers(0, 5)


def join() -> st.SearchStrategy[tuple]:
    return st.tuples(st.just("join"), member, st.sampled_from([0, 1, 2, 3, 4, limits.NO_SLOT]),
                     st.sampled_from(["ahead", "ahead", "now", "past", "never"]),
                     st.sampled_from([True] * 4 + [False]))


# one_of draws each distinct strategy equally often, so joins, which a run needs many of, come in copies
op = st.one_of(
    *(join() for _ in range(3)),
    st.tuples(st.just("release"), member, st.booleans()),
    st.tuples(st.just("withdraw"), member),
    *(st.tuples(st.just("tick"), st.sampled_from([0, 1, 3, 6])) for _ in range(2)),
)


def live_slots(state: CoordinatorState) -> list[int]:
    """The slot of every live key: every joiner, and every healthy client."""
    live = [j.slot for j in state.pending] + [c.slot for c in state.clients if c.health == Health.Healthy]
    return [slot for slot in live if slot != limits.NO_SLOT]


def started(gate: Keypair) -> tuple[Swarm, list[Keypair]]:
    authority = Keypair()
    swarm = Swarm(Replay(ProgramChain(), authority, RUN, join_authority=key(gate)))
    swarm.replay.chain.fund(gate)
    assert swarm.replay.apply(Update(CONFIG, MODEL, Checkpoint()), authority) is None
    assert swarm.replay.apply(SetPaused(False), authority) is None
    assert swarm.replay.apply(Tick(), authority, advance=1) is None
    return swarm, swarm.new_members(6)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HypothesisHealthCheck.too_slow, HypothesisHealthCheck.data_too_large])
@given(st.lists(op, min_size=10, max_size=60))
def test_slots_and_releases_match_the_specification(steps: list[tuple]) -> None:
    gate = Keypair.from_seed(bytes(32))
    swarm, members = started(gate)
    replay = swarm.replay
    for step in steps:
        kind = step[0]
        if kind == "join":
            _, who, slot, deadline, cosigned = step
            valid_until = {"ahead": replay.now + 10, "now": replay.now, "past": replay.now - 1,
                           "never": limits.NO_DEADLINE}[deadline]
            role = Role.Trainer if who >= 4 else Role.Worker
            ix = JoinRun(RUN, role, limits.NO_STAGE, slot, valid_until)
            code = replay.apply(ix, members[who], gate if cosigned else None)
        elif kind == "release":
            _, who, by_gate = step
            code = replay.apply(ReleaseSlot(key(members[who])), gate if by_gate else members[who])
        elif kind == "withdraw":
            code = replay.apply(Withdraw(), members[step[1]])
        else:
            code = replay.apply(Tick(), gate, advance=step[1])
        OUTCOMES[(ReleaseSlot.NAME if kind == "release" else kind, code)] += 1
        slots = live_slots(replay.state)
        assert len(slots) == len(set(slots)), f"two live keys share a slot: {slots}"


def test_the_slot_sequences_reach_every_outcome() -> None:
    """Guard against sequences that never exercise a rule."""
    if not OUTCOMES:  # run alone (-k): replay first
        test_slots_and_releases_match_the_specification()
    assert {(ReleaseSlot.NAME, None), (ReleaseSlot.NAME, errors.NotAuthorized.code),
            (ReleaseSlot.NAME, errors.NotJoined.code), ("join", None), ("join", errors.SlotTaken.code),
            ("join", errors.JoinExpired.code), ("join", errors.NotAuthorized.code), ("tick", None)} <= set(OUTCOMES)


def test_a_released_client_frees_its_slot_at_once_and_leaves_at_the_rounds_end() -> None:
    gate = Keypair.from_seed(bytes(32))
    swarm, members = started(gate)
    replay = swarm.replay
    ahead = replay.now + 30
    for slot, (kp, role) in enumerate(zip(members, [Role.Worker] * 3 + [Role.Trainer], strict=False)):
        assert replay.apply(JoinRun(RUN, role, limits.NO_STAGE, slot, ahead), kp, gate) is None
    assert replay.apply(Tick(), gate, advance=1) is None and replay.state.phase == Phase.Warmup
    assert replay.apply(JoinRun(RUN, Role.Worker, limits.NO_STAGE, 0, ahead), members[4], gate) == \
        errors.SlotTaken.code
    assert replay.apply(ReleaseSlot(key(members[0])), members[0]) == errors.NotAuthorized.code
    assert replay.apply(ReleaseSlot(key(members[0])), gate) is None
    assert replay.state.clients[0].health == Health.Withdrawn
    assert replay.apply(ReleaseSlot(key(members[0])), gate) == errors.NotHealthy.code  # the key is leaving already
    assert replay.apply(JoinRun(RUN, Role.Worker, limits.NO_STAGE, 0, ahead), members[4], gate) is None
    assert replay.apply(JoinRun(RUN, Role.Worker, limits.NO_STAGE, 5, ahead), members[5], gate,
                        advance=31) == errors.JoinExpired.code
