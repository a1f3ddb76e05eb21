"""Building blocks for witness tests: a run in RoundTrain whose clients hold real keys, and the signed records an
honest round produces (every trainer's receipts, in full and signed by the workers that issued them, reported by
those workers)."""

from __future__ import annotations

import dataclasses

from solders.keypair import Keypair

from client.receipts import Receipt, ReceiptRound, SignedReceipt
from client.stages import own_uid
from client.witness.records import Commitment, Report
from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.config import Config
from coordinator_program.spec.selection import Assignment
from coordinator_program.spec.state import CoordinatorState, Phase, Role
from tests.spec.scenario import RUN_ID, SMALL, new_run

STAGES = ["head", "body1", "tail"]
MICROBATCH = 2
DIGEST = "ab" * 32


def run_with_keys(workers: int = 3, trainers: int = 2, run_id: str = RUN_ID,
                  config: Config = SMALL) -> tuple[CoordinatorState, dict[bytes, Keypair]]:
    """A run of ``config`` in RoundTrain whose clients (``workers`` auto-staged workers, ``trainers`` trainers) have
    real keys; ``run_id`` renames it once started (tests sharing one DHT keep their records apart by run id)."""
    state = new_run(config)
    keys: dict[bytes, Keypair] = {}
    for role in [Role.Worker] * workers + [Role.Trainer] * trainers:
        key = Keypair()
        me = bytes(key.pubkey())
        keys[me] = key
        rules.join(state, me, RUN_ID, role, limits.NO_STAGE, me)
    rules.tick(state, 0, 5)
    rules.tick(state, config.warmup_time, 6)
    assert state.phase == Phase.RoundTrain
    state.run_id = run_id
    return state, keys


def uid_of(worker: bytes, stage: int) -> str:
    """The uid a worker's key derives: the only one its reports count under."""
    return own_uid(STAGES[stage], worker)


def receipt_round(state: CoordinatorState) -> ReceiptRound:
    """The round a worker signs its receipts for while ``state`` is in it."""
    return ReceiptRound(derived.run_instance(state), state.epoch, state.round.height)


def receipt(state: CoordinatorState, keys: dict[bytes, Keypair], trainer: bytes, worker: bytes, start: int,
            end: int, microbatch: str = "", **changes: object) -> dict:
    """A receipt for samples ``[start, end)`` that ``worker`` signed for ``trainer`` in ``state``'s round, as the
    trainer files it (``SignedReceipt.to_value``); ``changes`` alter its fields (its round, say) before signing."""
    stage = next(c.stage for c in state.clients if c.id == worker)
    name = STAGES[stage]
    work = dict(trainer_id=trainer.hex(), microbatch_id=microbatch or f"{trainer.hex()[:8]}-{start}", stage=name,
                worker_uid=uid_of(worker, stage), sample_start=start, sample_end=end, input_digest=DIGEST,
                grad_output_digest="" if name == "tail" else DIGEST, grad_input_digest="" if name == "head" else DIGEST)
    round_ = dataclasses.asdict(receipt_round(state))
    work.update({k: v for k, v in changes.items() if k in work})
    round_.update({k: v for k, v in changes.items() if k in round_})
    return SignedReceipt.sign(keys[worker], Receipt(**work), ReceiptRound(**round_)).to_value()  # type: ignore


def hash_of(receipt_: dict) -> str:
    """The hash a worker reports: ``SignedReceipt.hash``."""
    return SignedReceipt(**receipt_).hash()


def workers_by_stage(state: CoordinatorState) -> dict[int, bytes]:
    """One worker per stage (the first the coordinator assigned to it)."""
    found: dict[int, bytes] = {}
    for c in state.clients:
        if c.role == Role.Worker:
            found.setdefault(c.stage, c.id)
    return found


def share_receipts(state: CoordinatorState, keys: dict[bytes, Keypair], share: Assignment) -> list[dict]:
    """The receipts of an honest trainer's share: each stage's worker ran every microbatch once."""
    return [receipt(state, keys, share.client, worker, start, min(start + MICROBATCH, share.end))
            for start in range(share.start, share.end, MICROBATCH)
            for stage, worker in sorted(workers_by_stage(state).items())]


def commitment(state: CoordinatorState, keys: dict[bytes, Keypair], share: Assignment, receipts: list[dict],
               **changes: object) -> Commitment:
    fields = dict(run_id=state.run_id, epoch=state.epoch, round=state.round.height, start=share.start, end=share.end,
                  loss=4.2, tokens=share.size * state.model.seq_len, receipts=tuple(receipts))
    return Commitment.create(keys[share.client], **{**fields, **changes})


def report(state: CoordinatorState, keys: dict[bytes, Keypair], worker: bytes, hashes: list[str],
           **changes: object) -> Report:
    stage = next(c.stage for c in state.clients if c.id == worker)
    fields = dict(run_id=state.run_id, epoch=state.epoch, round=state.round.height, stage=stage,
                  uid=uid_of(worker, stage), receipts=tuple(hashes))
    return Report.create(keys[worker], **{**fields, **changes})


def reports_of(state: CoordinatorState, keys: dict[bytes, Keypair], receipts: list[dict]) -> dict[str, Report]:
    """Every worker's report of the receipts it issued among ``receipts`` (an empty one if none)."""
    issued: dict[bytes, list[str]] = {c.id: [] for c in state.clients if c.role == Role.Worker}
    for r in receipts:
        issued[bytes.fromhex(r["worker"])].append(hash_of(r))
    return {w.hex(): report(state, keys, w, hashes) for w, hashes in issued.items()}


def shares(state: CoordinatorState) -> list[Assignment]:
    """The round's trainers with data, and their sample ranges."""
    return [s for s in derived.data_assignment(state) if s.size]


def honest_round(state: CoordinatorState, keys: dict[bytes, Keypair]):
    """Every trainer commits its assigned range with its receipts, and every worker reports them."""
    receipts = {s.client: share_receipts(state, keys, s) for s in shares(state)}
    commitments = {s.client.hex(): commitment(state, keys, s, receipts[s.client]) for s in shares(state)}
    return commitments, reports_of(state, keys, [r for rs in receipts.values() for r in rs])
