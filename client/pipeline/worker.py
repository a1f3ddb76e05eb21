"""A stage worker: gRPC server, forward/backward queues, one runtime thread, DHT announcements.

gRPC handler threads only validate and admit requests (``admission``: signed for this worker's key by a trainer
it serves; a Backward after its own Forward, once) and queue them; a single runtime thread (``runtime``) drains the
queues, backward first, so computation never competes with itself for the CPU and parameters change only between
tasks.
Gradients accumulate until ``step()``: the coordinator calls it when a round ends, or, run standalone, the worker
steps by itself every ``auto_step_samples`` samples.

Every Backward's answer carries its receipt, signed with the worker's key for the round ``receipt_round`` names
(``client.receipts``); with no round open (a coordinated worker between rounds) Backwards are refused, so every
receipt signed for a round is issued before ``close_round`` returns and its gradient is in that round's step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import grpc
import torch
from solders.keypair import Keypair

from client.pipeline.addresses import endpoint
from client.pipeline.admission import MicrobatchLedger, Ticket, TrainerAllowed, any_signed_trainer
from client.pipeline.compute import StageCompute, StageRequest
from client.pipeline.datacheck import DataCheck, WrongData
from client.pipeline.discovery import (
    STATE_UP,
    SYNC_PHASES,
    Announcer,
    WorkerRecord,
)
from client.pipeline.messages import MessageError, decode_message, encode_message
from client.pipeline.model import ModelSpec, stage_index
from client.pipeline.optim import OptimizerConfig, StepStats
from client.pipeline.rpc import InvalidRequest, RequestRejected, start_server
from client.pipeline.runtime import Runtime, Task
from client.pipeline.wire import DEFAULT_CODEC
from client.receipts import ReceiptRound, SignedReceipt
from client.stages import default_index, worker_uid

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)

class StageWorker:
    """Serves one pipeline stage; usable in-process (``start``/``stop``) or through ``run_worker``."""

    def __init__(
        self,
        config: ModelSpec,
        stage: str,
        *,
        optimizer: OptimizerConfig | None = None,
        keypair: Keypair | None = None,
        index: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        public_host: str | None = None,
        dht: hivemind.DHT | None = None,
        run_id: str = "psyswarm",
        trainer_allowed: TrainerAllowed = any_signed_trainer,
        announce_period: float = 10.0,
        max_batch_size: int = 32,
        auto_step_samples: int | None = None,
        compute_delay: float = 0.0,
        max_queue: int = 64,
        request_timeout: float = 120.0,
        rpc_threads: int = 8,
        wire_codec: str = DEFAULT_CODEC,
        device: torch.device | str = "cpu",
        data_check: DataCheck | None = None,
    ) -> None:
        """``trainer_allowed`` says whether a signed request's trainer (its public key) is served: a coordinated
        run passes the current epoch's trainers; the default serves any trainer that signs its requests, as
        a standalone run must. ``compute_delay`` adds seconds to every task, standing in for slower hardware
        in experiments. ``wire_codec`` is the run's (``wire``): requests in another are refused. The stage
        computes on ``device`` (``client.pipeline.device``). ``data_check`` (the head's and the tail's, given the
        run's dataset) refuses a request whose tokens are not the dataset's at its samples, and keeps the trainer's
        signed request as evidence (``drain_accusations``)."""
        stage_index(config, stage)  # fail early on an unknown stage name
        self.config = config
        self.stage = stage
        self.keypair = keypair or Keypair()
        self.pubkey = bytes(self.keypair.pubkey())
        self.uid = worker_uid(stage, default_index(self.pubkey) if index is None else index)
        self.host = host
        self.port = port
        self.public_host = public_host or host  # what its record tells trainers (``addresses``)
        self.dht = dht
        self.run_id = run_id
        self.trainer_allowed = trainer_allowed
        self.announce_period = announce_period
        self.auto_step_samples = auto_step_samples
        self.rpc_threads = rpc_threads
        self.compute = StageCompute(config, stage, optimizer or OptimizerConfig(), uid=self.uid, run_id=run_id,
                                    max_batch_size=max_batch_size, wire_codec=wire_codec, device=device,
                                    signer=self.keypair)
        self.ledger = MicrobatchLedger()
        self.data_check = data_check
        self.runtime = Runtime(self._execute, name=f"runtime-{stage}", uid=self.uid, max_queue=max_queue,
                               request_timeout=request_timeout, compute_delay=compute_delay)
        self._sync_phase = 0
        # Why its state may honestly differ from its stage's until its digest is checked (``agreement``): no batch
        # is served meanwhile, so no answer of it is compared with its stage's then (trainers go to another replica).
        self.unsure: str | None = None
        # The round receipts are signed for, None refusing Backwards: a coordinated worker role names its open
        # round; standalone, every receipt is of round 0.
        self.receipt_round: Callable[[], ReceiptRound | None] = lambda: ReceiptRound(run_id, 0, 0)
        self._receipts: list[SignedReceipt] = []
        self._receipts_lock = threading.Lock()
        self._issuing = threading.Lock()  # held by a Backward from reading its round until its receipt is kept
        self._stopped = False
        self._server: grpc.Server | None = None
        self._announcer: Announcer | None = None

    # ----- lifecycle -----

    @property
    def address(self) -> str:
        """Where trainers reach this worker, as its record announces it."""
        return endpoint(self.public_host, self.port)

    def start(self) -> StageWorker:
        handlers = {
            "Forward": self._handle_forward,
            "Backward": self._handle_backward,
            "Info": self._handle_info,
        }
        self._server, self.port = start_server(
            handlers,
            f"{self.host}:{self.port}",
            max_message_bytes=4 * self.compute.max_message_bytes,
            threads=self.rpc_threads,
        )
        self.runtime.start()
        if self.dht is not None:
            self._announcer = Announcer(self.dht, self.keypair, self._record, period=self.announce_period)
            self._announcer.start()
        log.info("worker %s serving stage %s on %s", self.uid, self.stage, self.address)
        return self

    def stop(self, *, leave: bool = True, grace: float = 1.0) -> None:
        """Stop serving; ``leave`` tells trainers through the DHT at once instead of letting it expire."""
        if self._stopped:
            return
        self._stopped = True
        if self._announcer is not None:
            self._announcer.stop(leave=leave)
        if self._server is not None:
            self._server.stop(grace).wait()
        self.runtime.stop()
        log.info("worker %s stopped", self.uid)

    def __enter__(self) -> StageWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- state the client controls -----

    @property
    def sync_phase(self) -> int:
        """0 active, 1 catching up (refuses batches), 2 serving but not yet trusted for averaging."""
        return self._sync_phase

    @sync_phase.setter
    def sync_phase(self, phase: int) -> None:
        if phase not in SYNC_PHASES:
            raise ValueError(f"sync phase must be one of {SYNC_PHASES}, got {phase!r}")
        self._sync_phase = phase
        if self._announcer is not None:
            self._announcer.announce_now()

    @contextlib.contextmanager
    def batches_held(self) -> Iterator[None]:
        """Queue batches without running them for the duration: SPARTA averaging, which may outlast the short
        RoundWitness, must not compete with the next round's batches for the CPU (requests keep queuing, within
        their own timeouts)."""
        with self.runtime.held():
            yield

    def step(self) -> StepStats:
        """Apply the accumulated gradients with AdamW and zero them; forward tickets end with the parameters
        their forwards used."""
        stats = self.compute.step()
        self.ledger.end_step()
        if stats.samples and stats.applied:
            log.info(
                "%s step %d: %d samples, grad norm %.3f",
                self.uid,
                self.compute.steps,
                stats.samples,
                stats.grad_norm,
            )
        return stats

    def parameters(self) -> list[torch.Tensor]:
        """The stage's live parameter tensors in a fixed order; hold ``compute.lock`` while changing them."""
        return self.compute.parameters()

    def drain_accusations(self) -> list[WrongData]:
        """Evidence against each trainer whose tokens were refused since the last call (``DataCheck.drain``)."""
        return self.data_check.drain() if self.data_check is not None else []

    def drain_receipts(self) -> list[SignedReceipt]:
        """Receipts of the backward passes processed since the last call, oldest first."""
        with self._receipts_lock:
            receipts, self._receipts = self._receipts, []
        return receipts

    def close_round(self) -> None:
        """Wait for the Backward under way, if any. Called once ``receipt_round`` no longer names a round: when it
        returns, every receipt signed for that round is in ``drain_receipts`` and no other will be."""
        with self._issuing:
            pass

    @property
    def load(self) -> int:
        return self.runtime.load

    @property
    def throughput(self) -> float:
        """Tokens per second of compute (a moving average)."""
        return self.runtime.throughput

    def info(self) -> dict[str, str | int | float]:
        """What the Info RPC answers: identity, state and the model this worker serves."""
        return {
            "stage": self.stage,
            "uid": self.uid,
            "pubkey": self.pubkey.hex(),
            "address": self.address,
            "sync_phase": self.sync_phase,
            "load": self.load,
            "throughput": self.throughput,
            "samples_accumulated": self.compute.samples_accumulated,
            "steps": self.compute.steps,
            "gradients_refused": self.compute.bound.refused,
            "gradients_scaled": self.compute.bound.scaled,
            "device": str(self.compute.device),
            "model": self.config.fingerprint(),
            "wire_codec": self.compute.wire_codec,
            **{f"config.{k}": v for k, v in self.config.to_dict().items()},
        }

    def _record(self, expires: float) -> WorkerRecord:
        return WorkerRecord(run_id=self.run_id, stage=self.stage, uid=self.uid, address=self.address,
                            sync_phase=self.sync_phase, load=self.load, throughput=self.throughput,
                            model=self.config.fingerprint(), pubkey="", expires=expires, state=STATE_UP)

    # ----- RPC handlers (gRPC threads) -----

    def _handle_forward(self, payload: bytes) -> bytes:
        return self._submit(False, payload)

    def _handle_backward(self, payload: bytes) -> bytes:
        return self._submit(True, payload)

    def _handle_info(self, payload: bytes) -> bytes:
        try:
            _, tensors = decode_message(payload, max_elements=0)
        except MessageError as exc:
            raise InvalidRequest(f"malformed Info request: {exc}") from None
        if tensors:
            raise InvalidRequest("an Info request carries no tensors")
        return encode_message(self.info(), {})

    def _submit(self, backward: bool, payload: bytes) -> bytes:
        request = self.compute.parse(payload, backward=backward)
        if self._sync_phase == 1:
            raise RequestRejected(
                f"worker {self.uid} is in sync phase 1 and serves no batches",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if self.unsure is not None:
            raise RequestRejected(f"worker {self.uid} serves no batches until its state is checked: {self.unsure}",
                                  grpc.StatusCode.FAILED_PRECONDITION)
        if not self.trainer_allowed(request.header.pubkey):
            raise RequestRejected(
                f"trainer {request.trainer} is not one this worker serves (not a trainer of the run's current epoch)",
                grpc.StatusCode.PERMISSION_DENIED,
            )
        if self.data_check is not None:
            self.data_check.check(request)  # wrong tokens are refused, their evidence kept (drain_accusations)
        samples = (request.header.sample_start, request.header.sample_end)
        if not backward:
            self.ledger.admit_forward(samples)
        if backward:
            self._round_open()
            self.ledger.claim(request.trainer, request.microbatch_id, self._ticket(request), samples)
        try:
            return self.runtime.run(Task(backward, request, Future()))
        except BaseException:
            if backward:
                self.ledger.release(request.trainer, request.microbatch_id)
            raise

    def _round_open(self) -> ReceiptRound:
        """The round a Backward's receipt is signed for; ``RequestRejected`` while none is open."""
        round_ = self.receipt_round()
        if round_ is None:
            raise RequestRejected(f"worker {self.uid} has no round open: Backwards wait for the next round",
                                  grpc.StatusCode.FAILED_PRECONDITION)
        return round_

    def _ticket(self, request: StageRequest) -> Ticket | None:
        """The ticket a head or body Forward leaves and its Backward must match; None for the tail.

        A head or body Backward brings a ``grad_output`` that only makes sense for the output this worker
        gave that trainer for that input, so it must follow that Forward. The tail's Backward brings no
        gradient: it recomputes its forward from the input and targets, and its gradient is the loss's own,
        computed here; a Forward first would only cost a round trip (the trainer never sends one), and the
        ledger still refuses a replay of it.
        """
        if self.compute.module.is_tail:
            return None
        header = request.header
        return Ticket(request.input_digest(), header.sample_start, header.sample_end)

    # ----- what the runtime thread runs -----

    def _execute(self, task: Task) -> bytes:
        if not task.backward:
            response = self.compute.forward(task.request)
            if (ticket := self._ticket(task.request)) is not None:
                self.ledger.issue(task.request.trainer, task.request.microbatch_id, ticket)
            return response
        with self._issuing:
            round_ = self._round_open()
            response, receipt = self.compute.backward(task.request,
                                                      lambda work: SignedReceipt.sign(self.keypair, work, round_))
            with self._receipts_lock:
                self._receipts.append(receipt)
        if self.auto_step_samples and self.compute.samples_accumulated >= self.auto_step_samples:
            self.step()
        return response


def run_worker(
    config: ModelSpec,
    stage: str,
    *,
    initial_peers: Sequence[str],
    dht_host: str = "127.0.0.1",
    public_host: str | None = None,
    keypair: Keypair | None = None,
    torch_threads: int | None = None,
    **worker_options: object,
) -> None:
    """Run a worker with its own DHT node until SIGINT or SIGTERM (the CLI's and test subprocesses' entry); peers
    reach both at ``public_host`` (``addresses``), ``dht_host`` by default."""
    from client.pipeline.discovery import start_dht

    if torch_threads:
        torch.set_num_threads(torch_threads)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    dht = start_dht(initial_peers, dht_host, public_host=public_host)
    worker = StageWorker(config, stage, keypair=keypair, dht=dht, public_host=public_host,
                         **worker_options)  # type: ignore[arg-type]
    try:
        worker.start()
        print(f"worker {worker.uid} ({stage}) serving on {worker.address}", flush=True)
        stop.wait()
    finally:
        worker.stop()
        dht.shutdown()
