"""A worker taking its stage (client.join.stage_replica): which state it starts from, and when it syncs.

Real DHT nodes, real averagers and real workers announcing themselves; the Hub is tests.fake_hub."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from solders.keypair import Keypair

from client.averaging import sparta
from client.averaging.auditor import AUDIT_RATE
from client.averaging.membership import Roster
from client.averaging.sparta import AveragingStatus, element_ranks
from client.averaging.values import GradValues
from client.contributor.run_model import model_config
from client.join.checkpoints import save_snapshot, save_stage, snapshot_root
from client.join.stage_replica import REPLICA_WEIGHT, StageReplica, StateSources
from client.join.sync import SyncPhase
from coordinator_program.spec import limits
from coordinator_program.spec.config import Checkpoint, CheckpointKind, parse_run_spec
from coordinator_program.spec.state import CoordinatorState, Phase
from tests.averagers import at_once
from tests.fake_hub import FakeHub
from tests.pipeline.conftest import wait_until

SPEC = {"run_id": "replica", "config": {"min_clients": 4, "max_clients": 8, "num_stages": 3, "witness_nodes": 1,
                                         "witness_quorum": 1, "warmup_time": 10, "max_round_train_time": 10,
                                         "round_witness_time": 1, "cooldown_time": 5, "rounds_per_epoch": 5,
                                         "total_steps": 100, "global_batch_size": 8},
        "model": {"n_layers": 3, "n_heads": 2, "d_model": 16, "seq_len": 16, "microbatch_size": 4,
                  "learning_rate": 0.01, "sparta_every": 2, "sparta_partitions": 2, "max_allowed_stale": 3,
                  "sync_phase1_steps": 2, "sync_phase2_steps": 3}}


def places(checkpoint: Checkpoint, unsaved: tuple[int, ...] = ()) -> list[Checkpoint]:
    """The record of a run whose stages were saved at ``checkpoint``, but for ``unsaved``: peers hold those (P2P)."""
    stages = SPEC["config"]["num_stages"]
    return [Checkpoint(CheckpointKind.P2P, checkpoint.repo, checkpoint.revision) if stage in unsaved else checkpoint
            for stage in range(stages)] + [Checkpoint()] * (limits.MAX_STAGES - stages)


def run_state(run_id: str, step: int, checkpoint: Checkpoint | None = None,
              unsaved: tuple[int, ...] = ()) -> CoordinatorState:
    spec = parse_run_spec({**SPEC, "run_id": run_id})
    return CoordinatorState(run_id=run_id, main_authority=bytes(32), join_authority=bytes(32),
                            phase=Phase.Warmup, step=step, config=spec.config, model=spec.model,
                            checkpoints=places(checkpoint or spec.checkpoint, unsaved))


@pytest.fixture
def make_replica(own_dht) -> Iterator[Callable[..., StageReplica]]:
    made: list[StageReplica] = []
    members: set[bytes] = set()  # the stage's roster: every replica made here

    def make(state: CoordinatorState, stage: str = "body1") -> StageReplica:
        keypair = Keypair()
        members.add(bytes(keypair.pubkey()))
        replica = StageReplica.create(state, stage, model_config(state), dht=own_dht(), keypair=keypair,
                                      host="127.0.0.1", trainer_allowed=lambda pubkey: False,
                                      roster=lambda: Roster(0, frozenset(members)), say=lines.append)
        made.append(replica)
        return replica

    lines: list[str] = []
    make.lines = lines  # type: ignore[attr-defined]
    yield make
    for replica in made:
        replica.stop()


def perturbed(replica: StageReplica, by: float) -> dict[str, torch.Tensor]:
    return {k: v + by for k, v in replica.worker.compute.module.state_dict().items()}


def test_a_missing_snapshot_falls_back_to_the_runs_checkpoint_with_its_step(make_replica, run_id: str,
                                                                           tmp_path: Path, fake_hub: FakeHub) -> None:
    checkpoint = Checkpoint(CheckpointKind.Local, str(tmp_path), "epoch-1")
    state = run_state(run_id, 9, checkpoint)
    replica = make_replica(state)
    saved = perturbed(replica, 0.5)
    save_stage(tmp_path / "epoch-1", "body1", saved, step=7)
    sources = StateSources(snapshot=("org/none", "main"), hf_endpoint=fake_hub.url)  # the Hub has no such repo
    found = replica.load(state, 1, sources, lambda: None)
    assert found is not None and found.source.startswith("local:") and replica.local_step == 7
    assert all(torch.equal(v, saved[k]) for k, v in replica.worker.compute.module.state_dict().items())


def test_a_joiner_reads_its_own_stages_place_not_anothers(make_replica, run_id: str, tmp_path: Path) -> None:
    """Each stage has its own place in the record (issue 20, 5): the head's, here a hostile worker's directory
    holding a body1 of its own, is not body1's, and body1's joiner loads from the place body1's workers saved."""
    state = run_state(run_id, 9, Checkpoint(CheckpointKind.Local, str(tmp_path / "run"), "epoch-1"))
    state.checkpoints[0] = Checkpoint(CheckpointKind.Local, str(tmp_path / "hostile"), "epoch-1")
    replica = make_replica(state)
    saved = perturbed(replica, 0.5)
    save_stage(tmp_path / "run" / "epoch-1", "body1", saved, step=7)
    save_stage(tmp_path / "hostile" / "epoch-1", "body1", perturbed(replica, -3.0), step=8)
    found = replica.load(state, 1, StateSources(), lambda: None)
    assert found is not None and found.source == f"local:{tmp_path / 'run' / 'epoch-1' / 'body1.safetensors'}"
    assert all(torch.equal(v, saved[k]) for k, v in replica.worker.compute.module.state_dict().items())


def test_the_snapshot_comes_first_and_a_lone_worker_starts_active(make_replica, run_id: str, tmp_path: Path,
                                                                  fake_hub: FakeHub) -> None:
    import json

    import safetensors.torch

    state = run_state(run_id, 40)
    replica = make_replica(state)
    fake_hub.publish("org/snap", "body1.safetensors", safetensors.torch.save(perturbed(replica, 0.25)))
    fake_hub.publish("org/snap", "body1.json", json.dumps({"step": 3}).encode())
    found = replica.load(state, 1, StateSources(snapshot=("org/snap", "main"), hf_endpoint=fake_hub.url),
                         lambda: None)
    assert found is not None and found.source == "hub:org/snap@main/body1.safetensors" and replica.local_step == 3
    # 37 steps behind, but no other worker holds body1: this one is the stage, so it does not sync.
    assert replica.begin(40) == SyncPhase.ACTIVE
    assert replica.worker.sync_phase == 0 and replica.averager.sharing


def test_without_any_source_the_seed_is_step_0_only(make_replica, run_id: str) -> None:
    fresh = make_replica(run_state(run_id, 0))
    assert fresh.load(run_state(run_id, 0), 1, StateSources(), lambda: None) is None and fresh.local_step == 0
    late = make_replica(run_state(run_id, 12), "tail")
    assert late.load(run_state(run_id, 12), 2, StateSources(), lambda: None) is None and late.local_step is None
    late.begin(12)
    assert late.local_step == 12  # alone in its stage: its parameters are the stage's


def test_a_stale_worker_with_a_peer_syncs_then_rejoins_sync_when_it_lags(make_replica, run_id: str,
                                                                         tmp_path: Path) -> None:
    state = run_state(run_id, 10)
    peer = make_replica(state)
    peer.load(dataclasses.replace(state, step=0), 1, StateSources(), lambda: None)
    peer.begin(0)
    peer.start()
    checkpoint = places(Checkpoint(CheckpointKind.Local, str(tmp_path), "epoch-0"))
    joiner = make_replica(dataclasses.replace(state, checkpoints=checkpoint))
    save_stage(tmp_path / "epoch-0", "body1", perturbed(joiner, 0.0), step=2)
    joiner.load(dataclasses.replace(state, checkpoints=checkpoint), 1, StateSources(), lambda: None)
    assert joiner.peers() == 1 and joiner.local_step == 2

    assert joiner.begin(10) == SyncPhase.WEIGHTS  # 8 steps behind, more than max_allowed_stale = 3
    assert joiner.worker.sync_phase == 1 and not joiner.averager.sharing
    assert not joiner.follow(11) and joiner.tracker.phase == SyncPhase.WEIGHTS
    assert not joiner.follow(12) and joiner.worker.sync_phase == 2 and not joiner.averager.sharing
    assert joiner.follow(15)  # phase 2 lasted its 3 steps: synced
    assert joiner.worker.sync_phase == 0 and joiner.averager.sharing and joiner.local_step == 15
    assert make_replica.lines[-1].startswith("[SYNC] Sync complete")  # type: ignore[attr-defined]

    joiner.step()  # one round stepped: it follows the swarm
    assert not joiner.follow(16) and joiner.tracker.phase == SyncPhase.ACTIVE
    assert not joiner.follow(20) and joiner.tracker.phase == SyncPhase.WEIGHTS  # missed 4 rounds: behind again
    assert joiner.worker.sync_phase == 1 and not joiner.averager.sharing


def test_a_stage_that_emptied_restarts_from_its_newest_snapshot_not_the_seed(make_replica, run_id: str,
                                                                              tmp_path: Path) -> None:
    """The epoch's checkpoint lacks body1 (its only worker died before Cooldown) and no peer holds it."""
    checkpoint = Checkpoint(CheckpointKind.Local, str(tmp_path / run_id), "epoch-0")
    state = run_state(run_id, 10, checkpoint, unsaved=(1,))
    replica = make_replica(state)
    seed = {k: v.clone() for k, v in replica.worker.compute.module.state_dict().items()}
    root = snapshot_root(tmp_path, run_id)
    save_snapshot(root, "body1", perturbed(replica, 0.5), 6)
    newest = perturbed(replica, 0.75)
    save_snapshot(root, "body1", newest, 8)
    save_snapshot(root, "body1", perturbed(replica, 1.0), 12)  # newer than the swarm: an earlier run's
    found = replica.load(state, 1, StateSources(snapshots=root), lambda: None)
    assert found is not None and found.step == 8 and replica.local_step == 8
    assert found.source == f"local:{root / 'step-8' / 'body1.safetensors'}"
    params = replica.worker.compute.module.state_dict()
    assert all(torch.equal(v, newest[k]) for k, v in params.items())
    assert not any(torch.equal(v, seed[k]) for k, v in params.items() if v.is_floating_point())
    assert replica.begin(10) == SyncPhase.ACTIVE  # alone: it is the stage, two steps behind the swarm


def test_a_restarted_worker_takes_its_snapshot_newer_than_the_epochs_checkpoint(make_replica, run_id: str,
                                                                              tmp_path: Path) -> None:
    """Stopped mid-epoch at step 14 after snapshotting, a worker restarts while the record still names the epoch's
    local checkpoint (step 10): it resumes from its own step 14, not four steps back. A snapshot older than the
    checkpoint still loses to it."""
    checkpoint = Checkpoint(CheckpointKind.Local, str(tmp_path / run_id), "epoch-1")
    state = run_state(run_id, 15, checkpoint)
    replica = make_replica(state)
    save_stage(tmp_path / run_id / "epoch-1", "body1", perturbed(replica, 0.25), step=10)
    root = snapshot_root(tmp_path, run_id)
    save_snapshot(root, "body1", perturbed(replica, 0.5), 8)
    found = replica.load(state, 1, StateSources(snapshots=root), lambda: None)
    assert found is not None and found.step == 10 and found.source.startswith(f"local:{tmp_path / run_id}/epoch-1")
    newest = perturbed(replica, 0.75)
    save_snapshot(root, "body1", newest, 14)
    found = replica.load(state, 1, StateSources(snapshots=root), lambda: None)
    assert found is not None and found.step == 14 and replica.local_step == 14
    assert all(torch.equal(v, newest[k]) for k, v in replica.worker.compute.module.state_dict().items())


def test_snapshots_are_ignored_at_step_0_and_a_broken_one_falls_back_to_the_next(make_replica, run_id: str,
                                                                                 tmp_path: Path) -> None:
    root = snapshot_root(tmp_path, run_id)
    replica = make_replica(run_state(run_id, 0))
    save_snapshot(root, "body1", perturbed(replica, 0.5), 3)
    assert replica.load(run_state(run_id, 0), 1, StateSources(snapshots=root), lambda: None) is None
    save_snapshot(root, "body1", perturbed(replica, 0.5), 4)
    (root / "step-4" / "body1.safetensors").write_bytes(b"not a state_dict")
    later = make_replica(run_state(run_id, 5))
    found = later.load(run_state(run_id, 5), 1, StateSources(snapshots=root), lambda: None)
    assert found is not None and found.step == 3


def test_each_step_takes_the_rate_the_runs_schedule_gives_it(make_replica, run_id: str) -> None:
    """Warmup then cosine decay: AdamW's first step moves every parameter by about the rate, so the move shows the
    rate the worker really used, step by step."""
    from coordinator_program.spec.schedule import learning_rate

    spec = parse_run_spec({**SPEC, "run_id": run_id, "model": {
        **SPEC["model"], "lr_schedule": "warmup_cosine", "warmup_steps": 4, "lr_floor": 0.001}})
    state = dataclasses.replace(run_state(run_id, 0), model=spec.model)
    for swarm_step in (0, 3, 4, 60, 99):
        replica = make_replica(state)
        compute = replica.worker.compute
        before = [p.detach().clone() for p in compute.parameters()]
        for param in compute.module.parameters():
            param.grad = torch.ones_like(param)
        compute.samples_accumulated = 1
        assert replica.step(swarm_step).applied
        moved = max(float((p - b).abs().max()) for p, b in zip(compute.parameters(), before, strict=True))
        expected = learning_rate(spec.model, spec.config.total_steps, swarm_step)
        assert moved == pytest.approx(expected, rel=0.05), swarm_step
    assert learning_rate(spec.model, 100, 0) == pytest.approx(0.0025)  # a quarter of the peak: the warmup's first


def test_a_later_run_of_the_same_id_does_not_see_the_earlier_runs_workers(make_replica, run_id: str) -> None:
    """Two runs named alike on one DHT (issue 21, 8): workers announce, average and donate under the run's instance
    (``derived.run_instance``), so a worker of the later run finds none of the earlier run's, whose own find each
    other. Under the bare run id, it counted them as its stage's peers and would have synced from them."""
    earlier = run_state(run_id, 9)
    later = dataclasses.replace(run_state(run_id, 9), created_at=earlier.created_at + 1)
    first, second, newcomer = make_replica(earlier), make_replica(earlier), make_replica(later)
    for replica in (first, second, newcomer):
        replica.start()
    wait_until(lambda: first.peers() == 1 and second.peers() == 1, what="the earlier run's workers to meet")
    assert newcomer.peers() == 0
    assert newcomer.worker.run_id != first.worker.run_id and newcomer.averager.prefix != first.averager.prefix


def test_sparta_replicas_weigh_alike_and_one_that_trained_nothing_adds_nothing(make_replica, run_id: str) -> None:
    """A SPARTA round weighs each replica that trained since the last one ``REPLICA_WEIGHT``, however many samples
    it processed, and one that trained nothing 0; no member may declare more (the averager's cap), so a member
    claiming the stage's batches since the last round (what the cap allowed while weights were samples) is
    refused like a malformed declaration."""
    state = run_state(run_id, 0)
    replicas = [make_replica(state) for _ in range(2)]
    for replica in replicas:
        replica.load(state, 1, StateSources(), lambda: None)
        replica.begin(0)
        replica.start()
    trained, idle = replicas
    wait_until(lambda: trained.peers() == 1 and idle.peers() == 1, timeout=20)
    compute = trained.worker.compute
    for param in compute.module.parameters():
        param.grad = torch.ones_like(param)
    compute.samples_accumulated = 6  # samples of the round's batch, as Backwards leave them
    assert trained.step(0).applied and trained.samples_since_average == 6
    idle.step(0)
    every = SPEC["model"]["sparta_every"]
    results = {}
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, r.average(every))) for r in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[trained].weight == REPLICA_WEIGHT and results[idle].weight == 0.0
    assert trained.samples_since_average == 0
    assert all(r.averager.max_weight == REPLICA_WEIGHT for r in replicas)


def test_a_joiner_loading_from_peers_takes_their_anchors(make_replica, run_id: str) -> None:
    """In an int4 run two replicas average both partitions, so each holds their anchors; a replica joining later
    loads its state from them and the anchors with it: it declares the same anchor as its donor for each
    partition, where without them it would declare none for a whole cycle (and its groups would send float32).
    A round one replica saw complete and the other partial (a part late under load: CI saw it once) leaves their
    anchors of that partition apart until it is averaged again, so rounds go on until both hold the same."""
    spec = {**SPEC, "run_id": run_id, "model": {**SPEC["model"], "grad_values": "int4"}}
    state = dataclasses.replace(run_state(run_id, 0), model=parse_run_spec(spec).model)
    replicas = [make_replica(state) for _ in range(2)]
    for replica in replicas:
        replica.load(state, 1, StateSources(), lambda: None)
        replica.begin(0)
        replica.start()
    wait_until(lambda: all(r.peers() == 1 for r in replicas), timeout=20)
    every = SPEC["model"]["sparta_every"]
    for completed in range(every, 7 * every, every):  # averaging rounds 1, 2, …: partitions 1, 0, …
        for replica in replicas:
            replica.samples_since_average = 4  # each trained since the last round, so each weighs REPLICA_WEIGHT
        results = at_once([functools.partial(r.average, completed) for r in replicas], timeout=60,
                          what="an averaging round")
        assert {result.status for result in results} == {AveragingStatus.AVERAGED}
        donors = [r.averager.averager.declared_anchor(p) for r in replicas for p in (0, 1)]
        if completed > every and "" not in donors and donors[:2] == donors[2:]:
            break
    assert "" not in donors and donors[:2] == donors[2:], donors

    later = dataclasses.replace(state, step=completed)
    joiner = make_replica(later)
    wait_until(lambda: joiner.peers() == 2, timeout=20)
    found = joiner.load(later, 1, StateSources(), lambda: None)
    assert found is not None and found.source == "peers"
    assert [joiner.averager.averager.declared_anchor(p) for p in (0, 1)] == donors[:2]


def test_a_replica_audits_at_its_run_s_rate(make_replica, run_id: str) -> None:
    """Both of a replica's averagers, SPARTA's and the gradients', audit each other reducer at the run's
    ``audit_rate``; a run that names none audits at the clients' own rate."""
    assert run_state(run_id, 0).model.audit_permille / 1000 == AUDIT_RATE
    spec = {**SPEC, "run_id": run_id, "model": {**SPEC["model"], "audit_rate": 0.6, "grad_averaging": "full"}}
    state = dataclasses.replace(run_state(run_id, 0), model=parse_run_spec(spec).model)
    replica = make_replica(state)
    assert replica.gradients is not None
    assert replica.averager.averager.audit_rate == replica.gradients.process.audit_rate == 0.6


def test_a_gossip_run_mixes_its_replicas_in_pairs_in_place_of_sparta_s_slices(make_replica, run_id: str,
                                                                               monkeypatch) -> None:
    """With ``gossip_rank`` set, the round due every ``sparta_every`` steps is PowerGossip's: two replicas that
    stepped on different gradients move by exactly opposite amounts (their sum kept, in int8 too), come closer, and
    report a round of the factors' bytes in the run's codec. SPARTA's averager, serving state only, keeps no anchors
    and never ranks an element for its partition."""
    ranked: list[str] = []
    monkeypatch.setattr(sparta, "element_ranks", lambda *args: ranked.append(args[1]) or element_ranks(*args))
    spec = {**SPEC, "run_id": run_id, "model": {**SPEC["model"], "gossip_rank": 2, "grad_values": "int8"}}
    state = dataclasses.replace(run_state(run_id, 0), model=parse_run_spec(spec).model)
    replicas = [make_replica(state) for _ in range(2)]
    for seed, replica in enumerate(replicas):
        replica.load(state, 1, StateSources(), lambda: None)
        replica.begin(0)
        replica.start()
        generator = torch.Generator().manual_seed(seed)
        compute = replica.worker.compute
        for param in compute.module.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        compute.samples_accumulated = 4
        assert replica.step(0).applied
    wait_until(lambda: all(r.peers() == 1 for r in replicas), timeout=20)
    params = [list(r.worker.compute.module.parameters()) for r in replicas]
    before = [[p.detach().clone() for p in ps] for ps in params]
    every = SPEC["model"]["sparta_every"]
    results = at_once([functools.partial(r.average, every) for r in replicas], timeout=60, what="a gossip round")
    assert [(r.status, r.group_size) for r in results] == [(AveragingStatus.AVERAGED, 2)] * 2, results
    assert all(r.delta_norm > 0 and r.elements > 0 and r.payload_values == GradValues.INT8 for r in results)
    whole = sum(4 * p.numel() for p in params[0])
    assert 0 < results[0].payload_bytes < whole / 2
    for first, second, was_first, was_second in zip(*params, *before, strict=True):
        torch.testing.assert_close(first + second, was_first + was_second, rtol=0, atol=1e-5)

    def apart(tensors: list[list[torch.Tensor]]) -> float:
        return sum(float((a - b).norm()) ** 2 for a, b in zip(*tensors, strict=True)) ** 0.5

    assert apart(params) < 0.95 * apart(before)  # rank 2 of random differences, an eighth of each vector
    assert ranked == [] and not any(r.averager.averager.anchors for r in replicas)
