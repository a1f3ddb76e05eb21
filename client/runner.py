"""The contributor's client: it follows the coordinator's phases and does what each one asks.

- WaitingForMembers: make sure this identity is queued (joining again if it was dropped).
- Warmup: load the model — a worker takes its assigned stage (``client.join.stage_replica``: its state from a
  snapshot, the run's checkpoint, its peers or the run's seed; sync phases if that state is stale), serves
  it over gRPC and announces it in the DHT; a trainer opens the dataset — then publish a signed Ready.
- RoundTrain: a trainer runs its share of the global batch (from the round seed) through the pipeline and
  publishes a signed commitment; a worker publishes signed reports of the receipts it issued. Elected
  witnesses check the records and send their proof as soon as every batch is in (opportunistic), or at
  RoundWitness with what they have; they also health-check clients the previous round's witnesses missed.
- Leaving RoundTrain: workers apply their accumulated gradients (one optimizer step per round); every
  ``sparta_every`` steps each stage then averages a SPARTA partition among its workers during RoundWitness;
  a round that outlasts it holds the next round's batches until it is done, so the two never compete.
- Cooldown: workers save their stage to the checkpoint directory and report it.

The backend (TCP server or Solana program) is behind ``client.coordinator.backend.Backend``, so this runs
unchanged on either. Blocking work (torch, the DHT, averaging) runs in threads so the state keeps flowing.
With an auth service (``client.join.auth``), the slot is renewed while the client runs, a joiner waits its
turn in the join queue before it syncs, and it reports when it has synced.

May import: coordinator_program, client.identity, client.stages, client.coordinator, client.witness,
client.pipeline, client.join.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from solders.keypair import Keypair

from client.coordinator.backend import Backend, BackendError
from client.coordinator.ticker import tick_when_due
from client.join.auth import AuthError, AuthSession
from client.join.checkpoints import revision_for, save_stage, upload_stage
from client.join.stage_replica import StageReplica, StateSources, model_config
from client.stages import stage_name
from client.witness.judge import judge_round, judge_warmup, unhealthy_clients
from client.witness.records import Board, Commitment, Ready, Report, receipt_hash
from coordinator_program import limits, rules
from coordinator_program.config import CheckpointKind
from coordinator_program.errors import CoordinatorError
from coordinator_program.state import CoordinatorState, Phase, Role

log = logging.getLogger("psyswarm.client")

POLL_INTERVAL = 0.5
QUEUE_LOG_PERIOD = 30.0
SUPERVISOR_BACKOFF = (0.5, 5.0)
"""Seconds a failed background loop waits before it restarts: the first wait, and the longest."""


@dataclasses.dataclass
class RunnerOptions:
    role: Role
    initial_peers: list[str]
    stage: int = limits.NO_STAGE
    checkpoint_dir: Path = Path("checkpoints")
    host: str = "127.0.0.1"
    wire_dtype: str = "float32"
    hub_repo: str | None = None  # save checkpoints to this Hugging Face repo rather than checkpoint_dir
    hf_token: str | None = None
    hf_endpoint: str | None = None
    auth: AuthSession | None = None  # the slot granted by the run's auth service, if it has one


class Contributor:
    """One client process: a stage worker or a trainer, driven by the coordinator's state."""

    def __init__(self, backend: Backend, keypair: Keypair, options: RunnerOptions) -> None:
        self.backend, self.keypair, self.options = backend, keypair, options
        self.me = bytes(keypair.pubkey())
        self.dht = None
        self.board: Board | None = None
        self.replica: StageReplica | None = None
        self.trainer = None
        self.prepared_epoch: int | None = None
        self.open_round: tuple[int, int, int] | None = None  # (epoch, height, step) whose gradients accumulate
        self.followed_step: int | None = None  # the swarm step the sync phases last followed
        self.removed: str | None = None  # why this client left the run of its own accord
        self.round_receipts: list[str] = []
        self.reported: tuple[int, int, int] | None = None  # (epoch, round, receipts) last published
        self.stage = limits.NO_STAGE
        self.training = asyncio.Lock()
        self.trained: set[tuple[int, int]] = set()
        self.proved: set[tuple[int, int, bool]] = set()
        self.health_checked: set[tuple[int, int]] = set()
        self.saved_epoch: int | None = None
        self.joining = False
        self.queue_logged = -QUEUE_LOG_PERIOD
        self._tasks: set[asyncio.Task] = set()

    # --- lifecycle ------------------------------------------------------------------------------------

    async def run(self, reconnect: Callable[[], Awaitable[Backend]] | None = None,
                  max_outage: float = 600.0) -> None:
        """Follow the run until it finishes (or the task is cancelled).

        If the coordinator goes away (a restart, a network cut) and ``reconnect`` is given, keep serving and
        reconnect with backoff for up to ``max_outage`` seconds: the run resumes where the coordinator left it.
        """
        from client.pipeline.discovery import start_dht

        self.dht = await asyncio.to_thread(start_dht, self.options.initial_peers, self.options.host)
        self.board = Board(self.dht, self.backend.state.run_id)
        self.start_background()
        try:
            while True:
                try:
                    async for state in self.backend.updates():
                        await self.on_state(state)
                        if state.phase == Phase.Finished:
                            log.info("the run has finished after %d steps", state.step)
                            return
                        if self.removed is not None:
                            raise ContributorRemoved(self.removed)
                except BackendError as exc:
                    if reconnect is None:
                        raise
                    log.warning("lost the coordinator (%s); reconnecting", exc)
                    self.backend = await self._reconnect(reconnect, max_outage)
        finally:
            await self.shutdown()

    async def _reconnect(self, reconnect: Callable[[], Awaitable[Backend]], max_outage: float) -> Backend:
        deadline = time.monotonic() + max_outage
        delay = 0.5
        while True:
            try:
                backend = await reconnect()
            except BackendError as exc:
                if time.monotonic() + delay > deadline:
                    raise BackendError(f"the coordinator stayed unreachable for {max_outage:.0f} s: {exc}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            log.info("reconnected to the coordinator: %s, epoch %d, step %d", backend.state.phase.name,
                     backend.state.epoch, backend.state.step)
            return backend

    async def shutdown(self) -> None:
        self.stop_background()
        if self.replica is not None:
            await asyncio.to_thread(self.replica.stop)
        if self.trainer is not None:
            self.trainer.close()
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
        if self.options.auth is not None:
            with contextlib.suppress(AuthError):
                await asyncio.to_thread(self.options.auth.client.leave)

    @property
    def worker(self):
        """This client's stage worker, if it holds a stage."""
        return self.replica.worker if self.replica is not None else None

    def _spawn(self, coro, name: str | None = None) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work %s failed (%s): %r", task.get_name(), self._where(), task.exception(),
                      exc_info=task.exception())

    def start_background(self) -> None:
        """Start the loops that run for the client's whole life, each supervised on its own: a failure in one
        (witnessing a peer's records, say) never stops another (publishing this client's own reports)."""
        self._supervise("publishing receipts", lambda: self._poll(self._publish_open_round))
        self._supervise("witnessing", lambda: self._poll(self._witness_current))
        if not self.backend.ticks_itself:
            self._supervise("ticking", lambda: tick_when_due(lambda: self.backend))
        if self.options.auth is not None:
            auth = self.options.auth
            self._supervise("renewing the slot", lambda: self._renew_slot(auth))

    def stop_background(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def _supervise(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        self._spawn(self._supervised(name, loop), name)

    async def _supervised(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run ``loop`` until it returns; if it raises, log why, with where the run stood, and restart it after
        a backoff that grows while it keeps failing quickly."""
        first, longest = SUPERVISOR_BACKOFF
        delay = first / 2
        while True:
            started = time.monotonic()
            try:
                await loop()
                return
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure; the log says what it was
                delay = first if time.monotonic() - started > longest else min(delay * 2, longest)
                log.exception("%s failed (%s); restarting it in %.1f s", name, self._where(), delay)
            await asyncio.sleep(delay)

    def _where(self) -> str:
        """Where the run stands, for logs."""
        try:
            state = self.backend.state
        except BackendError:
            return "no coordinator state"
        return f"{state.phase.name}, epoch {state.epoch}, round {state.round.height}"

    # --- reacting to the state ------------------------------------------------------------------------

    async def on_state(self, state: CoordinatorState) -> None:
        if self.removed is not None:
            return  # leaving: neither rejoin nor act in the run any more
        index = state.client_index(self.me)
        if self.open_round is not None and (state.phase != Phase.RoundTrain or
                                            (state.epoch, state.round.height) != self.open_round[:2]):
            await self._close_round()
        if self.replica is not None and state.step != self.followed_step:
            self.followed_step = state.step
            await self._follow(state.step)
        if index is None:
            position = state.pending_index(self.me)
            if position is None and state.phase not in (Phase.Finished, Phase.Uninitialized):
                self._spawn(self._join(state))
            elif position is not None:
                self._report_queue(state, position)
            return
        client = state.clients[index]
        if state.phase in (Phase.Warmup, Phase.RoundTrain) and self.prepared_epoch != state.epoch:
            self.prepared_epoch = state.epoch
            self._spawn(self._prepare(state, client.stage))
        if state.phase == Phase.RoundTrain:
            await self._on_round(state, client.role)
        if state.phase == Phase.Cooldown and client.role == Role.Worker and self.saved_epoch != state.epoch:
            self.saved_epoch = state.epoch
            self._spawn(self._save_checkpoint(state, client.stage))

    def _report_queue(self, state: CoordinatorState, position: int) -> None:
        """While queued, say where this client stands, at most every QUEUE_LOG_PERIOD seconds."""
        now = time.monotonic()
        if now - self.queue_logged < QUEUE_LOG_PERIOD:
            return
        self.queue_logged = now
        if state.phase == Phase.WaitingForMembers:
            short = max(0, state.config.min_clients - len(state.pending))
            why = f"{short} more client(s) needed to start" if short else "waiting for every stage to have a worker"
        else:
            why = f"admitted when the run next waits for members (now {state.phase.name}, epoch {state.epoch})"
        log.info("queued: position %d of %d; %s", position + 1, len(state.pending), why)

    async def _join(self, state: CoordinatorState) -> None:
        if self.joining:
            return
        self.joining = True
        try:
            await self.backend.join(self.options.role, self.options.stage)
            log.info("joined run %s as a %s; waiting to be admitted", state.run_id, self.options.role.name.lower())
        except CoordinatorError as exc:
            log.warning("could not join: %s", exc.detail)
            await asyncio.sleep(5)
        finally:
            self.joining = False

    async def _on_round(self, state: CoordinatorState, role: Role) -> None:
        key = (state.epoch, state.round.height)
        if role == Role.Worker and (self.open_round is None or self.open_round[:2] != key):
            self.open_round, self.round_receipts = (*key, state.step), []
        if role == Role.Trainer and key not in self.trained:
            self.trained.add(key)
            self._spawn(self._train(state))
        if key not in self.health_checked and self.me in rules.witnesses(state):
            self.health_checked.add(key)
            for target in unhealthy_clients(state):
                with contextlib.suppress(CoordinatorError):
                    await self.backend.health_check(target)
                    log.info("health check: %s was not seen by the previous round's witnesses", target.hex()[:8])

    async def _close_round(self) -> None:
        """The coordinator left RoundTrain: publish the last receipts and take this round's optimizer step."""
        epoch, height, step = self.open_round  # type: ignore[misc]
        self.open_round = None
        replica = self.replica
        if replica is None:
            return
        await self._publish_receipts(epoch, height)
        stats = await asyncio.to_thread(replica.step)
        log.info("round %d.%d: stepped on %d samples (grad norm %.3f)", epoch, height, stats.samples,
                 stats.grad_norm)
        self._spawn(self._average(replica, step + 1))

    async def _average(self, replica: StageReplica, completed_step: int) -> None:
        """The SPARTA round due after ``completed_step``, if any; a worker whose rounds keep failing leaves."""
        result = await asyncio.to_thread(replica.average, completed_step)
        if result is None or not result.remove:
            return
        with contextlib.suppress(CoordinatorError, BackendError):
            await self.backend.withdraw()
        self.removed = (f"stage {replica.stage}: {result.consecutive_failures} averaging rounds failed in a row "
                        f"(last: {result.reason}); withdrew from the run")

    async def _follow(self, step: int) -> None:
        """Move through the sync phases with the swarm's step; tell the auth service once synced."""
        assert self.replica is not None
        if await asyncio.to_thread(self.replica.follow, step) and self.options.auth is not None:
            await asyncio.to_thread(self.options.auth.report_synced)

    async def _renew_slot(self, auth: AuthSession) -> None:
        """Keep the auth service's lease on this process's slot alive."""
        while True:
            await asyncio.sleep(auth.renew_every())
            try:
                await asyncio.to_thread(auth.renew)
            except AuthError as exc:
                log.warning("could not renew the contributor slot: %s", exc)

    # --- warmup ---------------------------------------------------------------------------------------

    async def _prepare(self, state: CoordinatorState, stage: int) -> None:
        if self.options.role == Role.Worker:
            await asyncio.to_thread(self._prepare_worker, state, stage)
        else:
            await asyncio.to_thread(self._prepare_trainer, state)
        assert self.board is not None
        ready = Ready.create(self.keypair, run_id=state.run_id, epoch=state.epoch)
        await asyncio.to_thread(self.board.publish, ready, self.keypair)
        log.info("epoch %d: model loaded, ready", state.epoch)

    def _prepare_worker(self, state: CoordinatorState, stage: int) -> None:
        """Take the stage: find its state, wait for the join queue, start syncing or active, serve it."""
        name = stage_name(stage, state.config.num_stages)
        self.stage = stage
        if self.replica is not None and self.replica.stage == name:
            return  # a worker that stays keeps its live parameters: they are newer than any checkpoint
        if self.replica is not None:
            previous, self.replica = self.replica, None
            previous.stop()
        replica = StageReplica.create(state, name, dht=self.dht, keypair=self.keypair, host=self.options.host,
                                      trainer_allowed=self._is_epoch_trainer, say=lambda line: print(line, flush=True))
        auth = self.options.auth
        sources = StateSources(snapshot=auth.snapshot if auth is not None else None, hf_token=self.options.hf_token,
                               hf_endpoint=self.options.hf_endpoint)
        replica.load(state, stage, sources, self._training_step)
        if auth is not None:
            auth.wait_turn()
        swarm_step = self.backend.state.step
        phase = replica.begin(swarm_step)
        replica.start()
        self.replica, self.followed_step = replica, swarm_step
        log.info("serving stage %s as %s at %s (%s)", name, replica.worker.uid, replica.worker.address,
                 "active" if not phase else f"sync phase {int(phase)}")
        if auth is not None and not phase:
            auth.report_synced()

    def _training_step(self) -> int | None:
        """The swarm's step while rounds run (averaging may be under way), None between epochs."""
        state = self.backend.state
        return state.step if state.phase in (Phase.RoundTrain, Phase.RoundWitness) else None

    def _is_epoch_trainer(self, pubkey: bytes) -> bool:
        """Whether a trainer is one of the current epoch's (as the coordinator's state last said): the only
        trainers this client's worker serves, whose receipts the witnesses count (called from gRPC threads)."""
        state = self.backend.state
        index = state.client_index(pubkey)
        return index is not None and state.clients[index].role == Role.Trainer

    def _prepare_trainer(self, state: CoordinatorState) -> None:
        from client.pipeline.data import open_dataset
        from client.pipeline.discovery import WorkerDirectory
        from client.pipeline.trainer import PipelineTrainer

        if self.trainer is not None:
            return
        if self.options.auth is not None:  # a trainer holds no state: once its turn comes it is integrated
            self.options.auth.wait_turn()
            self.options.auth.report_synced()
        config = model_config(state)
        dataset = open_dataset([state.model.dataset], config.seq_len)
        directory = ClientDirectory(WorkerDirectory(self.dht, state.run_id, config.fingerprint()), self)
        self.trainer = PipelineTrainer(config, dataset, directory, keypair=self.keypair, run_id=state.run_id,
                                       wire_dtype=self.options.wire_dtype,
                                       stall_timeout=float(state.config.max_round_train_time))

    # --- rounds ---------------------------------------------------------------------------------------

    async def _train(self, state: CoordinatorState) -> None:
        share = next((a for a in rules.data_assignment(state) if a.client == self.me), None)
        if share is None or share.size == 0:
            return
        while self.trainer is None:
            await asyncio.sleep(0.1)
        indices = list(range(share.start, share.end))
        async with self.training:  # a round that overran delays the next one rather than racing it
            started = time.perf_counter()
            try:
                result = await asyncio.to_thread(self.trainer.train, indices, state.model.microbatch_size)
            except Exception as exc:  # a stage that vanished mid-round: the witnesses will see the gap
                log.warning("round %d.%d: training failed: %s", state.epoch, state.round.height, exc)
                return
        losses = result.losses
        loss = sum(losses) / len(losses)
        receipts = tuple(dataclasses.asdict(r) for m in result.microbatches for _, r in sorted(m.receipts.items()))
        commitment = Commitment.create(self.keypair, run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                                       start=share.start, end=share.end, loss=loss,
                                       tokens=share.size * state.model.seq_len, receipts=receipts)
        assert self.board is not None
        await asyncio.to_thread(self.board.publish, commitment, self.keypair)
        seconds = time.perf_counter() - started
        log.info("round %d.%d: trained samples %d-%d, loss %.4f, %.0f tokens/s", state.epoch, state.round.height,
                 share.start, share.end, loss, share.size * state.model.seq_len / max(seconds, 1e-9))

    async def _publish_receipts(self, epoch: int, height: int) -> None:
        if self.worker is None or self.board is None:
            return
        self.round_receipts.extend(receipt_hash(r.to_bytes()) for r in self.worker.drain_receipts())
        if self.reported == (epoch, height, len(self.round_receipts)):
            return  # nothing new: the DHT already has this report (an empty one proves presence)
        report = Report.create(self.keypair, run_id=self.board.run_id, epoch=epoch, round=height, stage=self.stage,
                               uid=self.worker.uid, receipts=tuple(self.round_receipts))
        if await asyncio.to_thread(self.board.publish, report, self.keypair):
            self.reported = (epoch, height, len(self.round_receipts))

    async def _poll(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run ``step`` every POLL_INTERVAL; the coordinator or the network being briefly away is routine."""
        while True:
            await asyncio.sleep(POLL_INTERVAL)
            try:
                await step()
            except (BackendError, CoordinatorError, OSError) as exc:
                log.debug("background: %s", exc)

    async def _publish_open_round(self) -> None:
        """Publish the receipts of the round under way as they come."""
        if self.open_round is not None:
            await self._publish_receipts(*self.open_round[:2])

    async def _witness_current(self) -> None:
        await self._witness(self.backend.state)

    async def _witness(self, state: CoordinatorState) -> None:
        if state.phase not in (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness):
            return
        warmup = state.phase == Phase.Warmup
        key = (state.epoch, state.round.height, warmup)
        if key in self.proved or self.me not in rules.witnesses(state):
            return
        assert self.board is not None
        if warmup:
            ready = await asyncio.to_thread(self.board.fetch, Ready, state.epoch)
            evidence = judge_warmup(state, ready)  # type: ignore[arg-type]
        else:
            commitments = await asyncio.to_thread(self.board.fetch, Commitment, state.epoch, state.round.height)
            reports = await asyncio.to_thread(self.board.fetch, Report, state.epoch, state.round.height)
            evidence = judge_round(state, commitments, reports)  # type: ignore[arg-type]
        if not evidence.complete and state.phase != Phase.RoundWitness:
            return
        participants, batches = evidence.filters(state)
        try:  # a proof that did not get through (a network error, say) is sent again at the next poll
            if warmup:
                await self.backend.warmup_witness(participants, batches)
            else:
                await self.backend.witness(state.round.height, participants, batches)
        except CoordinatorError as exc:
            self.proved.add(key)
            log.info("witness proof not taken: %s", exc.detail)
            return
        self.proved.add(key)
        log.info("%s proof sent for %d.%d: %d participants, %d batches%s", "warmup" if warmup else "round",
                 state.epoch, state.round.height, len(evidence.participants), len(evidence.batches),
                 "" if evidence.complete else f", {len(evidence.missing)} missing")
        for client, why in evidence.why_missing.items():
            log.info("  %s not counted: %s", client.hex()[:8], why)

    # --- cooldown -------------------------------------------------------------------------------------

    async def _save_checkpoint(self, state: CoordinatorState, stage: int) -> None:
        """Save this worker's stage (and upload it, for a Hub checkpoint), then report it to the coordinator."""
        if self.worker is None:
            return
        revision = revision_for(state.epoch)
        directory = (self.options.checkpoint_dir / state.run_id).resolve() / revision
        with self.worker.backend.lock:
            tensors = {k: v.detach().clone() for k, v in self.worker.backend.module.state_dict().items()}
        try:
            files = await asyncio.to_thread(save_stage, directory, self.worker.stage, tensors, state.step)
            if self.options.hub_repo:
                await asyncio.to_thread(upload_stage, files, self.options.hub_repo, revision,
                                        token=self.options.hf_token, endpoint=self.options.hf_endpoint)
        except Exception as exc:  # a full disk or an unreachable Hub: peers still hold the model (P2P)
            log.warning("epoch %d: could not save stage %s: %s", state.epoch, self.worker.stage, exc)
            return
        kind, repo = ((CheckpointKind.Hub, self.options.hub_repo) if self.options.hub_repo
                      else (CheckpointKind.Local, str(directory.parent)))
        try:
            await self.backend.checkpoint(kind, repo, revision)
            log.info("epoch %d: stage %s saved to %s@%s", state.epoch, self.worker.stage, repo, revision)
        except CoordinatorError as exc:
            log.warning("checkpoint not recorded: %s", exc.detail)


class ContributorRemoved(RuntimeError):
    """This client withdrew from the run (its averaging kept failing); the message says why."""


class ClientDirectory:
    """The DHT's workers, narrowed to healthy workers of the current epoch in the stage they announce:
    routing through anyone else would produce receipts the witnesses cannot count."""

    def __init__(self, inner, contributor: Contributor) -> None:
        self.inner, self.contributor = inner, contributor

    def workers(self, stage: str):
        state = self.contributor.backend.state
        allowed = {c.id.hex() for c in state.clients if c.role == Role.Worker
                   and stage_name(c.stage, state.config.num_stages) == stage}
        return [r for r in self.inner.workers(stage) if r.pubkey in allowed]
