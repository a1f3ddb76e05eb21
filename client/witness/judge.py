"""What an elected witness concludes from a round's records, and the filters it sends.

A trainer's commitment counts when it is signed by a trainer of the epoch, covers exactly the sample range
the round's seed assigned it, and every receipt it lists was also reported, signed, by the worker that
issued it (a worker of the epoch, in the stage the receipt names). Workers that published a signed report
for the round were present. The participant filter holds every counted trainer and present worker; the
batch filter holds the hash of every counted commitment. A round is complete (the witness may send its
proof opportunistically) once every trainer with data has a counted commitment.
"""

from __future__ import annotations

import dataclasses

from client.stages import stage_name
from client.witness.records import Commitment, Ready, Report
from coordinator_program import rules
from coordinator_program.bloom import batch_key, build_filter, participant_key
from coordinator_program.state import CoordinatorState, Health, Role


@dataclasses.dataclass
class Evidence:
    participants: set[bytes] = dataclasses.field(default_factory=set)
    batches: set[bytes] = dataclasses.field(default_factory=set)
    losses: dict[bytes, float] = dataclasses.field(default_factory=dict)
    complete: bool = False
    missing: list[bytes] = dataclasses.field(default_factory=list)

    def filters(self, state: CoordinatorState) -> tuple[bytes, bytes]:
        participants = build_filter(state.config, sorted(participant_key(p) for p in self.participants))
        batches = build_filter(state.config, sorted(batch_key(b) for b in self.batches))
        return participants, batches


def judge_round(state: CoordinatorState, commitments: dict[str, Commitment], reports: dict[str, Report]) -> Evidence:
    """Check a round's records against the coordinator state (pure: the caller fetched the records)."""
    clients = {c.id: c for c in state.clients}
    evidence = Evidence()
    issued: dict[str, tuple[str, str]] = {}  # receipt hash -> (worker uid, stage name)
    for author, report in reports.items():
        worker = clients.get(bytes.fromhex(author))
        if worker is None or worker.role != Role.Worker or worker.stage != report.stage:
            continue
        evidence.participants.add(worker.id)
        for receipt in report.receipts:
            issued[receipt] = (report.uid, stage_name(worker.stage, state.config.num_stages))
    every_stage = {stage_name(s, state.config.num_stages) for s in range(state.config.num_stages)}
    for share in rules.data_assignment(state):
        commitment = commitments.get(share.client.hex())
        if share.size == 0:
            continue
        if commitment is None or (commitment.start, commitment.end) != (share.start, share.end):
            evidence.missing.append(share.client)
            continue
        confirmed = all(issued.get(h) == (uid, stage) for stage, uid, h in commitment.receipts)
        if not confirmed or {stage for stage, _, _ in commitment.receipts} != every_stage:
            evidence.missing.append(share.client)
            continue
        evidence.participants.add(share.client)
        evidence.batches.add(commitment.digest())
        evidence.losses[share.client] = commitment.loss
    evidence.complete = not evidence.missing
    return evidence


def judge_warmup(state: CoordinatorState, ready: dict[str, Ready]) -> Evidence:
    """A warmup is complete when every client of the epoch has said, signed, that its model is loaded."""
    evidence = Evidence()
    for client in state.clients:
        if client.id.hex() in ready:
            evidence.participants.add(client.id)
        else:
            evidence.missing.append(client.id)
    evidence.complete = not evidence.missing
    return evidence


def unhealthy_clients(state: CoordinatorState) -> list[bytes]:
    """Healthy-listed clients the previous round's witnesses did not see: the targets of health checks."""
    if state.round.height == 0:
        return []
    previous = state.previous_round
    required = min(state.config.witness_quorum, previous.witness_count)
    return [c.id for c in state.clients if c.health == Health.Healthy
            and rules.witnessed_by(state, previous, c.id) < required]
