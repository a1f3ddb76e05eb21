"""The contributor's client: it follows the coordinator's phases and does what each one asks.

- WaitingForMembers: make sure this identity is queued (joining again if it was dropped).
- Warmup: load the model — a worker takes its assigned stage (``client.join.stage_replica``: its state from a
  snapshot, the run's checkpoint, its peers or the run's seed; sync phases if that state is stale), serves
  it over gRPC and announces it in the DHT; a trainer opens the dataset — then publish a signed Ready.
- RoundTrain: a trainer publishes a signed presence, runs its share of the global batch (from the round seed)
  through the pipeline, stopping if the round ends first, and publishes a signed commitment; a worker accepts the
  round's samples only and publishes signed reports of the receipts it issued. Elected
  witnesses check the records and send their proof as soon as every batch is in (opportunistic), or at
  RoundWitness with what they have; they also health-check clients the previous round's witnesses missed.
- Leaving RoundTrain: workers apply their accumulated gradients (one optimizer step per round); every
  ``sparta_every`` steps each stage then averages a SPARTA partition among its workers during RoundWitness;
  a round that outlasts it holds the next round's batches until it is done, so the two never compete. An
  active worker snapshots its stage every ``snapshot_every`` steps, for whoever takes the stage if it empties.
- Cooldown: workers save their stage to the checkpoint directory and report it.

The backend (TCP server or Solana program) is behind ``client.backends.base.Backend``, so this runs
unchanged on either. Blocking work (torch, the DHT, averaging) runs in threads so the state keeps flowing.
With an auth service (``client.join.auth``), the slot is renewed while the client runs, a joiner waits its
turn in the join queue before it syncs, and it reports when it has synced.

A client that cannot take part as asked (no funds for fees, a DHT it cannot reach, a join the coordinator refuses
for good, a dataset it does not have) ends with ``CannotContribute``, whose message names the problem and the fix;
passing trouble (the coordinator restarting, a refused join that may succeed later) is retried. Stopping is
bounded: the clean leave gets ``STOP_TIMEOUT`` seconds, and threads still busy with compute or a peer are left.

May import: coordinator_program, client.identity, client.stages, client.backends, client.witness,
client.pipeline, client.join, client.data, client.models.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from solders.keypair import Keypair

from client.backends.base import Backend, BackendError
from client.backends.ticker import tick_when_due
from client.join.auth import AuthError, AuthSession
from client.join.checkpoints import SNAPSHOT_EVERY, revision_for, snapshot_root, upload_stage
from client.join.stage_replica import StageReplica, StateSources, model_config
from client.models import ModelSourceError
from client.stages import stage_name
from client.witness.judge import judge_round, judge_warmup, unhealthy_clients
from client.witness.records import Board, Commitment, Presence, Ready, Report, receipt_hash
from coordinator_program.spec import limits, rules
from coordinator_program.spec.config import CheckpointKind
from coordinator_program.spec.errors import (
    AlreadyJoined,
    CoordinatorError,
    InvalidJoin,
    InvalidRunId,
    MalformedInstruction,
    NotAuthorized,
    RunFinished,
    RunFull,
    WrongRunId,
)
from coordinator_program.spec.state import CoordinatorState, Phase, Role

log = logging.getLogger("psyswarm.client")

POLL_INTERVAL = 0.5
QUEUE_LOG_PERIOD = 30.0
SUPERVISOR_BACKOFF = (0.5, 5.0)
"""Seconds a failed background loop waits before it restarts: the first wait, and the longest."""
JOIN_RETRY = 5.0
"""Seconds between join attempts turned down for a reason that may pass."""
STOP_TIMEOUT = 4.0
"""Seconds a stopping client waits for its clean leave (its worker, the DHT, the auth slot) before going without."""
JOIN_REFUSALS: dict[type[CoordinatorError], str] = {
    WrongRunId: "check --run-id",
    InvalidRunId: "check --run-id",
    InvalidJoin: "check --role and --stage",
    NotAuthorized: "join through the run's auth service with --auth-url",
    RunFull: "try again once a client has left",
    RunFinished: "there is nothing left to train",
    MalformedInstruction: "use the psyswarm version the coordinator runs",
}
"""The coordinator's refusals of a join that asking again cannot change, and what to do instead."""


@dataclasses.dataclass
class RunnerOptions:
    role: Role
    initial_peers: list[str]
    stage: int = limits.NO_STAGE
    checkpoint_dir: Path = Path("checkpoints")
    host: str = "127.0.0.1"
    hub_repo: str | None = None  # save checkpoints to this Hugging Face repo rather than checkpoint_dir
    hf_token: str | None = None
    hf_endpoint: str | None = None
    auth: AuthSession | None = None  # the slot granted by the run's auth service, if it has one
    snapshot_every: int = SNAPSHOT_EVERY  # steps between a worker's snapshots of its stage (0: none)
    port: int = 0  # the worker's gRPC port (0: any free one)
    dht_port: int = 0  # this client's DHT node's port (0: any free one)
    device: str = "cpu"  # where a worker's stage computes (``client.pipeline.device``)


class Contributor:
    """One client process: a stage worker or a trainer, driven by the coordinator's state."""

    def __init__(self, backend: Backend, keypair: Keypair, options: RunnerOptions) -> None:
        self.backend, self.keypair, self.options = backend, keypair, options
        self.me = bytes(keypair.pubkey())
        self.dht = None
        self.board: Board | None = None
        self.replica: StageReplica | None = None
        self.trainer = None
        self.directory: ClientDirectory | None = None  # the trainer's view of the workers
        self.prepared_epoch: int | None = None
        self.open_round: tuple[int, int, int] | None = None  # (epoch, height, step) whose gradients accumulate
        self.followed_step: int | None = None  # the swarm step the sync phases last followed
        self.ended: CannotContribute | ContributorRemoved | None = None  # why this client stops taking part
        self.stopping = False
        self._main: asyncio.Task | None = None
        self.round_receipts: list[str] = []
        self.reported: tuple[int, int, int] | None = None  # (epoch, round, receipts) last published
        self.stage = limits.NO_STAGE
        self.training = asyncio.Lock()
        self.trained: set[tuple[int, int]] = set()
        self.round_batches: dict[tuple[int, int], int] = {}  # a trainer's microbatches in its last round trained
        self.proved: set[tuple[int, int, bool]] = set()
        self.health_checked: set[tuple[int, int]] = set()
        self.saved_epoch: int | None = None
        self.joining = False
        self.queue_logged = -QUEUE_LOG_PERIOD
        self._tasks: set[asyncio.Task] = set()

    # --- lifecycle ------------------------------------------------------------------------------------

    async def run(self, reconnect: Callable[[], Awaitable[Backend]] | None = None,
                  max_outage: float = 600.0) -> None:
        """Follow the run until it finishes (or the task is cancelled); raise ``CannotContribute`` or
        ``ContributorRemoved`` if any of this client's work ends its part in the run.

        If the coordinator goes away (a restart, a network cut) and ``reconnect`` is given, keep serving and
        reconnect with backoff for up to ``max_outage`` seconds: the run resumes where the coordinator left it.
        """
        self._main = asyncio.current_task()
        try:
            self.dht = await asyncio.to_thread(self._start_dht)
            self.board = Board(self.dht, self.backend.state.run_id)
            self.start_background()
            await self._follow_run(reconnect, max_outage)
        except asyncio.CancelledError:
            if self.ended is None:
                raise
            raise self.ended from None
        finally:
            await self.shutdown()

    async def _follow_run(self, reconnect: Callable[[], Awaitable[Backend]] | None, max_outage: float) -> None:
        while True:
            try:
                async for state in self.backend.updates():
                    await self.on_state(state)
                    if state.phase == Phase.Finished:
                        log.info("the run has finished after %d steps", state.step)
                        return
            except BackendError as exc:
                if reconnect is None or exc.permanent:
                    raise
                log.warning("lost the coordinator (%s); reconnecting", exc)
                self.backend = await self._reconnect(reconnect, max_outage)

    def _start_dht(self):
        """This client's DHT node, joined to the run's through ``initial_peers``; ``CannotContribute`` when it
        cannot start or reach them (a mistyped address, a bootstrap node that is down, a --host not of this
        machine): there is no run to take part in without it."""
        from client.pipeline.discovery import start_dht

        peers = self.options.initial_peers
        try:
            return start_dht(peers, self.options.host, self.options.dht_port)
        except Exception as exc:  # hivemind raises its P2PDaemonError, OSError or ValueError: all mean the same
            problem = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", str(exc))  # p2pd's own timestamps
            raise CannotContribute(
                f"cannot join the run's DHT through --initial-peer {' '.join(peers)} (--host {self.options.host}): "
                f"{problem}; give an address `psyswarm dht` printed (/ip4/HOST/tcp/PORT/p2p/PEER_ID) of a node that "
                "is up, and a --host of this machine") from None

    async def _reconnect(self, reconnect: Callable[[], Awaitable[Backend]], max_outage: float) -> Backend:
        deadline = time.monotonic() + max_outage
        delay = 0.5
        while True:
            try:
                backend = await reconnect()
            except BackendError as exc:
                if exc.permanent:
                    raise
                if time.monotonic() + delay > deadline:
                    raise BackendError(f"the coordinator stayed unreachable for {max_outage:.0f} s: {exc}") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            log.info("reconnected to the coordinator: %s, epoch %d, step %d", backend.state.phase.name,
                     backend.state.epoch, backend.state.step)
            return backend

    async def shutdown(self) -> None:
        """Leave cleanly, in order: stop the background work, the worker (its DHT record says it left) or the
        trainer, the DHT node, the auth slot. Each step runs in a thread and all of them together get
        STOP_TIMEOUT seconds: a step still running then (a peer that does not answer) is left behind, and so are
        threads busy with compute or a download, which nothing can interrupt; the process exits without them."""
        self.stopping = True
        self.stop_background()
        deadline = time.monotonic() + STOP_TIMEOUT
        steps: list[tuple[str, Callable[[], object]]] = []
        if self.replica is not None:
            steps.append(("stopping the worker", self.replica.stop))
        if self.trainer is not None:
            steps.append(("closing the trainer", self.trainer.close))
        if self.dht is not None:
            steps.append(("stopping the DHT node", lambda: stop_dht(self.dht)))
        if self.options.auth is not None:
            steps.append(("leaving the auth service", self.options.auth.client.leave))
        for what, step in steps:
            try:
                await asyncio.wait_for(asyncio.to_thread(step), max(deadline - time.monotonic(), 0.1))
            except TimeoutError:
                log.warning("%s took longer than the %.0f s a stop may: going without", what, STOP_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - the process is ending: a step that fails leaves the next to run
                log.warning("%s failed: %s", what, exc)

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
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        if isinstance(exc, CannotContribute | ContributorRemoved):
            self._end(exc)
            return
        log.error("background work %s failed (%s): %r", task.get_name(), self._where(), exc, exc_info=exc)

    def _end(self, why: CannotContribute | ContributorRemoved) -> None:
        """Stop taking part in the run: ``run`` leaves cleanly, then raises ``why``."""
        if self.ended is None and not self.stopping:
            self.ended = why
            if self._main is not None:
                self._main.cancel()

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
        if self.ended is not None:
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
        except AlreadyJoined:
            pass  # a state that shows this client queued is on its way
        except CoordinatorError as exc:
            fix = JOIN_REFUSALS.get(type(exc))
            if fix is not None:
                raise CannotContribute(f"the coordinator refuses this client's join: {exc.detail}; {fix}") from None
            log.warning("could not join: %s; trying again in %.0f s", exc.detail, JOIN_RETRY)
            await asyncio.sleep(JOIN_RETRY)
        except BackendError as exc:
            if exc.permanent:
                raise CannotContribute(f"could not join: {exc}") from None
            log.warning("could not join: %s; trying again in %.0f s", exc, JOIN_RETRY)
            await asyncio.sleep(JOIN_RETRY)
        finally:
            self.joining = False

    async def _on_round(self, state: CoordinatorState, role: Role) -> None:
        key = (state.epoch, state.round.height)
        if role == Role.Worker and (self.open_round is None or self.open_round[:2] != key):
            self.open_round, self.round_receipts = (*key, state.step), []
            if self.replica is not None:
                self.replica.expect_samples(*round_samples(state, state.step))
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
        stats = await asyncio.to_thread(replica.step, step)
        replica.expect_samples(*round_samples(self.backend.state, step + 1))  # the next round's, whenever it starts
        log.info("round %d.%d: stepped on %d samples (grad norm %.3f)", epoch, height, stats.samples,
                 stats.grad_norm)
        if self._snapshot_due(replica, step + 1):
            self._spawn(self._save_snapshot(replica, step + 1))
        self._spawn(self._average(replica, step + 1))

    def _snapshot_due(self, replica: StageReplica, step: int) -> bool:
        """Every ``snapshot_every`` steps, by active workers only: a syncing worker's state is not the stage's."""
        every = self.options.snapshot_every
        return every > 0 and step % every == 0 and replica.tracker.shares_state

    async def _save_snapshot(self, replica: StageReplica, step: int) -> None:
        """Snapshot the stage after ``step`` steps: if every worker of the stage dies, the epoch's checkpoint
        misses it and no peer holds it, and its next worker starts from here rather than from the run's seed."""
        root = snapshot_root(self.options.checkpoint_dir.resolve(), self.backend.state.run_id)
        try:
            await asyncio.to_thread(replica.save_snapshot, root, step)
        except OSError as exc:  # a full disk: the stage keeps training, its next snapshot may fare better
            log.warning("could not snapshot stage %s at step %d: %s", replica.stage, step, exc)

    async def _average(self, replica: StageReplica, completed_step: int) -> None:
        """The SPARTA round due after ``completed_step``, if any; a worker whose rounds keep failing leaves."""
        result = await asyncio.to_thread(replica.average, completed_step)
        if result is None or not result.remove:
            return
        with contextlib.suppress(CoordinatorError, BackendError):
            await self.backend.withdraw()
        self._end(ContributorRemoved(f"stage {replica.stage}: {result.consecutive_failures} averaging rounds failed "
                                     f"in a row (last: {result.reason}); withdrew from the run"))

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
        try:
            replica = StageReplica.create(state, name, dht=self.dht, keypair=self.keypair, host=self.options.host,
                                          device=self.options.device, hf_endpoint=self.options.hf_endpoint,
                                          hf_token=self.options.hf_token, trainer_allowed=self._is_epoch_trainer,
                                          say=lambda line: print(line, flush=True))
        except ModelSourceError as exc:
            raise CannotContribute(f"cannot build the run's model: {exc}") from None
        replica.worker.port = self.options.port  # not serving yet: it binds the port when it starts
        auth = self.options.auth
        sources = StateSources(snapshot=auth.snapshot if auth is not None else None,
                               snapshots=snapshot_root(self.options.checkpoint_dir.resolve(), state.run_id),
                               hf_token=self.options.hf_token, hf_endpoint=self.options.hf_endpoint)
        replica.load(state, stage, sources, self._training_step)
        replica.expect_samples(*round_samples(state, self.backend.state.step))
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
        from client.data import TokenizerMismatch, open_dataset
        from client.pipeline.discovery import WorkerDirectory
        from client.pipeline.trainer import PipelineTrainer
        from client.pipeline.wire import codec_name

        if self.trainer is not None:
            return
        if self.options.auth is not None:  # a trainer holds no state: once its turn comes it is integrated
            self.options.auth.wait_turn()
            self.options.auth.report_synced()
        try:
            config = model_config(state, hf_endpoint=self.options.hf_endpoint, hf_token=self.options.hf_token)
        except ModelSourceError as exc:
            raise CannotContribute(f"cannot build the run's model: {exc}") from None
        try:
            dataset = open_dataset(state.model.dataset, config.seq_len, tokenizer_sha256=state.model.tokenizer_sha256,
                                   hf_endpoint=self.options.hf_endpoint, hf_token=self.options.hf_token)
        except TokenizerMismatch as exc:
            raise CannotContribute(f"the run's dataset does not fit its model: {exc}") from None
        except ValueError as exc:
            raise CannotContribute(f"cannot open the run's dataset: {exc}; a trainer needs the run's data at that "
                                   "path on this machine (or join as a worker, which needs none)") from None
        self.directory = ClientDirectory(WorkerDirectory(self.dht, state.run_id, config.fingerprint()), self)
        self.trainer = PipelineTrainer(config, dataset, self.directory, keypair=self.keypair, run_id=state.run_id,
                                       wire_codec=codec_name(state.model.wire_codec),
                                       stall_timeout=float(state.config.max_round_train_time))

    # --- rounds ---------------------------------------------------------------------------------------

    async def _train(self, state: CoordinatorState) -> None:
        key = (state.epoch, state.round.height)
        self._spawn(self._publish_presence(state))
        share = next((a for a in rules.data_assignment(state) if a.client == self.me), None)
        if share is None or share.size == 0:
            return
        while self.trainer is None:
            await asyncio.sleep(0.1)
        indices = list(range(share.start, share.end))
        async with self.training:  # a round that overran delays the next one rather than racing it
            if not training_round(self.backend.state, key):
                log.warning("round %d.%d ended before its training could start: skipped", *key)
                return
            assert self.directory is not None
            self.directory.round = key
            started = time.perf_counter()
            try:
                result = await asyncio.to_thread(self.trainer.train, indices, state.model.microbatch_size)
            except Exception as exc:  # a stage that vanished mid-round: the witnesses will see the gap
                log.warning("round %d.%d: training failed: %s", state.epoch, state.round.height, exc)
                return
        self.round_batches = {key: len(result.microbatches)}
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

    async def _publish_presence(self, state: CoordinatorState) -> None:
        """Tell the round's witnesses this trainer is here, whatever becomes of its training: one stalled by a
        stage that emptied must not be taken for dead and removed with that stage's workers."""
        assert self.board is not None
        presence = Presence.create(self.keypair, run_id=state.run_id, epoch=state.epoch, round=state.round.height)
        try:
            await asyncio.to_thread(self.board.publish, presence, self.keypair)
        except Exception as exc:  # noqa: BLE001 - the DHT fails in many ways; the round's training goes on regardless
            log.warning("round %d.%d: could not publish this trainer's presence: %s", state.epoch,
                        state.round.height, exc)

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
            presences = await asyncio.to_thread(self.board.fetch, Presence, state.epoch, state.round.height)
            evidence = judge_round(state, commitments, reports, presences)  # type: ignore[arg-type]
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
        replica = self.replica
        if replica is None:
            return
        revision = revision_for(state.epoch)
        directory = (self.options.checkpoint_dir / state.run_id).resolve() / revision
        try:
            files = await asyncio.to_thread(replica.save, directory, state.step)
            if self.options.hub_repo:
                await asyncio.to_thread(upload_stage, files, self.options.hub_repo, revision,
                                        token=self.options.hf_token, endpoint=self.options.hf_endpoint)
        except Exception as exc:  # a full disk or an unreachable Hub: peers still hold the model (P2P)
            log.warning("epoch %d: could not save stage %s: %s", state.epoch, replica.stage, exc)
            return
        kind, repo = ((CheckpointKind.Hub, self.options.hub_repo) if self.options.hub_repo
                      else (CheckpointKind.Local, str(directory.parent)))
        try:
            await self.backend.checkpoint(kind, repo, revision)
            log.info("epoch %d: stage %s saved to %s@%s", state.epoch, replica.stage, repo, revision)
        except CoordinatorError as exc:
            log.warning("checkpoint not recorded: %s", exc.detail)


class ContributorRemoved(RuntimeError):
    """This client withdrew from the run (its averaging kept failing); the message says why."""


class CannotContribute(RuntimeError):
    """This client cannot take part in the run as it was started, and trying again would fail the same way; the
    message names the problem and the fix."""


class RoundOver(RuntimeError):
    """The round a training belongs to has ended: the workers stepped, and its remaining microbatches would count
    in a step that is not theirs (the workers refuse them too)."""


def round_samples(state: CoordinatorState, step: int) -> tuple[int, int]:
    """(first sample, global batch) of the round that takes the swarm from ``step`` to ``step + 1`` steps: the
    coordinator starts each round's data at ``step * global_batch_size``."""
    batch = state.config.global_batch_size
    return step * batch, batch


def training_round(state: CoordinatorState, key: tuple[int, int]) -> bool:
    """Whether the coordinator is in RoundTrain of round ``key`` (epoch, height)."""
    return state.phase == Phase.RoundTrain and (state.epoch, state.round.height) == key


def stop_dht(dht) -> None:
    """Shut a hivemind DHT node down; kill it if it does not go in time. Its process is deaf to SIGTERM
    (``client.helper_processes``), and hivemind's own last resort is a SIGTERM: a node left running would
    keep this process from exiting, as Python waits for its child processes."""
    dht.shutdown()
    if dht.is_alive():
        dht.kill()
        dht.join(1.0)


class ClientDirectory:
    """The DHT's workers, narrowed to healthy workers of the current epoch in the stage they announce:
    routing through anyone else would produce receipts the witnesses cannot count. While a round's training
    runs (``round``), a lookup after that round has ended raises ``RoundOver``: a trainer stalled on a stage
    with no worker stops there instead of finishing its microbatches in the next round."""

    def __init__(self, inner, contributor: Contributor) -> None:
        self.inner, self.contributor = inner, contributor
        self.round: tuple[int, int] | None = None  # (epoch, height) of the training under way

    def workers(self, stage: str):
        state = self.contributor.backend.state
        if self.round is not None and not training_round(state, self.round):
            raise RoundOver(f"round {self.round[0]}.{self.round[1]} is over: its remaining microbatches are dropped")
        allowed = {c.id.hex() for c in state.clients if c.role == Role.Worker
                   and stage_name(c.stage, state.config.num_stages) == stage}
        return [r for r in self.inner.workers(stage) if r.pubkey in allowed]
