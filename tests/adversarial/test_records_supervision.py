"""Nothing a peer sends, and no single failure, stops a client from publishing its own reports and proofs.

A real ``Contributor`` (a worker elected to witness) runs its background loops against the coordinator's
specification, in process, and a real loopback DHT; its stage worker is stood in for by the receipts it issues.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from types import SimpleNamespace

import pytest
from solders.keypair import Keypair

from client.backends.base import Backend
from client.contributor.context import RunnerOptions
from client.contributor.rounds import RoundKey
from client.contributor.runner import Contributor
from client.contributor.witnessing import REPORT_GRACE, report_grace
from client.contributor.worker import OpenRound, WorkerRole
from client.receipts import SignedReceipt
from client.sealed import store_sealed
from client.witness.records import RECORD_TTL, Board, Commitment, Report
from coordinator_program.spec import derived, rules
from coordinator_program.spec.instructions import Instruction, Witness, apply
from coordinator_program.spec.state import CoordinatorState, Phase, Role
from tests.witness.rounds import (
    hash_of,
    honest_round,
    receipt,
    run_with_keys,
    share_receipts,
    shares,
    uid_of,
    workers_by_stage,
)


class SpecBackend(Backend):
    """The coordinator as its Python specification runs it: every instruction goes through the real rules."""

    ticks_itself = True

    def __init__(self, state: CoordinatorState, keypair: Keypair) -> None:
        super().__init__()
        self._state, self.keypair = state, keypair
        self.broken_proofs = 0  # proofs that fail with an unexpected error before reaching the rules

    @property
    def identity(self) -> bytes:
        return bytes(self.keypair.pubkey())

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def submit(self, ix: Instruction) -> None:
        if isinstance(ix, Witness) and self.broken_proofs:
            self.broken_proofs -= 1
            raise RuntimeError("the connection broke in an unexpected way")
        state = copy.deepcopy(self.state)
        apply(state, ix, self.identity, int(time.time()), 0)
        await self._publish(state)

    async def enter_round_witness(self) -> None:
        state = copy.deepcopy(self.state)
        rules.tick(state, state.phase_start + state.config.max_round_train_time, 0)
        assert state.phase == Phase.RoundWitness
        await self._publish(state)


class IssuedReceipts:
    """Stands in for the contributor's stage worker: the receipts it issued, which the worker role drains."""

    def __init__(self, uid: str) -> None:
        self.uid, self.pending = uid, []

    def drain_receipts(self) -> list:
        drained, self.pending = self.pending, []
        return [SignedReceipt(**r) for r in drained]

    def close_round(self) -> None:
        """Nothing under way: every receipt issued is pending already."""

    def drain_accusations(self) -> list:
        """None: it refused no trainer's tokens."""
        return []


def late_worker(state: CoordinatorState, me: bytes) -> bytes:
    """A worker other than ``me`` whose receipts the round's commitments hold."""
    return next(w for w in workers_by_stage(state).values() if w != me)


def witnessing_worker(run_id: str, dht, hold_one: bool = False):
    """A run in RoundTrain, every record but the contributor's own report (and, if ``hold_one``, the
    ``late_worker``'s) published, and the contributor: a worker elected to witness the round."""
    state, keys = run_with_keys(run_id=run_id)
    me = next((w for w in derived.witnesses(state) if state.clients[state.client_index(w)].role == Role.Worker), None)
    assert me is not None, "the run's config elects no worker to witness"
    stage = state.clients[state.client_index(me)].stage
    commitments, reports = honest_round(state, keys)
    held = {late_worker(state, me)} if hold_one else set()
    board = Board(dht, state)
    for author, record in [*commitments.items(), *reports.items()]:
        if author != me.hex() and bytes.fromhex(author) not in held:
            assert board.publish(record, keys[bytes.fromhex(author)])
    backend = SpecBackend(state, keys[me])
    contributor = Contributor(backend, keys[me], RunnerOptions(role=Role.Worker, initial_peers=[]))
    worker = IssuedReceipts(uid_of(me, stage))
    contributor.context.dht, contributor.context.board = dht, board
    role = contributor.role
    assert isinstance(role, WorkerRole)
    role.stage = stage
    role.replica = SimpleNamespace(worker=worker, drain_lies=list)  # type: ignore[assignment]  # no averagers, no lies
    role.open_round = OpenRound(RoundKey(state.epoch, state.round.height), state.step)
    mine = [r for s in shares(state) for r in share_receipts(state, keys, s) if r["worker_uid"] == worker.uid]
    return state, keys, board, backend, contributor, worker, me, mine


async def eventually(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)


def reported(board: Board, me: bytes) -> set[str]:
    found = board.fetch(Report, 0, 0).get(me.hex())
    return set(found.receipts) if found is not None else set()  # type: ignore[attr-defined]


def test_a_witness_loop_that_fails_is_restarted_and_reports_keep_flowing(dht, run_id, caplog) -> None:
    state, keys, board, backend, contributor, worker, me, mine = witnessing_worker(run_id, dht)

    async def scenario() -> None:
        backend.broken_proofs = 1
        contributor.start_background()
        try:
            worker.pending += mine
            await eventually(lambda: reported(board, me) == {hash_of(r) for r in mine}, "the first report")
            await eventually(lambda: backend.broken_proofs == 0, "the proof that breaks")
            late = receipt(state, keys, shares(state)[0].client, me, 0, 1, "late")
            worker.pending.append(late)
            await eventually(lambda: hash_of(late) in reported(board, me), "the report after the failure")
            await eventually(lambda: backend.state.round.witness_count == 1, "the proof, sent again")
        finally:
            contributor.tasks.stop()

    with caplog.at_level(logging.ERROR, logger="psyswarm.client"):
        asyncio.run(scenario())
    assert "witnessing failed (RoundTrain, epoch 0, round 0)" in caplog.text
    assert all(backend.state.presence_votes[i] == 1 for i in range(len(state.clients)))


@pytest.mark.parametrize("receipts", [7, [[1, 2]], [[{}, "u", {}]], [{}]], ids=repr)
def test_a_malformed_commitment_in_the_dht_silences_no_witness(dht, run_id, receipts) -> None:
    """Issue 11, item 2: a trainer stores, sealed under its own key, a signed commitment whose receipts are junk."""
    state, keys, board, backend, contributor, worker, me, mine = witnessing_worker(run_id, dht)
    attacker, honest = shares(state)
    bad = Commitment.create(keys[attacker.client], run_id=run_id, epoch=0, round=0, start=attacker.start,
                            end=attacker.end, loss=0.001, tokens=attacker.size * state.model.seq_len,
                            receipts=receipts)
    assert bad.verifies()  # it replaces the attacker's own published commitment, expiring later
    assert store_sealed(dht, keys[attacker.client], board.key(Commitment, 0, 0), bad.to_value(),
                        time.time() + RECORD_TTL + 60)

    async def scenario() -> None:
        contributor.start_background()
        try:
            worker.pending += mine[:1]
            await eventually(lambda: reported(board, me) == {hash_of(mine[0])}, "the first report")
            await asyncio.sleep(1.0)  # the witness loop reads the round's records meanwhile
            worker.pending += mine[1:]
            await eventually(lambda: reported(board, me) == {hash_of(r) for r in mine}, "the later reports")
            await backend.enter_round_witness()
            await eventually(lambda: backend.state.round.witness_count == 1, "the round's proof")
        finally:
            contributor.tasks.stop()

    asyncio.run(scenario())
    assert backend.state.presence_votes[backend.state.client_index(honest.client)] == 1
    assert backend.state.presence_votes[backend.state.client_index(attacker.client)] == 0
    assert backend.state.presence_votes[backend.state.client_index(me)] == 1


def test_a_witness_at_round_witness_waits_for_a_workers_last_report(dht, run_id) -> None:
    """A worker's receipts count for its trainers without its report; its report is its presence. A witness that
    proved the moment RoundWitness began would leave out a worker whose last report is still on its way (and, had
    it reported part of its receipts, charge it): the proof waits ``REPORT_GRACE`` for it, where the
    round's witness time leaves room (here 10 s)."""
    state, keys, board, backend, contributor, worker, me, mine = witnessing_worker(run_id, dht, hold_one=True)
    state.config = dataclasses.replace(state.config, round_witness_time=10)  # the backend's state, not started yet
    assert report_grace(state.config) == REPORT_GRACE
    late = late_worker(state, me)
    _, reports = honest_round(state, keys)  # the same records: signatures and ids are deterministic

    async def scenario() -> None:
        worker.pending += mine
        contributor.start_background()
        try:
            await eventually(lambda: reported(board, me) == {hash_of(r) for r in mine}, "the witness's own report")
            await backend.enter_round_witness()
            await asyncio.sleep(0.6)  # past the first poll in RoundWitness, within the grace
            assert backend.state.round.witness_count == 0, "the proof waits for the late worker's report"
            assert await asyncio.to_thread(board.publish, reports[late.hex()], keys[late])
            await eventually(lambda: backend.state.round.witness_count == 1, "the round's proof")
        finally:
            contributor.tasks.stop()

    asyncio.run(scenario())
    assert REPORT_GRACE > 0.6
    assert report_grace(dataclasses.replace(state.config, round_witness_time=2)) == 0, "no grace a proof could miss"
    assert backend.state.presence_votes[backend.state.client_index(late)] == 1, "the late worker is present"
    assert backend.state.compute_votes[backend.state.client_index(late)] == 1, "and its work counted"
