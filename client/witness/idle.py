"""Presence is not enough: a trainer that only publishes presences is told apart from one stalled by its pipeline.

A trainer's presence keeps it in the run without credit, so that one stalled by a stage that emptied (or whose
workers cannot serve yet) is not removed with that stage's workers. A trainer that trains nothing at all keeps its
place the same way, and every round runs to ``max_round_train_time`` waiting for its share. What tells them apart is
the other trainers: where the pipeline could not train, nobody commits; where it could, the others do. So a trainer
is *idle* when, in each of the last ``IDLE_ROUNDS`` rounds of the epoch (this one included), it has no commitment
while another trainer has one: in this round, no counted commitment while another's counted; in the earlier ones,
no commitment the DHT holds (signed, of this run, epoch and round) while another trainer's is there (one whose
commitment was false was left out of that round's proofs already, so it is health-checked anyway).

An idle trainer is left out of the witness's proof like a convicted one (``data_accusations.convict``): not present, not
credited, and not waited for. So a trainer that publishes presences alone is left out from its third round, health-
checked in the next and removed at that round's end: at most ``IDLE_ROUNDS + 1`` rounds, the first
``IDLE_ROUNDS - 1`` of which run to ``max_round_train_time``. A trainer too slow to finish its share within
``max_round_train_time`` for ``IDLE_ROUNDS`` rounds while others finish theirs is removed the same way: it adds
nothing. A lone trainer is never idle (nobody else shows the pipeline could train), nor is any trainer in the
epoch's first ``IDLE_ROUNDS - 1`` rounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from client.witness.judge import Evidence
from client.witness.records import Commitment
from coordinator_program.spec.state import CoordinatorState, Role

IDLE_ROUNDS = 3
"""Rounds in a row (this one included) without a commitment, while another trainer commits, that make a trainer
idle."""
IDLE = (f"no commitment in {IDLE_ROUNDS} rounds in a row while other trainers committed: present, but idle, so "
        "neither present nor credited")


def candidates(state: CoordinatorState, evidence: Evidence) -> set[bytes]:
    """The epoch's trainers present in this round without a counted commitment, when another trainer's counted:
    the ones the earlier rounds may show idle. Empty in the epoch's first ``IDLE_ROUNDS - 1`` rounds."""
    if state.round.height < IDLE_ROUNDS - 1 or not evidence.commitments:
        return set()
    return {c.id for c in state.clients if c.role == Role.Trainer and c.id in evidence.participants
            and c.id not in evidence.commitments}


def idle_trainers(state: CoordinatorState, evidence: Evidence,
                  earlier: Sequence[Mapping[str, Commitment]]) -> set[bytes]:
    """The ``candidates`` that ``earlier`` (the previous ``IDLE_ROUNDS - 1`` rounds' commitments by author, hex)
    show idle: in each of those rounds, no commitment of theirs while another trainer's is there."""
    if len(earlier) < IDLE_ROUNDS - 1:
        return set()
    trainers = {c.id.hex() for c in state.clients if c.role == Role.Trainer}
    idle = set()
    for trainer in candidates(state, evidence):
        key = trainer.hex()
        if all(key not in found and (set(found) & trainers) - {key} for found in earlier):
            idle.add(trainer)
    return idle
