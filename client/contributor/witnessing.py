"""Witnessing, which any client elected for a round does whatever its role: judge the round's signed records
and send the proof, and health-check the clients the previous round's witnesses missed. The proof leaves out the
workers a trainer's accusation proves answered wrong, the trainers a worker's accusation proves sent other data
than the run's, the workers a groupmate's accusation proves sealed a false averaging declaration (``accusing``),
and the trainers that published presences alone for ``idle.IDLE_ROUNDS`` rounds
while others trained.

A witness sends its proof as soon as every batch is in (opportunistic witnessing), or at RoundWitness with what
it has; at Warmup it proves who is ready. At RoundWitness a proof that would charge a worker with receipts left
out of its report, or leave out a worker whose receipts it counted, waits a little (``report_grace``): an honest
worker's last report, published as it closes the round, may still be on its way. A proof goes once per
round: one the coordinator refuses is not sent again, one that did not get through is, at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from client.contributor.accusing import FALSE_DECLARATION, Convictions, false_declarers
from client.contributor.context import ClientContext
from client.contributor.rounds import RoundKey
from client.contributor.tasks import POLL_INTERVAL
from client.witness.data_accusations import DataAccusation, convict
from client.witness.idle import IDLE, IDLE_ROUNDS, candidates, idle_trainers
from client.witness.judge import judge_round, judge_warmup, unhealthy_clients
from client.witness.records import Accusation, Commitment, Presence, Ready, Report, members
from coordinator_program.spec import derived
from coordinator_program.spec.config import Config
from coordinator_program.spec.errors import CoordinatorError, WrongPhase
from coordinator_program.spec.state import CoordinatorState, Phase

log = logging.getLogger("psyswarm.client")

REPORT_GRACE = 1.0
"""The most seconds into RoundWitness a witness waits for the workers' last reports before charging any with an
omission or leaving one out: two polls (``tasks.POLL_INTERVAL``)."""


def report_grace(config: Config) -> float:
    """How long a witness waits for late reports in a run of ``config``: ``REPORT_GRACE`` where it leaves the proof
    half the witness time and two polls to arrive in, less where it would not, and none in a witness time of 2 s or
    less (a proof that arrives after RoundWitness counts for nothing, which costs every client more than a late
    report costs its worker)."""
    return max(0.0, min(REPORT_GRACE, config.round_witness_time / 2 - 2 * POLL_INTERVAL))


@dataclass(frozen=True)
class Proof:
    """A proof this witness has settled: of a round's work, or of its epoch's warmup (who is ready)."""

    round: RoundKey
    warmup: bool


class Witnessing:
    """What this client does as an elected witness."""

    def __init__(self, context: ClientContext) -> None:
        self.context: ClientContext = context
        self.proved: set[Proof] = set()
        self.health_checked: set[RoundKey] = set()
        self.witness_seen: tuple[RoundKey, float] | None = None  # the round last judged in RoundWitness, and when
        self.convictions: Convictions = Convictions(context)
        self.declarations: dict[tuple[int, str, int], bytes | None] = {}  # false-declaration items checked, and whom

    async def witness_current(self) -> None:
        """Prove the current round or warmup if this client witnesses it (polled in the background)."""
        await self.witness(self.context.state)

    async def witness(self, state: CoordinatorState) -> None:
        if state.phase not in (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness):
            return
        warmup = state.phase == Phase.Warmup
        key = Proof(RoundKey.of(state), warmup)
        board = self.context.board
        if key in self.proved or self.context.me not in derived.witnesses(state):
            return
        assert board is not None
        counted = members(state)  # a stranger's records are skipped before their signatures cost anything
        if warmup:
            ready = await asyncio.to_thread(board.fetch, Ready, state.epoch, None, counted)
            evidence = judge_warmup(state, ready)  # type: ignore[arg-type]
        else:
            height = state.round.height
            commitments = await asyncio.to_thread(board.fetch, Commitment, state.epoch, height, counted)
            reports = await asyncio.to_thread(board.fetch, Report, state.epoch, height, counted)
            presences = await asyncio.to_thread(board.fetch, Presence, state.epoch, height, counted)
            accusations = await asyncio.to_thread(board.fetch, Accusation, state.epoch, height, counted)
            evidence = judge_round(state, commitments, reports, presences, accusations)  # type: ignore[arg-type]
            liars = false_declarers(state, accusations, self.declarations)  # type: ignore[arg-type]
            convict(evidence, liars, FALSE_DECLARATION)  # type: ignore[arg-type]
            wrong_data = await asyncio.to_thread(board.fetch, DataAccusation, state.epoch, height, counted)
            convict(evidence, await self.convictions.convicted(state, wrong_data))  # type: ignore[arg-type]
            if candidates(state, evidence):  # present without a commitment while others committed: idle lately?
                earlier = [await asyncio.to_thread(board.fetch, Commitment, state.epoch, r, counted)
                           for r in range(height - IDLE_ROUNDS + 1, height)]
                convict(evidence, idle_trainers(state, evidence, earlier), IDLE)  # type: ignore[arg-type]
        if not evidence.complete and not self._final(key.round, state, bool(evidence.charged or evidence.unreported)):
            return
        parts = evidence.filters(state)
        try:  # a proof that did not get through (a network error, say) is sent again at the next poll
            await self.context.backend.prove(None if warmup else state.round.height, parts)
        except WrongPhase:
            self.proved.add(key)
            log.info("%s proof for %s arrived after the %s had ended (the other witnesses' quorum or its time limit "
                     "ended it): nothing is lost", "warmup" if warmup else "round", key.round,
                     "warmup" if warmup else "round")
            return
        except CoordinatorError as exc:
            self.proved.add(key)
            log.info("%s proof for %s refused: %s", "warmup" if warmup else "round", key.round, exc.detail)
            return
        self.proved.add(key)
        log.info("%s proof sent for %s: %d participants, %d batches%s", "warmup" if warmup else "round",
                 key.round, len(evidence.participants), len(evidence.batches),
                 "" if evidence.complete else f", {len(evidence.missing)} missing")
        for client, why in evidence.why_missing.items():
            log.info("  %s not counted: %s", client.hex()[:8], why)
        for client, why in evidence.charged.items():
            log.info("  %s charged: %s", client.hex()[:8], why)

    def _final(self, key: RoundKey, state: CoordinatorState, awaiting_reports: bool) -> bool:
        """Whether an incomplete judgement is the one to send: at RoundWitness, once it awaits no worker's report or
        the workers' last reports had their grace (``report_grace``)."""
        if state.phase != Phase.RoundWitness:
            return False
        if self.witness_seen is None or self.witness_seen[0] != key:
            self.witness_seen = (key, time.monotonic())
        return not awaiting_reports or time.monotonic() - self.witness_seen[1] >= report_grace(state.config)

    async def health_check(self, state: CoordinatorState) -> None:
        """RoundTrain, once a round if elected: report the clients the previous round's witnesses did not see."""
        key = RoundKey.of(state)
        if key in self.health_checked or self.context.me not in derived.witnesses(state):
            return
        self.health_checked.add(key)
        for target in unhealthy_clients(state):
            with contextlib.suppress(CoordinatorError):
                await self.context.backend.health_check(target)
                log.info("health check: %s was not seen by the previous round's witnesses", target.hex()[:8])
