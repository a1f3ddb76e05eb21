"""The trainer role: no parameters, its share of each round's global batch routed through the stages' workers.

- Warmup: open the run's dataset and a pipeline trainer over the workers of the epoch (``ClientDirectory``).
- RoundTrain: publish a signed presence, run the share of the global batch the round's seed assigns this client
  through the pipeline, stopping if the round ends first, and publish a signed commitment of the result, with
  every receipt the workers signed for it (the proof of the work, whatever the workers report), and an accusation
  of every worker its checks found wrong (``client.pipeline.checks``).

Checks run only where a stage's replicas are identical, in runs that average gradients every step
(``grad_averaging`` full, powersgd or demo); with SPARTA alone replicas differ between averaging rounds, so honest
answers differ too, and nothing is compared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from client.contributor.context import ClientContext
from client.contributor.rounds import RoundKey
from client.contributor.run_model import building_the_model, model_config, run_dataset
from client.join.sync import SyncPhase
from client.pipeline.discovery import WorkerDirectory, WorkerRecord
from client.receipts import ReceiptRound
from client.stages import stage_name
from client.witness.records import MAX_ACCUSATIONS, Accusation, Commitment, Presence
from coordinator_program.spec import derived
from coordinator_program.spec.state import CoordinatorState, Phase, Role

if TYPE_CHECKING:
    from client.pipeline.trainer import PipelineTrainer

log = logging.getLogger("psyswarm.client")


class RoundOver(RuntimeError):
    """The round a training belongs to has ended: the workers stepped, and its remaining microbatches would count
    in a step that is not theirs (the workers refuse them too)."""


def training_round(state: CoordinatorState, key: RoundKey) -> bool:
    """Whether the coordinator is in RoundTrain of round ``key``."""
    return state.phase == Phase.RoundTrain and RoundKey.of(state) == key


class ClientDirectory:
    """The DHT's workers, narrowed to healthy workers of the current epoch in the stage they announce:
    routing through anyone else would produce receipts the witnesses cannot count. While a round's training
    runs (``round``), a lookup after that round has ended raises ``RoundOver``: a trainer stalled on a stage
    with no worker stops there instead of finishing its microbatches in the next round. ``state`` gives the
    coordinator's state as last seen."""

    def __init__(self, inner: WorkerDirectory, state: Callable[[], CoordinatorState]) -> None:
        self.inner: WorkerDirectory = inner
        self.state: Callable[[], CoordinatorState] = state
        self.round: RoundKey | None = None  # the round whose training is under way

    def workers(self, stage: str) -> list[WorkerRecord]:
        state = self.state()
        if self.round is not None and not training_round(state, self.round):
            raise RoundOver(f"round {self.round} is over: its remaining microbatches are dropped")
        allowed = {c.id.hex() for c in state.clients if c.role == Role.Worker
                   and stage_name(c.stage, state.config.num_stages) == stage}
        return [r for r in self.inner.workers(stage) if r.pubkey in allowed]


@dataclasses.dataclass(frozen=True)
class TrainedRound:
    """The last round this trainer trained, and how many microbatches it completed."""

    round: RoundKey
    microbatches: int


class TrainerRole:
    """A contributor that trains: what it does at each phase of the coordinator's state."""

    def __init__(self, context: ClientContext) -> None:
        self.context: ClientContext = context
        self.trainer: PipelineTrainer | None = None
        self.directory: ClientDirectory | None = None  # the trainer's view of the workers
        self.training: asyncio.Lock = asyncio.Lock()  # one round's training at a time
        self.trained: set[RoundKey] = set()  # the rounds whose training started
        self.last_trained: TrainedRound | None = None

    @property
    def sync_phase(self) -> SyncPhase | None:
        """None: a trainer holds no state to sync."""
        return None

    def batches(self, state: CoordinatorState) -> int:
        """Microbatches trained in the round ``state`` is in (0 until its training ends)."""
        last = self.last_trained
        return last.microbatches if last is not None and last.round == RoundKey.of(state) else 0

    def background(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """None: a trainer publishes as it trains."""
        return {}

    def stop_step(self) -> tuple[str, Callable[[], object]] | None:
        """The step of a clean leave this role owes: closing the trainer's connections."""
        return ("closing the trainer", self.trainer.close) if self.trainer is not None else None

    async def follow(self, state: CoordinatorState) -> None:
        """Nothing: a trainer acts on its rounds only."""

    def on_cooldown(self, state: CoordinatorState) -> None:
        """Nothing: a trainer holds nothing to save."""

    # --- warmup -----------------------------------------------------------------------------------------

    def prepare(self, state: CoordinatorState, stage: int) -> None:
        """Open the run's dataset and the pipeline trainer (once: a trainer holds no state, nothing to renew);
        ``stage`` is a worker's, none of a trainer's."""
        from client.pipeline.checks import CheckPolicy
        from client.pipeline.trainer import PipelineTrainer
        from client.pipeline.wire import codec_name
        from coordinator_program.spec.config import GradAveraging

        context, options = self.context, self.context.options
        if self.trainer is not None:
            return
        if options.auth is not None:  # a trainer holds no state: once its turn comes it is integrated
            options.auth.wait_turn()
            options.auth.report_synced()
        with building_the_model():
            config = model_config(state, hf_endpoint=options.hf_endpoint, hf_token=options.hf_token)
        dataset = run_dataset(state, config, options)
        identical = state.model.grad_averaging != GradAveraging.Off  # replicas are identical only then
        checks = CheckPolicy(options.check_rate, options.check_tolerance) if identical and options.check_rate else None
        namespace = derived.run_instance(state)  # the workers of this run, not of an earlier one of the same id
        self.directory = ClientDirectory(WorkerDirectory(context.dht, namespace, config.fingerprint()),
                                         lambda: context.state)
        self.trainer = PipelineTrainer(config, dataset, self.directory, keypair=context.keypair, run_id=namespace,
                                       wire_codec=codec_name(state.model.wire_codec),
                                       stall_timeout=float(state.config.max_round_train_time),
                                       max_inflight=options.max_inflight, checks=checks)

    # --- rounds -----------------------------------------------------------------------------------------

    def on_round(self, state: CoordinatorState) -> None:
        """RoundTrain: train the round, once."""
        key = RoundKey.of(state)
        if key not in self.trained:
            self.trained.add(key)
            self.context.tasks.spawn(self.train(state))

    async def train(self, state: CoordinatorState) -> None:
        """Publish this trainer's presence, then train its share of the round and publish the commitment."""
        context = self.context
        key = RoundKey.of(state)
        context.tasks.spawn(self._publish_presence(state))
        share = next((a for a in derived.data_assignment(state) if a.client == context.me), None)
        if share is None or share.size == 0:
            return
        while self.trainer is None:
            await asyncio.sleep(0.1)
        indices = list(range(share.start, share.end))
        async with self.training:  # a round that overran delays the next one rather than racing it
            if not training_round(context.state, key):
                log.warning("round %s ended before its training could start: skipped", key)
                return
            assert self.directory is not None
            self.directory.round = key
            started = time.perf_counter()
            try:
                result = await asyncio.to_thread(self.trainer.train, indices, state.model.microbatch_size,
                                                 round_=ReceiptRound(self.trainer.run_id, key.epoch, key.height))
            except Exception as exc:  # a stage that vanished mid-round: the witnesses will see the gap
                log.warning("round %s: training failed: %s", key, exc)
                return
        seconds = time.perf_counter() - started
        self.last_trained = TrainedRound(key, len(result.microbatches))
        losses = result.losses
        loss = sum(losses) / len(losses)
        receipts = tuple(r.to_value() for m in result.microbatches for _, r in sorted(m.receipts.items()))
        commitment = Commitment.create(context.keypair, run_id=state.run_id, epoch=state.epoch,
                                       round=state.round.height, start=share.start, end=share.end, loss=loss,
                                       tokens=share.size * state.model.seq_len, seconds=seconds, receipts=receipts)
        assert context.board is not None
        await self._publish_accusations(state)  # first: a witness may prove the round once every commitment is in
        await asyncio.to_thread(context.board.publish, commitment, context.keypair)
        log.info("round %s: trained samples %d-%d, loss %.4f, %.0f tokens/s", key, share.start, share.end, loss,
                 share.size * state.model.seq_len / max(seconds, 1e-9))

    async def _publish_accusations(self, state: CoordinatorState) -> None:
        """Publish the evidence against every worker this round's checks found wrong, for the witnesses."""
        checker = self.trainer.checker if self.trainer is not None else None
        evidence = [item for v in (checker.drain() if checker is not None else []) for item in v.accusations()]
        if not evidence:
            return
        context = self.context
        accusation = Accusation.create(context.keypair, run_id=state.run_id, epoch=state.epoch,
                                       round=state.round.height, accusations=tuple(evidence[:MAX_ACCUSATIONS]))
        assert context.board is not None
        try:
            await asyncio.to_thread(context.board.publish, accusation, context.keypair)
        except Exception as exc:  # noqa: BLE001 - the DHT fails in many ways; the commitment must still go out
            log.warning("round %s: could not publish this trainer's accusations: %s", RoundKey.of(state), exc)
            return
        log.warning("round %s: accused %d worker(s) of wrong answers", RoundKey.of(state),
                    len({item["accused"] for item in evidence}))

    async def _publish_presence(self, state: CoordinatorState) -> None:
        """Tell the round's witnesses this trainer is here, whatever becomes of its training: one stalled by a
        stage that emptied must not be taken for dead and removed with that stage's workers."""
        context = self.context
        assert context.board is not None
        presence = Presence.create(context.keypair, run_id=state.run_id, epoch=state.epoch, round=state.round.height)
        try:
            await asyncio.to_thread(context.board.publish, presence, context.keypair)
        except Exception as exc:  # noqa: BLE001 - the DHT fails in many ways; the round's training goes on regardless
            log.warning("round %s: could not publish this trainer's presence: %s", RoundKey.of(state), exc)
