"""Accusations: the evidence that a worker answered a question unlike its stage's majority, as anyone checks it.

A trainer that checks results (``client.pipeline.checks``) and finds a replica wrong publishes, in its round's
``Accusation`` record, the signed answers of every replica it asked (``client.answers``). An accusation holds when
- every answer is well formed and signed by the key it names, all to one question, by distinct workers;
- every signer is a worker of the accusation's stage (the caller gives the roster: the coordinator's clients);
- two or more of the other signers signed one and the same answer, and the accused signed another: the accused's
  own signature shows what it answered, and its stage's majority what it should have.
A wrong answer is signed by its author, so no one else can make one up. What this cannot tell apart: two workers of
the stage that lie together against an honest third (a majority of the replicas asked); and answers compared within
a tolerance, which differ in their digests even when honest, so only digest-identical majorities count here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from client.answers import SignedAnswer

MAX_ANSWERS = 8
"""The most answers one accusation carries (a trainer asks three replicas at most)."""


class AccusationError(ValueError):
    """An accusation that does not hold; the message says why."""


def check_accusation(item: object, stage_of: Mapping[str, str]) -> str:
    """The accused's key (hex) if ``item`` holds against ``stage_of`` (each worker's key, hex, to its stage's name);
    ``AccusationError`` saying why not."""
    if not (isinstance(item, dict) and {"stage", "accused", "answers"} <= set(item)):
        raise AccusationError("an accusation must be an object with stage, accused and answers")
    stage, accused, raw = item["stage"], item["accused"], item["answers"]
    if not (isinstance(raw, list | tuple) and 2 < len(raw) <= MAX_ANSWERS):
        raise AccusationError(f"an accusation needs 3 to {MAX_ANSWERS} answers: the accused's and a majority's")
    answers = [SignedAnswer.from_value(a) for a in raw]
    if any(a is None or not a.verifies() for a in answers):
        raise AccusationError("an answer is malformed or not signed by the worker it names")
    if len({a.question for a in answers}) != 1 or len({a.worker for a in answers}) != len(answers):  # type: ignore
        raise AccusationError("the answers are not all to one question, by distinct workers")
    if any(stage_of.get(a.worker) != stage for a in answers):  # type: ignore[union-attr]
        raise AccusationError(f"a signer is not a worker of stage {stage!r}")
    mine = [a for a in answers if a.worker == accused]  # type: ignore[union-attr]
    if len(mine) != 1:
        raise AccusationError("the accused did not sign one of the answers")
    majority, count = Counter(a.answer for a in answers if a.worker != accused).most_common(1)[0]  # type: ignore
    if count < 2 or majority == mine[0].answer:
        raise AccusationError("no two other workers of the stage agree on an answer the accused did not give")
    return accused
