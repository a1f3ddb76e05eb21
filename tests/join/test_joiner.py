"""A stale joiner walks phase 1 → phase 2 → active with real workers, a trainer, the DHT and SPARTA.

The stage ``body1`` has an active worker A and a joiner J restored from a stale state (A's initial
parameters plus noise). Each step: the trainer runs a batch through the pipeline, every worker steps, and
body1 averages one of two partitions (sparta_every = 1, p = 1/2) with the weights the tracker gives.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from client.averaging.membership import Roster
from client.averaging.sparta import AveragingStatus, SpartaAverager
from client.data import open_byte_dataset
from client.join.sync import ACTIVE_LINE, PHASE1_LINE, PHASE2_LINE, SyncPhase, SyncPolicy, SyncTracker
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.model import ModelConfig
from client.pipeline.trainer import PipelineTrainer
from client.pipeline.worker import StageWorker
from tests.averagers import FAST, average_together

TINY = ModelConfig(n_layers=3, d_model=32, n_heads=2, seq_len=16, num_stages=3, seed=7)


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def announced_phase(directory: WorkerDirectory, uid: str, phase: int) -> bool:
    return {r.uid: r.sync_phase for r in directory.records("body1")}.get(uid) == phase


def flat(worker: StageWorker) -> torch.Tensor:
    with worker.compute.lock:
        return torch.cat([p.detach().reshape(-1).clone() for p in worker.parameters()])


@pytest.mark.slow
def test_a_stale_joiner_syncs_through_both_phases(own_dht, run_id: str) -> None:
    shared = own_dht()
    dht_a, dht_j = own_dht(), own_dht()
    workers = {
        "head": StageWorker(TINY, "head", dht=shared, run_id=run_id, announce_period=2.0),
        "tail": StageWorker(TINY, "tail", dht=shared, run_id=run_id, announce_period=2.0),
        "A": StageWorker(TINY, "body1", dht=dht_a, run_id=run_id, index=1, announce_period=2.0),
        "J": StageWorker(TINY, "body1", dht=dht_j, run_id=run_id, index=2, announce_period=2.0),
    }
    joiner, active = workers["J"], workers["A"]
    with torch.no_grad():  # a stale checkpoint: far from the stage's live parameters
        for p in joiner.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    # Averagers are created before the workers serve (they fork hivemind's process).
    roster = Roster(0, frozenset({joiner.pubkey, active.pubkey}))
    averagers = {name: SpartaAverager.for_worker(workers[name], dht, partitions=2, seed=TINY.seed,
                                                 roster=lambda: roster, settings=FAST)
                 for name, dht in (("A", dht_a), ("J", dht_j))}
    lines: list[str] = []
    sync = SyncTracker(SyncPolicy(max_allowed_stale=2, phase1_steps=2, phase2_steps=2), say=lines.append)
    step = 10
    assert sync.begin(swarm_step=step, local_step=3) == SyncPhase.WEIGHTS
    joiner.sync_phase = int(sync.phase)
    directory = WorkerDirectory(shared, run_id, TINY.fingerprint())
    trainer = PipelineTrainer(TINY, open_byte_dataset(["stdlib"], TINY.seq_len), directory, run_id=run_id,
                              refresh_period=0.1, max_inflight=2)
    try:
        for worker in workers.values():
            worker.start()
        initial_distance = float((flat(joiner) - flat(active)).norm())
        used: dict[SyncPhase, list[str]] = {SyncPhase.WEIGHTS: [], SyncPhase.OPTIMIZER: [], SyncPhase.ACTIVE: []}
        distances = []
        for _ in range(5):
            phase = sync.phase
            assert wait_until(partial(announced_phase, directory, joiner.uid, int(phase))), (
                f"the joiner's DHT record never showed sync_phase={int(phase)}")
            result = trainer.train(list(range(step * 12, step * 12 + 12)), 2)
            used[phase] += [m.workers["body1"] for m in result.microbatches]
            for worker in workers.values():
                worker.step()
            step += 1
            before_a = flat(active)
            outcome = average_together([averagers["A"], averagers["J"]], step, [1.0, sync.averaging_weight()],
                                       peers=1)
            assert {r.status for r in outcome} == {AveragingStatus.AVERAGED}
            if phase != SyncPhase.ACTIVE:
                assert torch.equal(flat(active), before_a)  # the joiner contributes nothing
            else:
                assert not torch.equal(flat(active), before_a)  # now it does
            distances.append(float((flat(joiner) - flat(active)).norm()))
            sync.advance(step)
            joiner.sync_phase = int(sync.phase)

        assert joiner.uid not in used[SyncPhase.WEIGHTS]  # trainers skip it in phase 1…
        assert joiner.uid in used[SyncPhase.OPTIMIZER]  # …and route batches to it in phase 2
        assert used[SyncPhase.WEIGHTS].count(active.uid) == len(used[SyncPhase.WEIGHTS])
        # Two rounds cover both partitions: the joiner's weights have converged to the stage's, up to the
        # optimizer steps A took since.
        assert distances[1] < 0.02 * initial_distance, (initial_distance, distances)
        assert lines == [PHASE1_LINE, "[SYNC] This phase will last 2 steps (until local epoch 12).",
                         PHASE2_LINE, "[SYNC] This phase will last 2 steps (until local epoch 14).", ACTIVE_LINE]
    finally:
        trainer.close()
        for worker in workers.values():
            worker.stop(grace=0)
        for averager in averagers.values():
            averager.shutdown()
