"""Attacks on what the DHT holds, on a real loopback hivemind DHT: an attacker's node (plain hivemind, no
validator) stores junk, forged, replayed and hijacking values with long expirations; psyswarm's nodes refuse
them, and readers still get every honest record (and the witness still counts its author)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, replace

import hivemind
import pytest
from hivemind.utils import get_dht_time
from solders.keypair import Keypair

from client.commands.status import loss_line
from client.dashboard.history import History
from client.dashboard.view import Timeline, snapshot
from client.pipeline.discovery import STATE_UP, Announcer, WorkerDirectory, WorkerRecord, stage_key
from client.sealed import owner_of, store_sealed
from client.stages import default_index, worker_uid
from client.witness.judge import judge_round
from client.witness.records import RECORD_TTL, Board, Commitment, RecordError, Report, last_loss, members
from tests.pipeline.conftest import TINY, wait_until
from tests.spec.scenario import SMALL
from tests.witness.rounds import commitment, honest_round, run_with_keys, shares, workers_by_stage

A_DAY = 24 * 3600.0


@pytest.fixture
def attacker(dht: hivemind.DHT) -> Iterator[hivemind.DHT]:
    """The attacker's node: it keeps whatever it stores and offers it to every reader that asks."""
    node = hivemind.DHT(initial_peers=[str(a) for a in dht.get_visible_maddrs()], start=True)
    yield node
    node.shutdown()


def published_round(dht: hivemind.DHT, run_id: str):
    """An honest round, every record published by its author."""
    state, keys = run_with_keys(run_id=run_id)
    commitments, reports = honest_round(state, keys)
    board = Board(dht, state)
    for records in (commitments, reports):
        for author, record in records.items():
            assert board.publish(record, keys[bytes.fromhex(author)])
    return state, keys, board, commitments, reports


def judged(state, board: Board):
    return judge_round(state, board.fetch(Commitment, 0, 0), board.fetch(Report, 0, 0))  # type: ignore[arg-type]


@pytest.mark.parametrize("junk", [{"junk": 1}, {"value": {"junk": 1}, "seal": "00" * 64}, "junk"])
def test_junk_under_a_trainers_subkey_does_not_hide_its_commitment(dht, new_dht, attacker, run_id, junk) -> None:
    state, keys, board, commitments, _ = published_round(dht, run_id)
    victim = shares(state)[0].client.hex()
    key = board.key(Commitment, 0, 0)
    attacker.store(key, junk, get_dht_time() + A_DAY, subkey=victim)
    assert attacker.get(key, latest=True).value[victim].value == junk, "the attacker's own node keeps the junk"
    for reader in (board, Board(new_dht(), state)):
        assert reader.fetch(Commitment, 0, 0) == commitments
    evidence = judged(state, board)
    assert evidence.complete and bytes.fromhex(victim) in evidence.participants


def test_junk_under_a_workers_subkey_does_not_hide_its_report(dht, attacker, run_id) -> None:
    state, keys, board, _, reports = published_round(dht, run_id)
    victim = workers_by_stage(state)[1].hex()
    attacker.store(board.key(Report, 0, 0), {"junk": 1}, get_dht_time() + A_DAY, subkey=victim)
    assert board.fetch(Report, 0, 0)[victim] == reports[victim]
    evidence = judged(state, board)
    assert evidence.complete and bytes.fromhex(victim) in evidence.participants


def test_a_plain_value_cannot_replace_a_rounds_records(dht, attacker, run_id) -> None:
    """hivemind replaces a whole dictionary by a plain value that expires later."""
    state, _, board, commitments, _ = published_round(dht, run_id)
    attacker.store(board.key(Commitment, 0, 0), "junk", get_dht_time() + A_DAY)
    assert board.fetch(Commitment, 0, 0) == commitments


def test_a_record_stored_to_outlive_any_run_is_not_read(dht, run_id) -> None:
    state, keys, board, commitments, _ = published_round(dht, run_id)
    trainer = shares(state)[0].client
    assert store_sealed(dht, keys[trainer], board.key(Commitment, 0, 0), commitments[trainer.hex()].to_value(),
                        get_dht_time() + A_DAY)  # its owner may seal it so, but nobody reads it
    assert trainer.hex() not in board.fetch(Commitment, 0, 0)


def test_a_forged_seal_or_a_record_filed_under_another_author_is_refused(dht, attacker, run_id) -> None:
    state, keys, board, commitments, _ = published_round(dht, run_id)
    victim = shares(state)[0].client.hex()
    key = board.key(Commitment, 0, 0)
    cheaper = replace(commitments[victim], loss=0.001).to_value()
    attacker.store(key, {"value": cheaper, "seal": "00" * 64}, get_dht_time() + A_DAY, subkey=victim)
    stranger = Keypair()  # seals, under its own subkey (which the DHT lets it do), the victim's signed record
    assert store_sealed(dht, stranger, key, commitments[victim].to_value(), get_dht_time() + 60)
    found = board.fetch(Commitment, 0, 0)
    assert found == commitments and owner_of(stranger) not in found


def test_a_record_replayed_into_another_run_is_refused(dht, attacker, run_id) -> None:
    """A trainer's sealed record of run A, copied into run B (same epoch and round), where it would expire later
    than the trainer's own record of run B."""
    state, keys = run_with_keys(run_id=run_id)
    trainer = shares(state)[0]
    here, there = Board(dht, state), Board(dht, run_with_keys(run_id=f"{run_id}-b")[0])
    own = honest_round(state, keys)[0][trainer.client.hex()]
    assert there.publish(commitment(state, keys, trainer, list(own.receipts), run_id=there.run_id),
                         keys[trainer.client])
    time.sleep(0.05)
    assert here.publish(own, keys[trainer.client])
    sealed = attacker.get(here.key(Commitment, 0, 0), latest=True).value[trainer.client.hex()]
    for value in (sealed.value, sealed.value["value"]):  # with its seal, and bare
        attacker.store(there.key(Commitment, 0, 0), value, sealed.expiration_time, subkey=trainer.client.hex())
    [found] = there.fetch(Commitment, 0, 0).values()
    assert found.run_id == there.run_id  # type: ignore[attr-defined]
    assert attacker.get(there.key(Commitment, 0, 0), latest=True).value[trainer.client.hex()].expiration_time == \
        sealed.expiration_time, "the replay was live on the attacker's node"


def test_a_large_runs_records_spread_over_a_key_per_proof_part_and_are_all_read(dht, run_id) -> None:
    """At 1,024 clients a round's records of a kind spread over eight keys (one per proof part), each author's
    under the shard its key names; a reader fetches every shard and finds every record."""
    state, keys = run_with_keys(workers=12, trainers=20, run_id=run_id, config=replace(SMALL, max_clients=1024))
    commitments, reports = honest_round(state, keys)
    board = Board(dht, state)
    assert board.shards == 8
    for records in (commitments, reports):
        for author, record in records.items():
            assert board.publish(record, keys[bytes.fromhex(author)])
    assert board.fetch(Commitment, 0, 0) == commitments and board.fetch(Report, 0, 0) == reports
    held = {shard: dht.get(board.key(Commitment, 0, 0, shard), latest=True) for shard in range(board.shards)}
    filed = {shard: set(found.value) for shard, found in held.items() if found is not None}
    assert len(filed) > 1, "every commitment landed under one key"
    assert all(board.shard_of(author) == shard for shard, authors in filed.items() for author in authors)


def test_an_author_cannot_show_readers_of_another_shard_another_record(dht, run_id) -> None:
    """A trainer files a second, cheaper commitment under a shard that is not its own (its sealed subkey there is
    its to write): readers take only the record filed where its key says."""
    state, keys = run_with_keys(workers=3, trainers=2, run_id=run_id, config=replace(SMALL, max_clients=1024))
    commitments, _ = honest_round(state, keys)
    board = Board(dht, state)
    trainer = shares(state)[0].client
    own = commitments[trainer.hex()]
    assert board.publish(own, keys[trainer])
    other = (board.shard_of(trainer.hex()) + 1) % board.shards
    fields = {k: v for k, v in asdict(own).items() if k not in ("author", "signature")}
    cheaper = Commitment.create(keys[trainer], **{**fields, "loss": 0.001})  # signed: admitted if read anywhere
    cheaper.admit(trainer.hex(), state.run_id, 0, 0)
    assert store_sealed(dht, keys[trainer], board.key(Commitment, 0, 0, other), cheaper.to_value(),
                        get_dht_time() + 60)
    assert board.fetch(Commitment, 0, 0)[trainer.hex()] == own


# --- worker announcements ---------------------------------------------------------------------------------------


def announcer(dht: hivemind.DHT, run_id: str, keypair: Keypair, address: str, uid: str | None = None) -> Announcer:
    """A worker's real announcer for stage head, under the uid its key derives unless told otherwise."""
    uid = uid or worker_uid("head", default_index(bytes(keypair.pubkey())))

    def record(expires: float) -> WorkerRecord:
        return WorkerRecord(run_id=run_id, stage="head", uid=uid, address=address, sync_phase=0, load=0,
                            throughput=0.0, model=TINY.fingerprint(), pubkey="", expires=expires, state=STATE_UP)

    return Announcer(dht, keypair, record, period=2.0)


def test_a_strangers_announcement_under_a_victims_uid_is_refused(dht, attacker, run_id) -> None:
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint())
    victim = announcer(dht, run_id, Keypair(), "127.0.0.1:1111")
    victim.start()
    try:
        [found] = wait_until(lambda: directory.workers("head"), what="the victim's announcement")
        stranger = Keypair()
        hijack = replace(found, address="127.0.0.1:6666", expires=get_dht_time() + 60).signed_by(stranger)
        # Under the victim's uid as the subkey (the old layout) for a day, and sealed under the stranger's own subkey.
        attacker.store(stage_key(run_id, "head"), asdict(hijack), get_dht_time() + A_DAY, subkey=found.uid)
        assert store_sealed(dht, stranger, stage_key(run_id, "head"), asdict(hijack), hijack.expires)
        assert [(r.uid, r.address) for r in directory.workers("head")] == [(found.uid, "127.0.0.1:1111")]
        victim.announce_now()
        time.sleep(0.5)
        assert [(r.uid, r.address) for r in directory.workers("head")] == [(found.uid, "127.0.0.1:1111")]
    finally:
        victim.stop()
    assert directory.workers("head") == [], "gone when the victim leaves: the stranger's claim never counts"


def test_junk_under_a_workers_subkey_does_not_hide_its_announcement(dht, attacker, run_id) -> None:
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint())
    keypair = Keypair()
    victim = announcer(dht, run_id, keypair, "127.0.0.1:1111")
    victim.start()
    try:
        wait_until(lambda: directory.workers("head"), what="the victim's announcement")
        attacker.store(stage_key(run_id, "head"), {"junk": 1}, get_dht_time() + A_DAY, subkey=owner_of(keypair))
        assert [r.address for r in directory.workers("head")] == ["127.0.0.1:1111"]
    finally:
        victim.stop()


def test_a_hand_picked_uid_two_identities_announce_is_listed_for_neither(dht, run_id, caplog) -> None:
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint())
    first = announcer(dht, run_id, Keypair(), "127.0.0.1:1111", uid="head.0.1")
    second = announcer(dht, run_id, Keypair(), "127.0.0.1:2222", uid="head.0.1")
    first.start()
    try:
        wait_until(lambda: directory.workers("head"), what="the first announcement")
        second.start()
        wait_until(lambda: not directory.workers("head"), what="the contested uid to be dropped")
        assert len(directory.records("head")) == 0 and "2 identities announce" in caplog.text
    finally:
        first.stop()
        second.stop()


def test_only_the_runs_members_show_a_loss_and_no_loss_breaks_the_sum(dht, run_id) -> None:
    """Issue 21, attack 4: a key that is not a client signs commitments (one with loss 1.7e308, one a plausible
    forgery) for the round; ``status`` read them and printed ``last loss: inf``. Only members' records count, and
    no admitted loss can make the mean non-finite."""
    state, keys, board, commitments, _ = published_round(dht, run_id)
    stranger, share = Keypair(), shares(state)[0]
    for loss in (1.7e308, 0.001):
        forged = Commitment.create(stranger, run_id=state.run_id, epoch=0, round=0, start=share.start,
                                   end=share.end, loss=loss, tokens=share.size * state.model.seq_len, receipts=())
        with pytest.raises(RecordError) if loss > 1e6 else nullcontext():
            forged.admit(owner_of(stranger), state.run_id, 0, 0)
        key = board.key(Commitment, 0, 0)
        assert store_sealed(dht, stranger, key, forged.to_value(), get_dht_time() + 60)
    assert owner_of(stranger) in {k for k in dht.get(board.key(Commitment, 0, 0), latest=True).value}
    assert last_loss(board, state) == (0, 0, 4.2)  # the honest trainers' loss alone
    assert loss_line(board, state) == "last loss: 4.2000 (epoch 0, round 1)"


def test_a_later_run_of_the_same_id_reads_none_of_an_earlier_runs_records(dht, run_id) -> None:
    """Issue 21, attack 8: a new run with the id of an earlier one showed the old run's loss in ``status``. Records
    live under the run's instance (its id, main authority and creation time)."""
    earlier, _, _, _, _ = published_round(dht, run_id)
    later = replace(earlier, created_at=earlier.created_at + 3600)
    assert Board(dht, later).fetch(Commitment, 0, 0) == {} and last_loss(Board(dht, later), later) is None
    assert last_loss(Board(dht, earlier), earlier) == (0, 0, 4.2)


def test_a_members_commitment_that_claims_no_time_cannot_break_the_dashboard(dht, run_id) -> None:
    """A trainer of the run re-signs its own commitment with ``seconds`` = 5e-324 (finite and positive) and stores it
    over the honest one, sealed with its key. Every other trainer measured no time, so the round's throughput was
    its tokens over that: infinity, which the dashboard's JSON view cannot encode (every refresh answered 500). A
    time under ``MIN_SECONDS`` is refused with the record, so the round's rate is unknown, and the view encodes."""
    state, keys, board, commitments, _ = published_round(dht, run_id)
    liar = shares(state)[0]
    lying = commitment(state, keys, liar, list(commitments[liar.client.hex()].receipts), seconds=5e-324)
    with pytest.raises(RecordError, match="commitment.seconds"):
        lying.admit(liar.client.hex(), state.run_id, 0, 0)
    key = board.key(Commitment, 0, 0)
    assert store_sealed(dht, keys[liar.client], key, lying.to_value(), get_dht_time() + RECORD_TTL)
    assert dht.get(key, latest=True).value[liar.client.hex()].value["seconds"] == 5e-324
    history = History(lambda epoch, round_: list(board.fetch(Commitment, epoch, round_, members(state)).values()))
    timeline = Timeline()
    for result in history.read(state):
        timeline.record(result)
    assert [(r["epoch"], r["round"]) for r in timeline.losses()] == [(0, 1)]
    view = snapshot(state, time.time(), timeline=timeline)
    assert view["tokens_per_s"] is None
    json.dumps(view, allow_nan=False)  # what the dashboard's JSONResponse does with it
