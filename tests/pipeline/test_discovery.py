"""Signed, expiring worker records on a real loopback DHT."""

from __future__ import annotations

from dataclasses import asdict, replace

from hivemind.utils import get_dht_time
from solders.keypair import Keypair

from client.pipeline.discovery import STATE_UP, WorkerDirectory, WorkerRecord, stage_key
from client.sealed import owner_of, store_sealed
from client.stages import HAND_PICKED_INDICES, default_index, worker_uid

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


def _announce(dht, run_id: str, record: WorkerRecord, keypair: Keypair, expiration: float | None = None) -> None:
    """Store ``record`` as its owner does: sealed under the owner's subkey."""
    assert store_sealed(dht, keypair, stage_key(run_id, record.stage), asdict(record), expiration or record.expires)


def _record(run: str, stage: str, index: int, keypair: Keypair, **changes: object) -> WorkerRecord:
    fields = dict(run_id=run, stage=stage, uid=f"{stage}.0.{index}", address="127.0.0.1:1", sync_phase=0, load=0,
                  throughput=0.0, model=TINY.fingerprint(), pubkey="", expires=get_dht_time() + 30, state=STATE_UP)
    return replace(WorkerRecord(**fields), **changes).signed_by(keypair)  # type: ignore[arg-type]


def test_forged_tampered_and_foreign_records_are_ignored(dht, run_id: str, directory: WorkerDirectory) -> None:
    now = get_dht_time()
    owner = Keypair()
    good = _record(run_id, "tail", 1, owner)
    _announce(dht, run_id, good, owner)
    assert directory.workers("tail") == [good]

    # Each stand-in owner seals its own record under its own subkey, so only the record's content is at fault.
    keys = [Keypair() for _ in range(7)]
    tampered = replace(_record(run_id, "tail", 2, keys[0]), address="127.0.0.1:666")  # signature no longer matches
    _announce(dht, run_id, tampered, keys[0])
    _announce(dht, run_id, _record(run_id, "tail", 3, keys[1], model="0" * 16), keys[1])
    _announce(dht, run_id, _record(run_id, "tail", 4, keys[2]), keys[2], expiration=now + 300)  # outlives its signature
    _announce(dht, run_id, _record(run_id, "tail", 5, keys[3], run_id="another-run"), keys[3])
    _announce(dht, run_id, _record(run_id, "tail", 6, keys[4], sync_phase=7), keys[4])
    _announce(dht, run_id, _record(run_id, "tail", 7, keys[5]), keys[0])  # sealed under another identity's subkey
    # Its owner may announce it for a day, but a dead worker would then stay routable for a day.
    _announce(dht, run_id, _record(run_id, "tail", 10, keys[6], expires=now + 24 * 3600), keys[6])
    assert not dht.store(stage_key(run_id, "tail"), {"junk": 1}, expiration_time=now + 30, subkey="tail.0.8")
    assert not dht.store(stage_key(run_id, "tail"), "not a dict", expiration_time=now + 30, subkey=owner_of(keys[5]))
    assert {r.uid for r in directory.records("tail")} == {"tail.0.1"}
    # A record stored under another stage's key does not count for that stage.
    other = Keypair()
    _announce(dht, run_id, _record(run_id, "head", 1, other), other)
    assert WorkerDirectory(dht, run_id, TINY.fingerprint()).records("head")[0].uid == "head.0.1"
    stray = Keypair()
    _announce(dht, run_id, _record(run_id, "tail", 9, stray, uid="body1.0.9"), stray)
    assert {r.uid for r in directory.records("tail")} == {"tail.0.1"}


def test_a_worker_announces_the_uid_its_key_derives(start_worker, directory: WorkerDirectory) -> None:
    worker = start_worker("body1")
    assert worker.uid == worker_uid("body1", default_index(worker.pubkey))
    assert default_index(worker.pubkey) >= HAND_PICKED_INDICES
    [found] = wait_until(lambda: directory.workers("body1"), what="the announcement")
    assert (found.uid, found.pubkey) == (worker.uid, worker.pubkey.hex())
