"""What an elected witness concludes from a round's records, and the filters it sends.

Every record is admitted first (``SignedRecord.admit``: well-formed field by field, signed by the client it is
filed under, of this run, epoch and round); one that is not counts against its author as missing work, and
nothing a record holds can make the judgement fail.

Workers that published an admitted report for the round, in the stage the coordinator gave them and under the
uid their own key derives (``client.stages.own_uid``: a report is public, and one re-filed under another key
must count for nobody), were present;
so were trainers of the epoch that published an admitted ``Presence`` for it (a trainer stalled by a stage that
emptied is alive: it keeps its place, and earns nothing without a counted commitment), unless they also signed
a false commitment: one that claims what the trainer was not assigned or not issued.
A trainer's commitment counts when it covers exactly the sample range the round's seed assigned it and each of
its receipts
- name the commitment's author as their trainer: a receipt's signature covers that name, so a receipt copied from
  another trainer's commitment (they are public) counts for nobody but the trainer it was issued to, and no
  receipt can count in two commitments;
- cover the commitment's range exactly once in every stage of the run: no sample missing, none run twice (a
  receipt listed twice covers its samples twice);
- were signed for this round (the run's instance, epoch and round: a receipt of another run or round is a replay)
- by the key of one of the run's workers of the stage it names (``client.receipts``); the uid it names is the
  worker's word, not checked here: a worker announcing a uid of its choice must not make an honest trainer false.
Its tokens must be its samples times the run's sequence length. A commitment that fails any of these is false:
the trainer's word proves nothing, and it is not present either. An honest trainer files only receipts it checked
as they came (``client.pipeline.trainer``: their round and their worker's signature). The worker-signed receipts
are the proof of the work: what the workers report does not change a trainer's credit. The participant filter
holds every present client and every counted trainer; the batch filter holds the hash of every counted commitment.

A worker that an accusation of the round proves wrong (``accusations.check_accusation``: its own signed answer
against its stage's majority) is left out of both filters: it earns nothing for the round, and once a quorum of
proofs has left it out the coordinator's health check removes it. The trainers whose commitments quote its
receipts keep their credit: they did their share, and found the fault.

The participant filter also holds the compute key (``bloom.compute_key``) of every client whose work counted, for
the coordinator's compute points: every trainer with a counted commitment, and every present worker that signed a
receipt of a counted commitment and listed every such receipt in its report. A worker that leaves out any receipt
it signed (to deny a trainer its credit, say) is charged with it (``Evidence.charged``): it earns no compute
for the round, though it stays present (its own signatures show it served). An honest worker never leaves one
out: it stops signing for a round before its last report (``client.contributor.worker``). A worker still in sync
phase 1 is never routed, so it signs no receipt and earns presence only.

A round is complete (the witness may send its proof opportunistically) once every trainer with data has a
counted commitment and every worker that signed one of their receipts has reported them all: a worker's report
may still be on its way, and a proof sent without it would leave the worker out or charge it.

Signatures are checked last, once a commitment's receipts cover its range once in every stage: so a commitment
costs a witness at most one verification per stage and sample of the trainer's share, however many it lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from client.receipts import ReceiptRound, SignedReceipt
from client.stages import own_uid, stage_names
from client.witness.accusations import AccusationError, check_accusation
from client.witness.records import Accusation, Commitment, Presence, Ready, RecordError, Report, SignedRecord
from coordinator_program.spec import derived
from coordinator_program.spec.bloom import proof_parts
from coordinator_program.spec.selection import Assignment
from coordinator_program.spec.state import CoordinatorState, Health, Role


@dataclasses.dataclass
class Evidence:
    participants: set[bytes] = dataclasses.field(default_factory=set)
    computed: set[bytes] = dataclasses.field(default_factory=set)
    commitments: dict[bytes, bytes] = dataclasses.field(default_factory=dict)
    losses: dict[bytes, float] = dataclasses.field(default_factory=dict)
    missing: list[bytes] = dataclasses.field(default_factory=list)
    why_missing: dict[bytes, str] = dataclasses.field(default_factory=dict)
    charged: dict[bytes, str] = dataclasses.field(default_factory=dict)  # worker -> the receipts it left out
    unreported: set[bytes] = dataclasses.field(default_factory=set)  # workers of counted receipts with no report

    @property
    def complete(self) -> bool:
        """Nothing is awaited: no work missing, no worker charged with a receipt it left out or yet to report."""
        return not (self.missing or self.charged or self.unreported)

    @property
    def batches(self) -> set[bytes]:
        """The hash of every counted commitment."""
        return set(self.commitments.values())

    def filters(self, state: CoordinatorState) -> list[tuple[bytes, bytes]]:
        """The (participant, batch) filters of every part of this witness's proof, in part order."""
        return proof_parts(state.config, [c.id for c in state.clients], self.participants, self.computed,
                           self.commitments)

    def miss(self, client: bytes, why: str) -> None:
        self.missing.append(client)
        self.why_missing[client] = why


Reported = dict[bytes, frozenset[str]]
"""Each present worker -> the hashes of the receipts its report lists."""

Signers = dict[str, str]
"""The key (hex) of each of the run's workers -> the name of its stage."""


def admitted(kind: type[SignedRecord], records: Mapping[str, object], author: str, state: CoordinatorState,
             round_: int | None) -> SignedRecord:
    """``author``'s record of ``kind`` for this run, epoch and round; ``RecordError`` saying why if there is none
    that passes every check."""
    record = records.get(author)
    if record is None:
        raise RecordError(f"no {kind.KIND}")
    if not isinstance(record, kind):
        raise RecordError(f"not a {kind.KIND}")
    record.admit(author, state.run_id, state.epoch, round_)
    return record


def judge_round(state: CoordinatorState, commitments: Mapping[str, Commitment], reports: Mapping[str, Report],
                presences: Mapping[str, Presence] = MappingProxyType({}),
                accusations: Mapping[str, Accusation] = MappingProxyType({})) -> Evidence:
    """Check a round's records against the coordinator state (pure: the caller fetched the records)."""
    evidence = Evidence()
    reported = present_workers(state, reports, evidence)
    present_trainers(state, presences, evidence)
    signers = worker_keys(state)
    served: dict[bytes, list[SignedReceipt]] = {}  # worker -> the receipts of counted commitments it signed
    for share in derived.data_assignment(state):
        if share.size == 0:
            continue
        try:
            commitment = admitted(Commitment, commitments, share.client.hex(), state, state.round.height)
        except RecordError as exc:
            evidence.miss(share.client, str(exc))
            continue
        try:
            claims = credit(state, share, commitment, signers)  # type: ignore[arg-type]
        except RecordError as exc:  # the trainer signed a false claim: its word proves nothing, presence included
            evidence.miss(share.client, f"{exc}; a false commitment, so not present either")
            evidence.participants.discard(share.client)
            continue
        evidence.participants.add(share.client)
        evidence.computed.add(share.client)
        evidence.commitments[share.client] = commitment.digest()
        evidence.losses[share.client] = commitment.loss  # type: ignore[attr-defined]
        for claim in claims:
            served.setdefault(bytes.fromhex(claim.worker), []).append(claim)
    credit_workers(served, reported, evidence)
    for accused in proven_wrong(state, accusations):
        evidence.participants.discard(accused)
        evidence.computed.discard(accused)
        evidence.why_missing[accused] = "accused with evidence of a wrong answer"
    return evidence


def proven_wrong(state: CoordinatorState, accusations: Mapping[str, Accusation]) -> set[bytes]:
    """The workers that an admitted accusation of this round proves wrong; evidence that does not hold is skipped."""
    names = stage_names(state.config.num_stages)
    stage_of = {c.id.hex(): names[c.stage] for c in state.clients if c.role == Role.Worker}
    found: set[bytes] = set()
    for item in (item for record in admitted_accusations(state, accusations)
                 for item in record.accusations):  # type: ignore[attr-defined]
        try:
            found.add(bytes.fromhex(check_accusation(item, stage_of)))
        except AccusationError:
            continue
    return found


def admitted_accusations(state: CoordinatorState, accusations: Mapping[str, Accusation]) -> Iterator[Accusation]:
    """Every admitted accusation of this round (a record that does not pass is skipped whole)."""
    for author in accusations:
        try:
            yield admitted(Accusation, accusations, author, state, state.round.height)  # type: ignore[misc]
        except RecordError:
            continue


def present_workers(state: CoordinatorState, reports: Mapping[str, Report], evidence: Evidence) -> Reported:
    """Mark every worker with an admitted report in its own stage present; return what they reported."""
    names = stage_names(state.config.num_stages)
    reported: Reported = {}
    for worker in state.clients:
        if worker.role != Role.Worker:
            continue
        try:
            report = admitted(Report, reports, worker.id.hex(), state, state.round.height)
        except RecordError:
            continue
        if report.stage != worker.stage or report.uid != own_uid(names[worker.stage], worker.id):  # type: ignore
            continue  # a report in another stage, or under a uid that is not the author's: not its own work
        evidence.participants.add(worker.id)
        reported[worker.id] = frozenset(report.receipts)  # type: ignore[attr-defined]
    return reported


def worker_keys(state: CoordinatorState) -> Signers:
    """Who may sign a receipt of each stage: the run's workers of that stage."""
    names = stage_names(state.config.num_stages)
    return {w.id.hex(): names[w.stage] for w in state.clients if w.role == Role.Worker and w.stage < len(names)}


def credit_workers(served: dict[bytes, list[SignedReceipt]], reported: Reported, evidence: Evidence) -> None:
    """Compute for every present worker whose report lists every receipt of a counted commitment it signed; a
    charge for each that left one out. An absent worker earns nothing, and its receipts still prove the trainers'
    work."""
    for worker, receipts in served.items():
        if worker not in reported:
            evidence.unreported.add(worker)
            continue
        omitted = [r for r in receipts if r.hash() not in reported[worker]]
        if omitted:
            trainers = sorted({r.trainer_id[:8] for r in omitted})
            evidence.charged[worker] = (f"left {len(omitted)} receipts it signed out of its report (issued to "
                                        f"trainer {', '.join(trainers)}): no compute this round")
        else:
            evidence.computed.add(worker)


def present_trainers(state: CoordinatorState, presences: Mapping[str, Presence], evidence: Evidence) -> None:
    """Mark every trainer of the epoch with an admitted presence for the round present (participation, no batch)."""
    for trainer in state.clients:
        if trainer.role != Role.Trainer:
            continue
        try:
            admitted(Presence, presences, trainer.id.hex(), state, state.round.height)
        except RecordError:
            continue
        evidence.participants.add(trainer.id)


def credit(state: CoordinatorState, share: Assignment, commitment: Commitment,
           signers: Signers) -> tuple[SignedReceipt, ...]:
    """The receipts with which ``commitment`` proves ``share``'s work; ``RecordError`` saying why it does not."""
    if (commitment.start, commitment.end) != (share.start, share.end):
        raise RecordError(f"commits samples {commitment.start}-{commitment.end}, assigned {share.start}-{share.end}")
    if commitment.tokens != share.size * state.model.seq_len:
        raise RecordError(f"claims {commitment.tokens} tokens for {share.size} samples")
    claims = commitment.claims()
    receipts_name_their_trainer(claims, commitment.author)
    receipts_cover_the_range_once(claims, share, stage_names(state.config.num_stages))
    receipts_of_this_round(claims, ReceiptRound(derived.run_instance(state), state.epoch, state.round.height))
    receipts_signed_by_their_workers(claims, signers)
    return claims


def receipts_name_their_trainer(claims: tuple[SignedReceipt, ...], author: str) -> None:
    for claim in claims:
        if claim.trainer_id != author:
            raise RecordError(f"quotes a receipt issued to trainer {claim.trainer_id[:8]}")


def receipts_cover_the_range_once(claims: tuple[SignedReceipt, ...], share: Assignment, stages: list[str]) -> None:
    if any(claim.stage not in stages for claim in claims):
        raise RecordError("quotes a receipt of a stage the run does not have")
    for stage in stages:
        covered = share.start
        for start, end in sorted((c.sample_start, c.sample_end) for c in claims if c.stage == stage):
            if start != covered:
                raise RecordError(f"its {stage} receipts {'skip' if start > covered else 'repeat'} sample {covered}")
            covered = end
        if covered != share.end:
            raise RecordError(f"its {stage} receipts end at sample {covered}, not {share.end}")


def receipts_of_this_round(claims: tuple[SignedReceipt, ...], round_: ReceiptRound) -> None:
    for claim in claims:
        if claim.belongs_to != round_:
            raise RecordError(f"quotes a receipt signed for run {claim.run!r} epoch {claim.epoch} round "
                              f"{claim.round}, not this round (a replay)")


def receipts_signed_by_their_workers(claims: tuple[SignedReceipt, ...], signers: Signers) -> None:
    for claim in claims:
        if signers.get(claim.worker) != claim.stage:
            raise RecordError(f"quotes a {claim.stage} receipt by key {claim.worker[:8]}, not a worker of that stage")
        if not claim.verifies():
            raise RecordError(f"quotes a {claim.stage} receipt its worker {claim.worker_uid} did not sign (forged)")


def judge_warmup(state: CoordinatorState, ready: Mapping[str, Ready]) -> Evidence:
    """A warmup is complete when every client of the epoch has said, signed, that its model is loaded."""
    evidence = Evidence()
    for client in state.clients:
        try:
            admitted(Ready, ready, client.id.hex(), state, None)
        except RecordError as exc:
            evidence.miss(client.id, str(exc))
            continue
        evidence.participants.add(client.id)
    return evidence


def unhealthy_clients(state: CoordinatorState) -> list[bytes]:
    """Healthy-listed clients that a quorum of the previous round's proofs left out: the targets of health
    checks, by the coordinator's own rule (``derived.missed_by_quorum``), so no check is sent that it refuses."""
    return [c.id for c in state.clients if c.health == Health.Healthy and derived.missed_by_quorum(state, c.id)]
