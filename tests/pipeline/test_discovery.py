"""Signed, expiring worker records on a real loopback DHT."""

from __future__ import annotations

from dataclasses import asdict, replace

from hivemind.utils import get_dht_time
from solders.keypair import Keypair

from client.pipeline.discovery import STATE_UP, WorkerDirectory, WorkerRecord, stage_key

from .conftest import TINY, wait_until


def test_worker_is_found_with_its_address_and_phase(start_worker, directory: WorkerDirectory) -> None:
    worker = start_worker("body1", index=3)
    assert worker.uid == "body1.0.3"
    [found] = wait_until(lambda: directory.workers("body1"), what="the announcement")
    assert (found.uid, found.address, found.sync_phase) == ("body1.0.3", worker.address, 0)
    assert found.pubkey == bytes(worker.keypair.pubkey()).hex() and found.verifies()
    assert directory.workers("head") == []

    worker.sync_phase = 1  # re-announced at once; trainers skip phase-1 workers
    wait_until(lambda: not directory.workers("body1"), what="phase 1 to hide the worker")
    assert [r.sync_phase for r in directory.records("body1")] == [1]
    worker.sync_phase = 2
    wait_until(lambda: [r.sync_phase for r in directory.workers("body1")] == [2], what="phase 2")


def test_clean_stop_leaves_at_once_and_a_dead_worker_expires(start_worker, directory: WorkerDirectory) -> None:
    leaving = start_worker("head", index=1)
    dying = start_worker("head", index=2, announce_period=1.0)
    wait_until(lambda: len(directory.workers("head")) == 2, what="both announcements")
    leaving.stop()
    assert [r.uid for r in directory.workers("head")] == ["head.0.2"]
    dying.stop(leave=False)  # as if killed: no farewell, the record must expire by itself
    assert [r.uid for r in directory.workers("head")] == ["head.0.2"]
    wait_until(lambda: not directory.workers("head"), timeout=10, what="the record to expire")


def _store(dht, run_id: str, record: WorkerRecord, expiration: float | None = None) -> None:
    assert dht.store(
        stage_key(run_id, record.stage),
        asdict(record),
        expiration_time=expiration or record.expires,
        subkey=record.uid,
    )


def test_forged_tampered_and_foreign_records_are_ignored(dht, run_id: str, directory: WorkerDirectory) -> None:
    now = get_dht_time()
    keypair = Keypair()
    good = WorkerRecord(
        run_id=run_id,
        stage="tail",
        uid="tail.0.1",
        address="127.0.0.1:1",
        sync_phase=0,
        load=0,
        throughput=0.0,
        model=TINY.fingerprint(),
        pubkey="",
        expires=now + 30,
        state=STATE_UP,
    ).signed_by(keypair)
    _store(dht, run_id, good)
    assert directory.workers("tail") == [good]

    tampered = replace(good, uid="tail.0.2", address="127.0.0.1:666")  # signature no longer matches
    other_model = replace(good, uid="tail.0.3", model="0" * 16).signed_by(keypair)
    stretched = replace(good, uid="tail.0.4").signed_by(keypair)
    _store(dht, run_id, tampered)
    _store(dht, run_id, other_model)
    _store(dht, run_id, stretched, expiration=now + 300)  # outlives its signed expiration
    assert dht.store(stage_key(run_id, "tail"), {"junk": 1}, expiration_time=now + 30, subkey="tail.0.5")
    assert dht.store(stage_key(run_id, "tail"), "not a dict", expiration_time=now + 30, subkey="tail.0.6")
    assert {r.uid for r in directory.records("tail")} == {"tail.0.1"}
    # A record stored under another stage's key does not count for that stage.
    _store(dht, run_id, replace(good, stage="head", uid="head.0.1").signed_by(keypair))
    assert WorkerDirectory(dht, run_id, TINY.fingerprint()).records("head")[0].uid == "head.0.1"
    _store(dht, run_id, replace(good, uid="body1.0.9").signed_by(keypair))
    assert {r.uid for r in directory.records("tail")} == {"tail.0.1"}
