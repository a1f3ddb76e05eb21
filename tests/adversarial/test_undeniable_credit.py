"""Credit no one can deny (issue 21, item 3b): a worker signs the receipt of every Backward it serves and returns it
with the answer; the trainer checks it and files it; the real judge credits the trainer from those receipts even when
the worker leaves them out of its report, and charges the omission to the worker. A receipt the worker did not sign,
or signed for another round or run, earns nothing and is charged to the trainer that filed it.

The pipeline runs for real here (in-process workers serving gRPC on loopback, found through a real DHT, a real
``PipelineTrainer``), with the coordinator's own specification for the state and the points.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
from solders.keypair import Keypair

from client.data import open_byte_dataset
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.router import PipelineError
from client.pipeline.trainer import PipelineTrainer, TrainResult
from client.pipeline.worker import StageWorker
from client.witness.judge import judge_round
from client.witness.records import Commitment, Presence, Report
from coordinator_program.spec import derived, rules
from coordinator_program.spec.state import CoordinatorState
from tests.pipeline.conftest import TINY, wait_until
from tests.spec.scenario import SMALL
from tests.witness.rounds import (
    STAGES,
    commitment,
    hash_of,
    honest_round,
    receipt,
    receipt_round,
    report,
    run_with_keys,
    shares,
    uid_of,
    workers_by_stage,
)

MICROBATCH = 2


@pytest.fixture
def run(dht, run_id) -> Iterator[tuple[CoordinatorState, dict[bytes, Keypair], dict[str, StageWorker]]]:
    """A run in RoundTrain (the coordinator's specification) and its three workers serving their stages over gRPC
    under the run's instance, each signing receipts with its own key for the round the state is in."""
    state, keys = run_with_keys(run_id=run_id)
    instance = derived.run_instance(state)
    workers: dict[str, StageWorker] = {}
    try:
        for stage, key in sorted(workers_by_stage(state).items()):
            worker = StageWorker(TINY, STAGES[stage], keypair=keys[key], dht=dht, run_id=instance)
            worker.receipt_round = lambda: receipt_round(state)
            workers[STAGES[stage]] = worker.start()
        yield state, keys, workers
    finally:
        for worker in workers.values():
            worker.stop(grace=0)


def trainer_of(dht, state: CoordinatorState, keypair: Keypair) -> PipelineTrainer:
    directory = WorkerDirectory(dht, derived.run_instance(state), TINY.fingerprint())
    wait_until(lambda: all(directory.workers(s) for s in STAGES), what="the three workers in the DHT")
    return PipelineTrainer(TINY, open_byte_dataset(["stdlib"], TINY.seq_len), directory, keypair=keypair,
                           run_id=derived.run_instance(state), max_attempts=2, max_inflight=2, stall_timeout=1.0)


def train_share(dht, state: CoordinatorState, keys: dict[bytes, Keypair], index: int) -> tuple[Commitment, TrainResult]:
    """Trainer ``index`` of the round trains its share through the real pipeline and commits it, as its role does."""
    share = shares(state)[index]
    trainer = trainer_of(dht, state, keys[share.client])
    try:
        result = trainer.train(range(share.start, share.end), MICROBATCH, round_=receipt_round(state))
    finally:
        trainer.close()
    receipts = [r.to_value() for m in result.microbatches for _, r in sorted(m.receipts.items())]
    return commitment(state, keys, share, receipts), result


def worker_reports(state: CoordinatorState, keys: dict[bytes, Keypair], workers: dict[str, StageWorker],
                   leave_out: tuple[str, bytes] | None = None) -> dict[str, Report]:
    """Each worker's report of the receipts it signed, as its role publishes it; ``leave_out`` (stage, trainer):
    that stage's worker omits the receipts it signed for that trainer."""
    reports = {}
    for name, worker in workers.items():
        issued = worker.drain_receipts()
        if leave_out is not None and leave_out[0] == name:
            issued = [r for r in issued if r.trainer_id != leave_out[1].hex()]
        reports[worker.pubkey.hex()] = report(state, keys, worker.pubkey, [r.hash() for r in issued])
    return reports


def points(state: CoordinatorState, commitments: dict[str, Commitment], reports: dict[str, Report]) -> dict:
    """(presence, compute) each client earns when every elected witness runs the real judge and the round ends."""
    for witness in derived.witnesses(state):
        [(participants, batches)] = judge_round(state, commitments, reports).filters(state)
        rules.witness(state, witness, state.round.height, participants, batches)
    rules.tick(state, state.phase_start, 1)  # the quorum ended training
    rules.tick(state, state.phase_start + SMALL.round_witness_time, 1)
    return {e.id: (e.presence, e.compute) for e in state.ledger}


def presences(state: CoordinatorState, keys: dict[bytes, Keypair]) -> dict[str, Presence]:
    """Every trainer's signed presence in the round: whatever it commits, it is alive."""
    return {s.client.hex(): Presence.create(keys[s.client], run_id=state.run_id, epoch=state.epoch,
                                            round=state.round.height) for s in shares(state)}


def test_a_worker_leaving_a_trainers_receipts_out_cannot_deny_it_credit_and_is_charged(dht, run) -> None:
    """The body worker serves both trainers, then files a report without the victim's receipts. The victim's
    commitment holds the body's signed receipts: it is credited in full; the body worker earns no compute (it stays
    present), the head and tail workers and the other trainer are paid as usual. (The old judge credited neither
    the victim nor charged anyone.)"""
    state, keys, workers = run
    victim, other = shares(state)
    commitments = {}
    for index, share in enumerate((victim, other)):
        commitments[share.client.hex()], result = train_share(dht, state, keys, index)
        assert len(result.microbatches) == -(-share.size // MICROBATCH)
    body = workers["body1"].pubkey
    reports = worker_reports(state, keys, workers, leave_out=("body1", victim.client))

    evidence = judge_round(state, commitments, reports)
    assert evidence.missing == [] and not evidence.complete, "complete only once no worker is charged"
    assert {victim.client, other.client} <= evidence.computed and victim.client in evidence.losses
    assert body in evidence.participants and body not in evidence.computed
    omitted = -(-victim.size // MICROBATCH)
    assert f"left {omitted} receipts it signed out of its report" in evidence.charged[body]
    assert victim.client.hex()[:8] in evidence.charged[body]

    earned = points(state, commitments, reports)
    assert earned[victim.client] == (1, victim.size) and earned[other.client] == (1, other.size)
    assert earned[body] == (1, 0)
    for name in ("head", "tail"):
        assert earned[workers[name].pubkey] == (1, SMALL.global_batch_size)


def test_receipts_come_back_signed_and_a_trainer_refuses_one_the_worker_did_not_sign(dht, run, caplog) -> None:
    """Over real gRPC: every answer to a Backward carries the receipt its worker signed for the round, which the
    trainer verifies. A worker signing with a key other than the one it announced, or for another round, is refused
    (a bad answer: the trainer bans it and keeps nothing it signed), so an honest trainer never files a receipt the
    witnesses would hold against it; and a worker with no round open refuses Backwards."""
    state, keys, workers = run
    share = shares(state)[0]
    _, result = train_share(dht, state, keys, 0)
    for micro in result.microbatches:
        for name, signed in micro.receipts.items():
            assert signed.worker == workers[name].pubkey.hex() and signed.verifies()
            assert signed.belongs_to == receipt_round(state)
    assert {r.hash() for r in workers["tail"].drain_receipts()} == {m.receipts["tail"].hash()
                                                                       for m in result.microbatches}

    tail = workers["tail"]
    for lie, refusal in (("key", "the receipt is not signed by the worker's own key"),
                         ("round", "the receipt is signed for ReceiptRound("),
                         ("closed", f"worker {tail.uid} has no round open")):
        if lie == "key":
            tail.keypair = Keypair()  # it announced its own key; it signs with another
        elif lie == "round":
            tail.keypair = keys[tail.pubkey]
            tail.receipt_round = lambda: dataclasses.replace(receipt_round(state), round=state.round.height + 1)
        else:
            tail.receipt_round = lambda: None
        trainer = trainer_of(dht, state, keys[share.client])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="client.pipeline"), pytest.raises(PipelineError):
            trainer.train(range(share.start, share.start + MICROBATCH), MICROBATCH, round_=receipt_round(state))
        trainer.close()
        assert refusal in caplog.text, lie
        assert (tail.drain_receipts() == []) == (lie == "closed"), "a worker with no round open signs nothing"


def test_a_forged_receipt_earns_nothing_and_is_charged_to_the_trainer_that_filed_it() -> None:
    """A trainer files receipts no worker signed: made with a key of its own under the worker's name, or the
    worker's genuine receipt altered. Its commitment is false: it is neither credited nor present
    though it published its presence (the health checks remove it), and no worker is charged. (The old judge left it
    present, merely unconfirmed.)"""
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    forger, honest = shares(state)
    head = workers_by_stage(state)[0]
    genuine = list(commitments[forger.client.hex()].receipts)
    own_key = Keypair()
    keys[bytes(own_key.pubkey())] = own_key
    for forged in (
        # signed by the trainer's own key, naming the head worker
        {**receipt(state, {**keys, head: own_key}, forger.client, head, forger.start, forger.start + 2),
         "worker": head.hex()},
        # the head's genuine receipt, claiming other data
        {**genuine[0], "input_digest": "cd" * 32},
    ):
        receipts = [forged, *genuine[1:]]
        commitments[forger.client.hex()] = commitment(state, keys, forger, receipts)
        evidence = judge_round(state, commitments, reports, presences(state, keys))
        assert forger.client not in evidence.participants | evidence.computed
        assert "false commitment" in evidence.why_missing[forger.client]
        assert honest.client in evidence.computed and evidence.charged == {}
        assert head in evidence.computed, "the worker whose name was forged keeps its credit for its real work"


def test_a_receipt_replayed_from_another_round_or_run_is_refused_and_charged_to_the_trainer() -> None:
    """The head worker really signed these receipts for the trainer, but for another round, or for an earlier run
    with the same id (another instance): they prove nothing now. The commitment quoting them is false (the trainer
    is not present, its presence notwithstanding), and the worker, who never reported them this round, is not
    charged. (The old judge left the trainer present.)"""
    state, keys = run_with_keys()
    commitments, reports = honest_round(state, keys)
    replayer, honest = shares(state)
    head = workers_by_stage(state)[0]
    genuine = list(commitments[replayer.client.hex()].receipts)
    first = genuine[0]
    for elsewhere in ({"round": state.round.height + 1}, {"epoch": state.epoch + 1},
                      {"run": f"{state.run_id}.0123456789abcdef"}):
        replayed = receipt(state, keys, replayer.client, head, first["sample_start"], first["sample_end"],
                           microbatch=first["microbatch_id"], **elsewhere)
        assert replayed != first and hash_of(replayed) != hash_of(first)
        commitments[replayer.client.hex()] = commitment(state, keys, replayer, [replayed, *genuine[1:]])
        evidence = judge_round(state, commitments, reports, presences(state, keys))
        assert replayer.client not in evidence.participants | evidence.computed
        assert "a replay" in evidence.why_missing[replayer.client]
        assert honest.client in evidence.computed and head in evidence.computed and evidence.charged == {}
        assert uid_of(head, 0) == first["worker_uid"]
