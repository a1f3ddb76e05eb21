"""A worker's place among its stage's replicas: the state it starts from, its sync phase, SPARTA averaging.

A contributor's worker role builds one ``StageReplica`` when it takes a stage. It carries out the worker's part of the
join flow (seeds/contributor-join-flow.txt) and of fault tolerance (seeds/fault-tolerance.txt):

- State: the first source that holds the stage, in order: the auth service's snapshot (the seed's periodic
  checkpoint), the stage's place in the run's checkpoint record (Hub or a local directory, reported by the stage's
  own workers), the newest of the stage's periodic snapshots on this machine (``client.join.checkpoints``: what a
  stage that emptied leaves behind), same-stage peers (hivemind state sharing, outside the join blocking window),
  and at step 0 the run's seed, which every worker shares.
- Sync: a state more than ``max_allowed_stale`` steps behind the swarm goes through phase 1 (invisible to
  trainers, averaging weight 0) and phase 2 (routed to, weight 0) before full participation — provided the
  stage has another worker to catch up with; a lone worker *is* its stage and starts active.
- Averaging: after each optimizer step whose number is a multiple of ``sparta_every``, one SPARTA partition
  with the stage's peers, every replica that trained since the last averaging round weighing ``REPLICA_WEIGHT``
  (0 while syncing or idle: it receives the average and adds nothing), the most any groupmate may claim.

Only an active worker serves its state to joiners, and only while its last digest agreed with its stage's majority
(``agrees``, ``client.witness.digests``); its sharing priority is the step its state belongs to, so joiners try the
freshest donor first. Where the stage's majority vouched for digests of recent steps (``vouched``), a joiner loads
only a state that hashes to one of them, at that digest's step, and so does a replica that ``resync``s.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from solders.keypair import Keypair

from client.averaging.gossip import GossipAverager
from client.averaging.gradients import GradAveraging, GradientAverager, GradientSettings
from client.averaging.membership import Roster
from client.averaging.sparta import AveragingResult, AveragingStatus, SpartaAverager, SpartaSettings, averaging_index
from client.averaging.values import GradValues
from client.join.checkpoints import (
    FileLimits,
    OptimizerState,
    named_optimizer_state,
    save_snapshot,
    save_stage,
    snapshot_dirs,
)
from client.join.state_download import (
    JoinWindow,
    StageState,
    StateDownloadError,
    download_from_hub,
    download_from_peers,
    load_local,
    load_stage_state,
    replica_tensors,
    saved_step,
    stage_identity,
    worker_state_provider,
)
from client.join.sync import SyncPhase, SyncPolicy, SyncTracker
from client.pipeline.datacheck import DataCheck
from client.pipeline.digests import state_digest
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.model import ModelSpec
from client.pipeline.optim import OptimizerConfig
from client.pipeline.wire import codec_name
from client.pipeline.worker import StageWorker, StepStats
from coordinator_program.spec.config import CheckpointKind
from coordinator_program.spec.derived import run_instance
from coordinator_program.spec.schedule import learning_rate
from coordinator_program.spec.state import CoordinatorState, Health, Role

log = logging.getLogger("psyswarm.replica")

PEER_DOWNLOAD_TIMEOUT = 120.0  # seconds a joiner tries same-stage donors before falling back


PERMILLE = 1000
"""DeMo's β and the audit rate are kept on chain in thousandths (``Model.demo_beta_permille``,
``Model.audit_permille``)."""


def sparta_settings(state: CoordinatorState) -> SpartaSettings:
    """Averaging rounds that fit the run: matchmaking waits up to about one RoundWitness (1-5 s) for the stage's
    peers, which leave RoundTrain within a state broadcast of each other (a round whose every member is seated
    begins at once: ``StageAverager``); each peer audits each other reducer at the run's ``audit_rate``."""
    wait = float(min(max(state.config.round_witness_time, 1), 5))
    return SpartaSettings(min_matchmaking_time=wait, request_timeout=wait / 2, matchmaking_timeout=wait + 4.0,
                          audit_rate=state.model.audit_permille / PERMILLE)


def stage_roster(state: CoordinatorState, stage: int) -> Roster:
    """The workers the coordinator lists for ``stage`` (its index) in the current epoch, healthy: the only peers
    this stage's averaging admits. One the health check marks leaves the roster at once. With them, the epoch's
    trainers (those a worker serves): only their signed Backwards credit a groupmate's gradient weight."""
    return Roster(state.epoch, frozenset(c.id for c in state.clients
                                         if c.role == Role.Worker and c.stage == stage and c.health == Health.Healthy),
                  frozenset(c.id for c in state.clients if c.role == Role.Trainer))


def optimizer_config(state: CoordinatorState) -> OptimizerConfig:
    """The run's optimizer: its learning rate, and whether each replica steps Adam on the whole batch's estimated
    second moment (``whole_batch_moment``: ``client.pipeline.optim.BatchMoment``)."""
    whole_batch = state.config.global_batch_size if state.model.whole_batch_moment else 0
    return OptimizerConfig(lr=state.model.learning_rate_micros / 1e6, whole_batch=whole_batch)


def averaged_values(state: CoordinatorState) -> GradValues:
    """How the run's averaged values travel (``grad_values``): its gradients, and SPARTA's parameter changes."""
    return GradValues(state.model.grad_values.name.lower())  # the spec's Float16: float16, and so on


def gradient_settings(state: CoordinatorState) -> GradientSettings | None:
    """How the run's model says a stage averages its gradients (``grad_averaging`` with its mode's settings, which
    the coordinator keeps 0 for every other mode), or None if it does not. It shares SPARTA's timeouts; no peer may
    claim more samples than a round's global batch, nor average with more than its trainer-signed Backwards of the
    round prove (``client.averaging.work``)."""
    model = state.model
    mode = GradAveraging(model.grad_averaging.name.lower())  # the spec's PowerSGD and DeMo: powersgd and demo
    if mode == GradAveraging.OFF:
        return None
    return GradientSettings(mode, rank=model.powersgd_rank, chunk=model.demo_chunk, topk=model.demo_topk,
                            beta=model.demo_beta_permille / PERMILLE,
                            values=averaged_values(state),
                            timeouts=sparta_settings(state),
                            max_weight=float(state.config.global_batch_size),
                            round_samples=state.config.global_batch_size)


def gradient_averager(state: CoordinatorState, worker: StageWorker, dht,
                      roster: Callable[[], Roster]) -> GradientAverager | None:
    """The worker's per-step gradient averager if the run averages gradients (``gradient_settings``), else None."""
    settings = gradient_settings(state)
    if settings is None:
        return None
    return GradientAverager.for_worker(worker, dht, seed=state.model.init_seed, settings=settings, roster=roster)


def gossip_averager(state: CoordinatorState, worker: StageWorker, dht,
                    roster: Callable[[], Roster]) -> GossipAverager | None:
    """The worker's PowerGossip averager if the run mixes its replicas by it (``gossip_rank``) in place of SPARTA's
    slices, else None: at that rank, in the run's codec, with SPARTA's timeouts."""
    if not state.model.gossip_rank:
        return None
    settings = GradientSettings(GradAveraging.POWERSGD, rank=state.model.gossip_rank, values=averaged_values(state),
                                timeouts=sparta_settings(state))
    return GossipAverager.for_worker(worker, dht, seed=state.model.init_seed, settings=settings, roster=roster)


REPLICA_WEIGHT = 1.0
"""What a replica that trained since the last SPARTA round weighs in it, and the most any groupmate may declare.
SPARTA averages parameters, each replica's a model in its own right, and the method's mean weighs them alike;
weighing each by the samples it processed would let a member claim a stage's worth of batches nobody can check
(it takes part in no round's evidence: SPARTA's weight covers ``sparta_every`` steps). Alike, a liar's pull is
one member's share, 1/2 in a pair and at most the median's share from three on, whatever it claims."""


@dataclass(frozen=True)
class StateSources:
    """Where a worker taking a stage may find its state, besides the run's checkpoint and its peers."""

    snapshot: tuple[str, str] | None = None  # (Hub repo, revision) the auth service's grant names
    snapshots: Path | None = None  # this machine's periodic snapshots of the run (``checkpoints.snapshot_root``)
    hf_token: str | None = None
    hf_endpoint: str | None = None


class StageReplica:
    """One worker of a stage with its averager and its sync tracker."""

    def __init__(self, worker: StageWorker, averager: SpartaAverager, tracker: SyncTracker,
                 directory: WorkerDirectory, *, every: int, gradients: GradientAverager | None = None,
                 learning_rate: Callable[[int], float] | None = None, gossip: GossipAverager | None = None) -> None:
        """``gossip``: the run's PowerGossip averager, whose rounds replace SPARTA's (whose averager still serves
        state to joiners)."""
        self.worker, self.averager, self.tracker, self.directory = worker, averager, tracker, directory
        self.gossip = gossip
        self.every = every
        self.learning_rate = learning_rate  # the run's schedule: the rate of each swarm step
        self.gradients = gradients
        self.gradient_round = 0  # the swarm step whose gradients the next optimizer step averages
        if gradients is not None:  # sync-phase workers average with weight 0: they receive and add nothing
            worker.compute.optimizer.gradient_exchange = gradients.exchange(
                lambda: self.gradient_round, lambda samples: self.tracker.averaging_weight(float(samples)),
                self.peers, lambda: worker.compute.work)
        self.local_step: int | None = None  # the swarm step this worker's parameters belong to
        self.samples_since_average = 0
        self.agrees = True  # whether its last digest agreed with the stage's majority (or there was none)
        self.vouched: Callable[[], Mapping[int, str]] | None = None  # recent steps' majority digests, if known

    @classmethod
    def create(cls, state: CoordinatorState, stage: str, config: ModelSpec, *, dht, keypair: Keypair, host: str,
               trainer_allowed: Callable[[bytes], bool], roster: Callable[[], Roster], public_host: str | None = None,
               say: Callable[[str], None] = print, device: str = "cpu",
               data_check: DataCheck | None = None) -> StageReplica:
        """Build the worker of ``stage`` of the run's model ``config`` (not serving yet) and its averager: the
        averager forks hivemind's process, which is safest before the worker's gRPC server starts its threads. The
        worker serves the trainers for which ``trainer_allowed`` (a public key) is true and averages with the
        workers ``roster`` lists (``stage_roster`` of the coordinator's current state); ``ModelSourceError``
        when its stage cannot be built as the run names it. ``data_check``: the head's or tail's check of the
        tokens it receives against the run's dataset. Trainers reach the worker at ``public_host`` (``addresses``),
        ``host`` by default."""
        namespace = run_instance(state)  # this run's workers, averaging groups and donors, apart from any earlier run
        worker = StageWorker(config, stage, keypair=keypair, dht=dht, run_id=namespace, host=host,
                             public_host=public_host, trainer_allowed=trainer_allowed, device=device,
                             data_check=data_check, wire_codec=codec_name(state.model.wire_codec),
                             optimizer=optimizer_config(state))
        replica: StageReplica  # bound below; the provider only runs once sharing is on, long after
        averager = SpartaAverager.for_worker(
            worker, dht, partitions=state.model.sparta_partitions, seed=state.model.init_seed,
            roster=roster, settings=sparta_settings(state), serving_only=bool(state.model.gossip_rank),
            state_provider=worker_state_provider(worker, lambda: replica.local_step or 0),
            max_weight=REPLICA_WEIGHT, values=averaged_values(state))
        replica = cls(worker, averager, SyncTracker(SyncPolicy.from_model(state.model), say=say),
                      WorkerDirectory(dht, namespace, config.fingerprint()), every=state.model.sparta_every,
                      gradients=gradient_averager(state, worker, dht, roster),
                      learning_rate=functools.partial(learning_rate, state.model, state.config.total_steps),
                      gossip=gossip_averager(state, worker, dht, roster))
        return replica

    @property
    def stage(self) -> str:
        return self.worker.stage

    def peers(self) -> int:
        """Other workers of this stage announced in the DHT, whatever their phase."""
        return sum(1 for r in self.directory.records(self.stage) if r.uid != self.worker.uid)

    # ----- the state a worker starts from -----

    def load(self, state: CoordinatorState, stage_index: int, sources: StateSources,
             swarm_step: Callable[[], int | None]) -> StageState | None:
        """Load the first state that holds this stage; returns it (None: the run's seed, as built)."""
        found = self._find_state(state, stage_index, sources, swarm_step)
        if found is None:
            self.local_step = 0 if state.step == 0 else None  # the seed is step 0's model, and only step 0's
            log.info("stage %s starts from the run's seed (step %s)", self.stage,
                     "0" if self.local_step == 0 else f"unknown: the swarm is at step {state.step}")
            return None
        self._take(found)
        log.info("stage %s loaded from %s (step %s; the swarm is at step %d)", self.stage, found.source,
                 "unknown" if found.step is None else found.step, state.step)
        return found

    def _find_state(self, state: CoordinatorState, stage_index: int, sources: StateSources,
                    swarm_step: Callable[[], int | None]) -> StageState | None:
        checkpoint = state.checkpoints[stage_index]  # this stage's place: only its own workers report it
        limits = FileLimits.of(self.worker.compute.module)
        attempts: list[tuple[str, Callable[[], StageState | None]]] = []
        if sources.snapshot is not None:
            repo, revision = sources.snapshot
            attempts.append((f"the auth service's snapshot {repo}@{revision}", lambda: download_from_hub(
                repo, self.stage, limits=limits, revision=revision, endpoint=sources.hf_endpoint,
                token=sources.hf_token)))
        if checkpoint.kind == CheckpointKind.Hub:
            attempts.append((f"the run's checkpoint {checkpoint.repo}@{checkpoint.revision}", lambda: download_from_hub(
                checkpoint.repo, self.stage, limits=limits, revision=checkpoint.revision or None,
                endpoint=sources.hf_endpoint, token=sources.hf_token)))
        local_dir = Path(checkpoint.repo) / checkpoint.revision
        local = (f"the local checkpoint {checkpoint.repo}/{checkpoint.revision}",
                 lambda: load_local(local_dir, self.stage, limits))
        snapshots: list[tuple[str, Callable[[], StageState | None]]] = []
        if sources.snapshots is not None and state.step > 0:  # at step 0 the seed is the state; any snapshot is older
            root = sources.snapshots
            snapshots.append((f"the snapshots in {root}", lambda: self._newest_snapshot(root, state.step, limits)))
        if checkpoint.kind == CheckpointKind.Local:
            # Both on this disk: a worker restarted within the epoch holds snapshots newer than the epoch's start.
            newer = snapshots and self._snapshot_step(sources.snapshots, state.step) > (
                saved_step(local_dir, self.stage) or -1)
            attempts.extend([*snapshots, local] if newer else [local, *snapshots])
        else:
            attempts.extend(snapshots)
        if state.step > 0 and self.peers():  # at step 0 every peer holds the seed's model: nothing to fetch
            attempts.append(("same-stage peers", lambda: self._from_peers(state, swarm_step)))
        if checkpoint.kind == CheckpointKind.P2P and checkpoint.repo:  # the last saved copy, if it is on this disk
            attempts.append(local)
        for what, attempt in attempts:
            try:
                found = attempt()
            except StateDownloadError as exc:
                log.warning("stage %s: nothing usable from %s: %s", self.stage, what, exc)
                continue
            if found is not None:
                return found
        return None

    def _snapshot_step(self, root: Path | None, swarm_step: int) -> int:
        """The step of this stage's newest snapshot no newer than the swarm; -1 if none."""
        steps = [step for step, _ in snapshot_dirs(root, self.stage) if step <= swarm_step] if root else []
        return max(steps, default=-1)

    def _newest_snapshot(self, root: Path, swarm_step: int, limits: FileLimits) -> StageState | None:
        """The newest readable snapshot of this stage no newer than the swarm (one newer is left by an earlier run
        under the same id)."""
        for step, directory in snapshot_dirs(root, self.stage):
            if step > swarm_step:
                continue
            try:
                return load_local(directory, self.stage, limits)
            except StateDownloadError as exc:
                log.warning("stage %s: skipping the snapshot of step %d: %s", self.stage, step, exc)
        return None

    def _from_peers(self, state: CoordinatorState, swarm_step: Callable[[], int | None]) -> StageState:
        JoinWindow(self.every).wait(swarm_step)
        return self._download(self.vouched() if self.vouched is not None else {})

    def _download(self, vouched: Mapping[int, str], timeout: float = PEER_DOWNLOAD_TIMEOUT) -> StageState:
        identity = stage_identity(self.worker.run_id, self.stage, self.worker.config.fingerprint())
        return download_from_peers(self.averager, self.worker.compute.module, identity, timeout=timeout,
                                   vouched=vouched)

    # ----- agreeing with the stage -----

    def digest(self) -> str:
        """The digest of this worker's stage state as it stands (``client.pipeline.digests``), taken between tasks."""
        compute = self.worker.compute
        with compute.lock:
            return state_digest(replica_tensors(compute.module, compute.optimizer.optimizer))

    def agree(self, agrees: bool) -> None:
        """Record whether this worker's last digest agreed with its stage's majority: one that departs stops
        serving its state to joiners at once, and serves again once it agrees."""
        self.agrees = agrees
        self._apply_phase()

    def resync(self, vouched: Mapping[int, str], timeout: float = PEER_DOWNLOAD_TIMEOUT) -> int:
        """Replace this worker's state (parameters and optimizer moments: ``replica_tensors``) by one its stage's
        majority vouched for (``vouched``: step → digest), downloaded from a donor that serves one; returns that
        state's step. ``StateDownloadError`` if no donor serves such a state."""
        found = self._download(vouched, timeout)
        if found.step is None:
            raise StateDownloadError("no donor served a state its stage's majority vouched for")
        self._take(found)
        return found.step

    def _take(self, found: StageState) -> None:
        """Load ``found`` into the worker, and the SPARTA anchors its donor served with it into the averager: with
        them this worker's first slices travel in the run's codec instead of float32 (``client.averaging.anchored``).
        PowerGossip's own change starts again from the state loaded: loading is no training a partner may match."""
        compute = self.worker.compute
        load_stage_state(compute.module, found, compute.lock, compute.optimizer.optimizer)
        self.local_step = found.step
        if self.gossip is not None:
            with compute.lock:
                self.gossip.start_from(self._trainable())
        if found.anchors is not None and self.averager.install_anchors(found.anchors):
            log.info("stage %s took its donor's anchors for %d of %d partitions", self.stage,
                     len(found.anchors.partitions), self.averager.masks.partitions)

    # ----- sync phases -----

    def begin(self, swarm_step: int) -> SyncPhase:
        """Decide whether this worker syncs, before it starts serving (its first DHT record shows the phase)."""
        if self.peers():
            self.tracker.begin(swarm_step, self.local_step)
        elif self.local_step is None:
            self.local_step = swarm_step  # alone, it is the stage: its parameters are the stage's by definition
        self._apply_phase()
        return self.tracker.phase

    def start(self) -> None:
        self.worker.start()

    def follow(self, swarm_step: int) -> bool:
        """Track the swarm's step: move through the sync phases, or re-enter sync after lagging behind the
        stage. Returns True when this call completed the sync (the caller tells the auth service)."""
        before = self.tracker.phase
        if before != SyncPhase.ACTIVE:
            self.tracker.advance(swarm_step)
        elif self.tracker.policy.is_stale(self.local_step, swarm_step) and self.peers():  # the DHT only if behind
            self.tracker.enter(swarm_step)
        completed = before != SyncPhase.ACTIVE and self.tracker.phase == SyncPhase.ACTIVE
        if completed:
            self.local_step = swarm_step  # synchronised: its parameters are the swarm's now
        self._apply_phase()
        return completed

    def _apply_phase(self) -> None:
        if self.worker.sync_phase != int(self.tracker.phase):
            self.worker.sync_phase = int(self.tracker.phase)  # re-announces the DHT record at once
        self.averager.sharing = self.tracker.shares_state and self.agrees
        if self.tracker.shares_state and self.local_step is not None:
            self.averager.set_sharing_priority(self.local_step)

    # ----- rounds -----

    def _checkpoint(self) -> tuple[dict[str, torch.Tensor], OptimizerState]:
        """Copies of the parameters and the optimizer state on the CPU, taken together between tasks."""
        compute = self.worker.compute
        with compute.lock:
            tensors = {k: v.detach().to("cpu", copy=True) for k, v in compute.module.state_dict().items()}
            return tensors, named_optimizer_state(compute.module, compute.optimizer.optimizer)

    def save(self, directory: Path, step: int) -> list[Path]:
        """Save the stage (parameters and optimizer state) as it stands after ``step`` swarm steps: a checkpoint."""
        tensors, optimizer = self._checkpoint()
        return save_stage(directory, self.stage, tensors, step, optimizer)

    def save_snapshot(self, root: Path, step: int) -> list[Path]:
        """Save the stage as it stands after ``step`` swarm steps among the run's snapshots under ``root``."""
        tensors, optimizer = self._checkpoint()
        return save_snapshot(root, self.stage, tensors, step, optimizer)

    def expect_samples(self, round_start: int, global_batch: int,
                       shares: Mapping[str, tuple[int, int]] | None = None) -> None:
        """The worker's next step accumulates the round's global batch, the ``global_batch`` samples from
        ``round_start``, and no others: a microbatch of a round that is over counts nowhere. With ``shares``
        (trainer key, hex → its samples) each trainer's Backwards must lie in its own share."""
        self.worker.ledger.expect_samples(round_start, round_start + global_batch, shares)

    def step(self, swarm_step: int | None = None) -> StepStats:
        """The optimizer step of a finished round, the swarm's ``swarm_step``, at the rate the run's schedule
        gives that step (its gradients are averaged with the stage's peers of that round first, if the run
        averages gradients)."""
        if swarm_step is not None:
            self.gradient_round = swarm_step
            if self.learning_rate is not None:
                self.worker.compute.optimizer.set_learning_rate(self.learning_rate(swarm_step))
        stats = self.worker.step()
        self.samples_since_average += stats.samples
        if self.local_step is not None:
            self.local_step += 1
        return stats

    def average(self, completed_step: int) -> AveragingResult | None:
        """Run the SPARTA (or PowerGossip) round due once the swarm completed ``completed_step`` steps, if any."""
        index = averaging_index(completed_step, self.every)
        if index is None:
            return None
        weight = self.tracker.averaging_weight(REPLICA_WEIGHT if self.samples_since_average else 0.0)
        self.samples_since_average = 0
        peers = self.peers()
        with self.worker.batches_held():  # averaging happens outside training, even when it outlasts RoundWitness
            result = self.averager.average(index, weight, peers=peers) if self.gossip is None else self._mix(
                index, peers)
        if result.status == AveragingStatus.FAILED and result.remove:
            log.error("stage %s: %d averaging rounds in a row failed", self.stage, result.consecutive_failures)
        return result

    def _mix(self, index: int, peers: int) -> AveragingResult:
        """PowerGossip's round ``index`` with one same-stage peer. A syncing worker sits it out: pair members weigh
        alike, and a stale model would pull its partner as far as a current one."""
        gossip = self.gossip
        assert gossip is not None
        return gossip.report(gossip.mix(self._trainable(), index, peers=peers if self.tracker.shares_state else 0,
                                         lock=self.worker.compute.lock))

    def _trainable(self) -> list[torch.Tensor]:
        """The stage's trainable parameters, in the order its averagers were built with."""
        return [p for p in self.worker.compute.module.parameters() if p.requires_grad]

    def drain_lies(self) -> list[dict[str, object]]:
        """The proven lies this replica's averagers found since the last drain (``StageAverager.drain_lies``: refused
        declarations, false reductions), to publish as accusations."""
        lies = self.averager.averager.drain_lies()
        for other in (self.gradients, self.gossip):
            lies += other.process.drain_lies() if other is not None else []
        return lies

    def stop(self) -> None:
        self.worker.stop()
        self.averager.shutdown()
        for other in (self.gradients, self.gossip):
            if other is not None:
                other.shutdown()
