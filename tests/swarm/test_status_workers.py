"""`psyswarm status --initial-peer` says how many workers each stage announces and how many are syncing."""

from __future__ import annotations

from client.pipeline.discovery import STATE_UP, WorkerRecord
from client.swarm.status import workers_line


def record(stage: str, n: int, sync_phase: int) -> WorkerRecord:
    return WorkerRecord(run_id="r", stage=stage, uid=f"{stage}.0.{n}", address="127.0.0.1:1", sync_phase=sync_phase,
                        load=0, throughput=0.0, model="m", pubkey="00", expires=0.0, state=STATE_UP)


def test_each_stage_shows_its_workers_and_those_still_syncing() -> None:
    records = {"head": [record("head", 1, 0), record("head", 2, 1)],
               "body1": [record("body1", 1, 2), record("body1", 2, 1), record("body1", 3, 0)],
               "tail": []}
    assert workers_line(records) == ("workers in the DHT: head=2 (1 in sync phase 1) "
                                     "body1=3 (1 in sync phase 1, 1 in sync phase 2) tail=0")
