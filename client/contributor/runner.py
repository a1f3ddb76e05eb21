"""The contributor's process: it follows the coordinator's state and hands each phase to this client's role.

- Always: the role follows the state (a worker closes a round the coordinator left, moves its sync phases on).
- Not in the epoch: make sure this identity is queued (joining again if it was dropped, each join committing to a
  fresh secret), and say where it waits.
- Warmup: reveal the join's secret while the warmup waits for its joiners (``seeding``); the role loads the model (or
  in a RoundTrain reached first), then the runner publishes a signed Ready.
- RoundTrain: the role opens its round; an elected witness health-checks the clients the last round missed, and
  commits to its secret for the next round's seed, which it reveals in RoundWitness (``seeding``).
- Cooldown: the role saves what it holds.
Witnessing, seeding, the role's publishing, the auto-ticker and the auth slot's renewal run as supervised background
loops.

If the coordinator goes away, the runner keeps serving and reconnects; it stops, cleanly and within a bound, when
the run finishes, when it is cancelled, or when any of its work ends this client's part in the run.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from solders.keypair import Keypair

from client.backends.base import Backend, BackendError
from client.backends.ticker import tick_when_due
from client.contributor.context import ClientContext, RunnerOptions
from client.contributor.errors import CannotContribute, Ending
from client.contributor.seeding import Seeding
from client.contributor.status import ContributorStatus
from client.contributor.tasks import TaskSet, poll
from client.contributor.trainer import TrainerRole
from client.contributor.witnessing import Witnessing
from client.contributor.worker import WorkerRole
from client.join.auth import AuthError, AuthSession
from client.join.sync import SyncPhase
from client.witness.records import Board, Ready
from coordinator_program.spec import limits
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

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger("psyswarm.client")

QUEUE_LOG_PERIOD = 30.0
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


class ContributorRole(Protocol):
    """What the runner asks of a role (``WorkerRole``, ``TrainerRole``) at each phase of the state."""

    @property
    def sync_phase(self) -> SyncPhase | None: ...

    def batches(self, state: CoordinatorState) -> int: ...

    def background(self) -> dict[str, Callable[[], Awaitable[None]]]: ...

    def stop_step(self) -> tuple[str, Callable[[], object]] | None: ...

    async def follow(self, state: CoordinatorState) -> None: ...

    def prepare(self, state: CoordinatorState, stage: int) -> None: ...

    def on_round(self, state: CoordinatorState) -> None: ...

    def on_cooldown(self, state: CoordinatorState) -> None: ...


class Contributor:
    """One client process: a stage worker or a trainer, driven by the coordinator's state."""

    def __init__(self, backend: Backend, keypair: Keypair, options: RunnerOptions) -> None:
        self.tasks: TaskSet = TaskSet(self._where, self._end)
        self.context: ClientContext = ClientContext(backend, keypair, options, self.tasks)
        self.role: ContributorRole = (WorkerRole(self.context) if options.role == Role.Worker
                                      else TrainerRole(self.context))
        self.witnessing: Witnessing = Witnessing(self.context)
        self.seeding: Seeding = Seeding(self.context)
        self.prepared_epoch: int | None = None  # the last epoch whose model the role loaded (or is loading)
        self.ended: Ending | None = None  # why this client stops taking part
        self.stopping: bool = False
        self.joining: bool = False  # a join is under way
        self.queue_logged: float = -QUEUE_LOG_PERIOD  # when this client last said where it waits in the queue
        self._main: asyncio.Task[None] | None = None

    @property
    def backend(self) -> Backend:
        """The coordinator, as this client reaches it now (a reconnect replaces it)."""
        return self.context.backend

    def status(self) -> ContributorStatus:
        """Where this client stands now, for the live line."""
        context = self.context
        state = context.state
        return ContributorStatus(state=state, me=context.me, role=context.options.role,
                                 asked_stage=context.options.stage, sync_phase=self.role.sync_phase,
                                 batches=self.role.batches(state))

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
            self.context.dht = await asyncio.to_thread(self._start_dht)
            self.context.board = Board(self.context.dht, self.backend.state)
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
                self.context.backend = await self._reconnect(reconnect, max_outage)

    def _start_dht(self) -> hivemind.DHT:
        """This client's DHT node, joined to the run's through ``initial_peers``; ``CannotContribute`` when it
        cannot start or reach them (a mistyped address, a bootstrap node that is down, a --host not of this
        machine): there is no run to take part in without it."""
        from client.pipeline.discovery import start_dht

        options = self.context.options
        peers = options.initial_peers
        try:
            return start_dht(peers, options.host, options.dht_port, options.public_host)
        except Exception as exc:  # hivemind raises its P2PDaemonError, OSError or ValueError: all mean the same
            problem = re.sub(r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", str(exc))  # p2pd's own timestamps
            raise CannotContribute(
                f"cannot join the run's DHT through --initial-peer {' '.join(peers)} (--host {options.host}): "
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
        self.tasks.stop()
        deadline = time.monotonic() + STOP_TIMEOUT
        if self.ended is None:  # told to stop (not removed, not finished): leave the run before anything else
            await self._withdraw(deadline)
        steps: list[tuple[str, Callable[[], object]]] = []
        role_step = self.role.stop_step()
        if role_step is not None:
            steps.append(role_step)
        if self.context.dht is not None:
            steps.append(("stopping the DHT node", functools.partial(stop_dht, self.context.dht)))
        if self.context.options.auth is not None:
            steps.append(("leaving the auth service", self.context.options.auth.client.leave))
        for what, step in steps:
            try:
                await asyncio.wait_for(asyncio.to_thread(step), max(deadline - time.monotonic(), 0.1))
            except TimeoutError:
                log.warning("%s took longer than the %.0f s a stop may: going without", what, STOP_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - the process is ending: a step that fails leaves the next to run
                log.warning("%s failed: %s", what, exc)

    async def _withdraw(self, deadline: float) -> None:
        """Tell the coordinator this client leaves: a joiner leaves the queue at once, a client of the epoch at the
        end of the round, neither queued again nor left to the health checks."""
        state = self.backend.state
        if state.pending_index(self.context.me) is None and state.client_index(self.context.me) is None:
            return
        try:
            await asyncio.wait_for(self.backend.withdraw(), max(deadline - time.monotonic(), 0.1))
            log.info("withdrew from the run")
        except (TimeoutError, CoordinatorError, BackendError) as exc:
            log.warning("could not withdraw from the run (%s): the coordinator's health checks will drop this client",
                        getattr(exc, "detail", None) or exc or "no answer in time")

    def _end(self, why: Ending) -> None:
        """Stop taking part in the run: ``run`` leaves cleanly, then raises ``why``."""
        if self.ended is None and not self.stopping:
            self.ended = why
            if self._main is not None:
                self._main.cancel()

    def start_background(self) -> None:
        """Start the loops that run for the client's whole life, each supervised on its own: a failure in one
        (witnessing a peer's records, say) never stops another (publishing this client's own reports)."""
        for name, loop in self.role.background().items():
            self.tasks.supervise(name, loop)
        self.tasks.supervise("witnessing", lambda: poll(self.witnessing.witness_current))
        self.tasks.supervise("seeding", lambda: poll(self.seeding.act_current))
        if not self.backend.ticks_itself:
            self.tasks.supervise("ticking", lambda: tick_when_due(lambda: self.backend))
        if self.context.options.auth is not None:
            auth = self.context.options.auth
            self.tasks.supervise("renewing the slot", lambda: self._renew_slot(auth))

    def _where(self) -> str:
        """Where the run stands, for logs."""
        try:
            state = self.backend.state
        except BackendError:
            return "no coordinator state"
        return f"{state.phase.name}, epoch {state.epoch}, round {state.round.height}"

    async def _renew_slot(self, auth: AuthSession) -> None:
        """Keep the auth service's lease on this process's slot alive."""
        while True:
            await asyncio.sleep(auth.renew_every())
            try:
                await asyncio.to_thread(auth.renew)
            except AuthError as exc:
                log.warning("could not renew the contributor slot: %s", exc)

    # --- reacting to the state ------------------------------------------------------------------------

    async def on_state(self, state: CoordinatorState) -> None:
        if self.ended is not None:
            return  # leaving: neither rejoin nor act in the run any more
        await self.role.follow(state)
        index = state.client_index(self.context.me)
        if index is None:
            position = state.pending_index(self.context.me)
            if position is None and state.phase not in (Phase.Finished, Phase.Uninitialized):
                self.tasks.spawn(self._join(state))
            elif position is not None:
                self._report_queue(state, position)
            return
        client = state.clients[index]
        if state.phase in (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness):
            self.tasks.spawn(self.seeding.on_state(state))  # a reveal is due within a deadline: act at once
        if state.phase in (Phase.Warmup, Phase.RoundTrain) and self.prepared_epoch != state.epoch:
            self.prepared_epoch = state.epoch
            self.tasks.spawn(self._prepare(state, client.stage))
        if state.phase == Phase.RoundTrain:
            self.role.on_round(state)
            await self.witnessing.health_check(state)
        if state.phase == Phase.Cooldown:
            self.role.on_cooldown(state)

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
        options = self.context.options
        try:
            slot = options.auth.grant.slot if options.auth is not None else limits.NO_SLOT
            await self.backend.join(options.role, options.stage, slot, self.seeding.join_commitment())
            log.info("joined run %s as a %s; waiting to be admitted", state.run_id, options.role.name.lower())
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

    async def _prepare(self, state: CoordinatorState, stage: int) -> None:
        """Warmup: the role loads the model; then this client tells the warmup's witnesses it is ready."""
        await asyncio.to_thread(self.role.prepare, state, stage)
        board, keypair = self.context.board, self.context.keypair
        assert board is not None
        ready = Ready.create(keypair, run_id=state.run_id, epoch=state.epoch)
        await asyncio.to_thread(board.publish, ready, keypair)
        log.info("epoch %d: model loaded, ready", state.epoch)


def stop_dht(dht: hivemind.DHT) -> None:
    """Shut a hivemind DHT node down; kill it if it does not go in time. Its process is deaf to SIGTERM
    (``client.helper_processes``), and hivemind's own last resort is a SIGTERM: a node left running would
    keep this process from exiting, as Python waits for its child processes."""
    dht.shutdown()
    if dht.is_alive():
        dht.kill()
        dht.join(1.0)
