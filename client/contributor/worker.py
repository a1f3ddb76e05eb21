"""The worker role: one pipeline stage, served to the epoch's trainers and kept in step with the swarm.

- Warmup: take the assigned stage (``client.join.stage_replica``: its state from a snapshot, the run's
  checkpoint, its peers or the run's seed; sync phases if that state is stale), serve it over gRPC and announce
  it in the DHT.
- RoundTrain: accept the round's samples only, each trainer's own share, sign each Backward's receipt for the round,
  and publish signed reports of the receipts issued, as they come. A report must list every receipt the worker
  signed for the round: the trainers hold them, and the witnesses charge an omission to the worker
  (``client.witness.judge``). The head and the tail also check the tokens they receive against the run's dataset,
  and publish accusations with the signed requests of the trainers whose tokens they refused (``accusing``); every
  worker accuses, with their own sealed declarations, the groupmates its averagers refused for a proven lie.
- Leaving RoundTrain: stop signing receipts for the round, report the last ones, apply the round's accumulated
  gradients (one optimizer step per round); every ``sparta_every`` steps average a SPARTA partition with the
  stage's other workers; every ``snapshot_every`` steps, if active, snapshot the stage for whoever takes it should
  it empty. Every step moves the sync phases on. After each step an active worker publishes its signed digest of
  its stage and compares it with the stage's majority (``agreement``: one that departs stops donating, and where
  replicas must be identical resynchronises or withdraws).
- Cooldown: save the stage to the checkpoint directory (or the Hub) and report it to the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from client.backends.base import BackendError
from client.contributor.accusing import false_declaration_accuser, wrong_data_accuser
from client.contributor.agreement import Agreement, Outcome
from client.contributor.context import ClientContext
from client.contributor.errors import ContributorRemoved
from client.contributor.rounds import RoundKey
from client.contributor.run_model import building_the_model, model_config, run_dataset
from client.contributor.tasks import poll
from client.join.checkpoints import revision_for, snapshot_root, upload_stage
from client.join.stage_replica import StageReplica, StateSources, stage_roster
from client.join.sync import SyncPhase
from client.pipeline.datacheck import TOKEN_FIELD, DataCheck
from client.pipeline.worker import StageWorker
from client.receipts import ReceiptRound
from client.stages import checkpoint_location, stage_name
from client.witness.digests import StageDigests
from client.witness.records import Report
from coordinator_program.spec import derived, limits
from coordinator_program.spec.config import CheckpointKind, GradAveraging
from coordinator_program.spec.errors import CheckpointTaken, CoordinatorError
from coordinator_program.spec.state import CoordinatorState, Phase, Role

log = logging.getLogger("psyswarm.client")


@dataclass(frozen=True)
class OpenRound:
    """The round in RoundTrain whose gradients the worker accumulates, and the swarm step they complete."""

    round: RoundKey
    step: int


@dataclass(frozen=True)
class Reported:
    """The last report the DHT took from this worker: its round, and how many receipts it listed."""

    round: RoundKey
    receipts: int


def round_shares(state: CoordinatorState) -> dict[str, tuple[int, int]]:
    """Each trainer's (hex key) samples in the round ``state`` trains, from the round's seed; none outside
    RoundTrain, where the next round's split is not known yet (a Backward then waits for this worker to see the
    round open: the trainer retries it)."""
    if state.phase != Phase.RoundTrain:
        return {}
    return {a.client.hex(): (a.start, a.end) for a in derived.data_assignment(state) if a.size}


def round_samples(state: CoordinatorState, step: int) -> tuple[int, int]:
    """(first sample, global batch) of the round that takes the swarm from ``step`` to ``step + 1`` steps: the
    coordinator starts each round's data at ``step * global_batch_size``."""
    batch = state.config.global_batch_size
    return step * batch, batch


class WorkerRole:
    """A contributor that holds one stage: what it does at each phase of the coordinator's state."""

    def __init__(self, context: ClientContext) -> None:
        self.context: ClientContext = context
        self.replica: StageReplica | None = None
        self.stage: int = limits.NO_STAGE  # the stage assigned at the last warmup
        self.followed_step: int | None = None  # the swarm step the sync phases last followed
        self.open_round: OpenRound | None = None
        self.round_receipts: list[str] = []  # hashes of the receipts issued in the open round
        self.reported: Reported | None = None
        self.saved_epoch: int | None = None  # the last epoch whose checkpoint this worker saved
        self.stepped: int | None = None  # the swarm steps the stage's parameters hold, once this worker stepped
        self.snapshotted: int | None = None  # the step of this worker's newest snapshot
        self.stepping = False  # an optimizer step is under way on a thread
        self.accuser = wrong_data_accuser(context)  # a head or tail worker's, against trainers that sent other data
        self.liars = false_declaration_accuser(context)  # against groupmates whose declarations proved a lie
        self.agreement: Agreement | None = None  # its stage's digests against its own, once it holds a stage

    @property
    def worker(self) -> StageWorker | None:
        """This client's stage worker, if it holds a stage."""
        return self.replica.worker if self.replica is not None else None

    @property
    def sync_phase(self) -> SyncPhase | None:
        """The worker's sync phase; None while it holds no stage."""
        return self.replica.tracker.phase if self.replica is not None else None

    def batches(self, state: CoordinatorState) -> int:
        """Microbatches served in the round under way: the receipts issued since it opened."""
        return len(self.round_receipts)

    def background(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """The loops this role keeps running: publishing the open round's receipts as they come."""
        return {"publishing receipts": lambda: poll(self.publish_open_round)}

    def stop_step(self) -> tuple[str, Callable[[], object]] | None:
        """The step of a clean leave this role owes: snapshotting what it trained since its last snapshot, so that
        its restart resumes at its step (``StageReplica`` loads the newest snapshot no newer than the swarm), then
        stopping the worker (its DHT record says it left)."""
        return ("saving the stage and stopping the worker", self._save_and_stop) if self.replica is not None else None

    def _save_and_stop(self) -> None:
        replica = self.replica
        assert replica is not None
        step = self.stepped
        if self.stepping:
            log.warning("stage %s: an optimizer step was under way, so it is not saved on leaving", replica.stage)
        elif step is not None and step != self.snapshotted and replica.tracker.shares_state:
            root = snapshot_root(self.context.options.checkpoint_dir.resolve(), self.context.state.run_id)
            try:
                replica.save_snapshot(root, step)
                log.info("stage %s saved at step %d under %s: a restart resumes from it", replica.stage, step, root)
            except OSError as exc:
                log.warning("could not save stage %s on leaving: %s", replica.stage, exc)
        replica.stop()

    # --- every state ------------------------------------------------------------------------------------

    async def follow(self, state: CoordinatorState) -> None:
        """Close a round the coordinator has left, and move the sync phases on with the swarm's step."""
        if self.open_round is not None and (state.phase != Phase.RoundTrain or
                                            RoundKey.of(state) != self.open_round.round):
            await self._close_round()
        if self.replica is not None and state.step != self.followed_step:
            self.followed_step = state.step
            await self._follow(state.step)

    async def _follow(self, step: int) -> None:
        """Move through the sync phases with the swarm's step; tell the auth service once synced."""
        assert self.replica is not None
        auth = self.context.options.auth
        if await asyncio.to_thread(self.replica.follow, step) and auth is not None:
            await asyncio.to_thread(auth.report_synced)

    # --- warmup -----------------------------------------------------------------------------------------

    def prepare(self, state: CoordinatorState, stage: int) -> None:
        """Take the stage: find its state, wait for the join queue, start syncing or active, serve it."""
        context, options = self.context, self.context.options
        name = stage_name(stage, state.config.num_stages)
        self.stage = stage
        if self.replica is not None and self.replica.stage == name:
            return  # a worker that stays keeps its live parameters: they are newer than any checkpoint
        if self.replica is not None:
            previous, self.replica = self.replica, None
            previous.stop()
        with building_the_model():
            config = model_config(state, hf_endpoint=options.hf_endpoint, hf_token=options.hf_token)
            data_check = (DataCheck(run_dataset(state, config, options), config.vocab, name)
                          if name in TOKEN_FIELD else None)
            replica = StageReplica.create(state, name, config, dht=context.dht, keypair=context.keypair,
                                          host=options.host, public_host=options.public_host,
                                          device=options.device, data_check=data_check,
                                          trainer_allowed=self._is_epoch_trainer,
                                          roster=lambda: stage_roster(self.context.state, stage),
                                          say=lambda line: print(line, flush=True))
        replica.worker.port = options.port  # not serving yet: it binds the port when it starts
        self.agreement = self._agreement(state, stage, replica)
        replica.worker.receipt_round = self._receipt_round
        self.stepped = self.snapshotted = None
        auth = options.auth
        sources = StateSources(snapshot=auth.snapshot if auth is not None else None,
                               snapshots=snapshot_root(options.checkpoint_dir.resolve(), state.run_id),
                               hf_token=options.hf_token, hf_endpoint=options.hf_endpoint)
        replica.load(state, stage, sources, self._training_step)
        replica.expect_samples(*round_samples(state, context.state.step), round_shares(context.state))
        if auth is not None:
            auth.wait_turn()
        swarm_step = context.state.step
        phase = replica.begin(swarm_step)
        replica.start()
        self.replica, self.followed_step = replica, swarm_step
        log.info("serving stage %s as %s at %s (%s)", name, replica.worker.uid, replica.worker.address,
                 "active" if not phase else f"sync phase {int(phase)}")
        if auth is not None and not phase:
            auth.report_synced()

    def _agreement(self, state: CoordinatorState, stage: int, replica: StageReplica) -> Agreement | None:
        """This worker's check of its digests against its stage's, and the digests a download of the stage must
        hash to (the stage's majority's for the steps around the swarm's); None without a board."""
        board = self.context.board
        if board is None:
            return None
        digests = StageDigests(board, stage,
                               lambda: {key.hex() for key in stage_roster(self.context.state, stage).members})

        def vouched() -> dict[int, str]:
            now = self.context.state
            return digests.vouched(now.epoch, range(max(now.step - 1, 0), now.step + 2))

        replica.vouched = vouched
        return Agreement(replica, digests, self.context.keypair, wait=float(max(state.config.round_witness_time, 1)),
                         enforced=state.model.grad_averaging != GradAveraging.Off)

    def _receipt_round(self) -> ReceiptRound | None:
        """The round the worker signs receipts for: the open one (None between rounds: Backwards are refused)."""
        opened, worker = self.open_round, self.worker
        if opened is None or worker is None:
            return None
        return ReceiptRound(worker.run_id, opened.round.epoch, opened.round.height)

    def _training_step(self) -> int | None:
        """The swarm's step while rounds run (averaging may be under way), None between epochs."""
        state = self.context.state
        return state.step if state.phase in (Phase.RoundTrain, Phase.RoundWitness) else None

    def _is_epoch_trainer(self, pubkey: bytes) -> bool:
        """Whether a trainer is one of the current epoch's (as the coordinator's state last said): the only
        trainers this client's worker serves, whose receipts the witnesses count (called from gRPC threads)."""
        state = self.context.state
        index = state.client_index(pubkey)
        return index is not None and state.clients[index].role == Role.Trainer

    # --- rounds -----------------------------------------------------------------------------------------

    def on_round(self, state: CoordinatorState) -> None:
        """RoundTrain: open the round, once, and accept its samples only."""
        key = RoundKey.of(state)
        if self.open_round is None or self.open_round.round != key:
            self.open_round, self.round_receipts = OpenRound(key, state.step), []
            if self.replica is not None:
                self.replica.expect_samples(*round_samples(state, state.step), round_shares(state))

    async def publish_open_round(self) -> None:
        """Publish the receipts of the round under way as they come."""
        if self.open_round is not None:
            await self.publish_receipts(self.open_round.round)

    async def publish_receipts(self, round_: RoundKey) -> None:
        """Publish a signed report of every receipt issued in ``round_`` so far, unless the DHT has it already."""
        context, worker, board = self.context, self.worker, self.context.board
        if worker is None or board is None:
            return
        self.round_receipts.extend(r.hash() for r in worker.drain_receipts())
        await self.accuser.publish(round_, worker.drain_accusations())
        if self.replica is not None:
            await self.liars.publish(round_, self.replica.drain_lies())
        if self.reported == Reported(round_, len(self.round_receipts)):
            return  # nothing new: the DHT already has this report (an empty one proves presence)
        report = Report.create(context.keypair, run_id=board.run_id, epoch=round_.epoch, round=round_.height,
                               stage=self.stage, uid=worker.uid, receipts=tuple(self.round_receipts))
        if await asyncio.to_thread(board.publish, report, context.keypair):
            self.reported = Reported(round_, len(self.round_receipts))

    async def _close_round(self) -> None:
        """The coordinator left RoundTrain: stop signing receipts for the round (the worker refuses Backwards until
        the next opens), publish the last ones and take this round's optimizer step, which holds the gradient of
        every receipt reported."""
        assert self.open_round is not None
        closing, self.open_round = self.open_round, None
        replica = self.replica
        if replica is None:
            return
        step = closing.step
        await asyncio.to_thread(replica.worker.close_round)
        await self.publish_receipts(closing.round)
        self.stepping = True  # until the step's thread returns, even if this task is cancelled meanwhile
        stats = await asyncio.to_thread(replica.step, step)
        self.stepping, self.stepped = False, step + 1
        if self.agreement is not None and self.agreement.replica is replica:
            self.agreement.doubt(step)
        # the next round's samples, each trainer's share once this worker sees it open
        replica.expect_samples(*round_samples(self.context.state, step + 1), round_shares(self.context.state))
        log.info("round %s: stepped on %d samples (grad norm %.3f)", closing.round, stats.samples, stats.grad_norm)
        if self._snapshot_due(replica, step + 1):
            self.snapshotted = step + 1
            self.context.tasks.spawn(self._save_snapshot(replica, step + 1))
        self.context.tasks.spawn(self._average_and_check(replica, closing.round.epoch, step + 1))

    async def _average_and_check(self, replica: StageReplica, epoch: int, completed_step: int) -> None:
        """The SPARTA round due after ``completed_step``, then the check of the state it leaves against the stage's
        majority (every replica digests the same state: after the step and its averaging round, if any)."""
        await self._average(replica, completed_step)
        if self.agreement is not None and self.agreement.replica is replica:
            await self._check_state(self.agreement, epoch, completed_step)

    async def _check_state(self, agreement: Agreement, epoch: int, step: int) -> None:
        """Compare this worker's state after ``step`` steps with its stage's majority (``agreement``); a worker that
        cannot stay in agreement withdraws (``ContributorRemoved`` ends the client)."""
        if await asyncio.to_thread(agreement.check, epoch, step) != Outcome.WITHDRAW:
            return
        with contextlib.suppress(CoordinatorError, BackendError):
            await self.context.backend.withdraw()
        raise ContributorRemoved(f"stage {agreement.replica.stage}: its state departed from its stage's majority "
                                 f"at step {step} and could not be brought back; withdrew from the run")

    def _snapshot_due(self, replica: StageReplica, step: int) -> bool:
        """Every ``snapshot_every`` steps, by active workers only: a syncing worker's state is not the stage's."""
        every = self.context.options.snapshot_every
        return every > 0 and step % every == 0 and replica.tracker.shares_state

    async def _save_snapshot(self, replica: StageReplica, step: int) -> None:
        """Snapshot the stage after ``step`` steps: if every worker of the stage dies, the epoch's checkpoint
        misses it and no peer holds it, and its next worker starts from here rather than from the run's seed."""
        root = snapshot_root(self.context.options.checkpoint_dir.resolve(), self.context.state.run_id)
        try:
            await asyncio.to_thread(replica.save_snapshot, root, step)
        except OSError as exc:  # a full disk: the stage keeps training, its next snapshot may fare better
            log.warning("could not snapshot stage %s at step %d: %s", replica.stage, step, exc)

    async def _average(self, replica: StageReplica, completed_step: int) -> None:
        """The SPARTA round due after ``completed_step``, if any; a worker whose rounds keep failing leaves
        (``ContributorRemoved`` ends the client)."""
        result = await asyncio.to_thread(replica.average, completed_step)
        if result is None or not result.remove:
            return
        with contextlib.suppress(CoordinatorError, BackendError):
            await self.context.backend.withdraw()
        raise ContributorRemoved(f"stage {replica.stage}: {result.consecutive_failures} averaging rounds failed "
                                 f"in a row (last: {result.reason}); withdrew from the run")

    # --- cooldown ---------------------------------------------------------------------------------------

    def on_cooldown(self, state: CoordinatorState) -> None:
        """Cooldown: save the stage, once per epoch."""
        if self.saved_epoch != state.epoch:
            self.saved_epoch = state.epoch
            self.context.tasks.spawn(self._save_checkpoint(state))

    async def _save_checkpoint(self, state: CoordinatorState) -> None:
        """Save this worker's stage (and upload it, for a Hub checkpoint), then report it to the coordinator."""
        replica, options = self.replica, self.context.options
        if replica is None:
            return
        revision = revision_for(state.epoch)
        directory = (options.checkpoint_dir / state.run_id).resolve() / revision
        try:
            files = await asyncio.to_thread(replica.save, directory, state.step)
            if options.hub_repo:
                await asyncio.to_thread(upload_stage, files, options.hub_repo, revision,
                                        token=options.hf_token, endpoint=options.hf_endpoint)
        except Exception as exc:  # a full disk or an unreachable Hub: peers still hold the model (P2P)
            log.warning("epoch %d: could not save stage %s: %s", state.epoch, replica.stage, exc)
            return
        kind, repo = ((CheckpointKind.Hub, options.hub_repo) if options.hub_repo
                      else (CheckpointKind.Local, str(directory.parent)))
        try:
            await self.context.backend.checkpoint(kind, repo, revision)
            log.info("epoch %d: stage %s saved to %s", state.epoch, replica.stage,
                     checkpoint_location(repo, revision, hub=kind == CheckpointKind.Hub))
        except CheckpointTaken as exc:  # another worker of the stage reported first: the stage is saved, there
            log.info("epoch %d: stage %s saved here too; joiners take the place reported first (%s)", state.epoch,
                     replica.stage, exc.detail)
        except CoordinatorError as exc:
            log.warning("checkpoint not recorded: %s", exc.detail)
