"""The trainer: routes microbatches through the stages' workers; holds no parameters.

For each microbatch it sends the byte tokens through head → body… Forward calls, then a tail Backward
(which recomputes the tail's forward, the loss and its gradient in one call), then Backward calls back to
the head. A worker's Backward recomputes the forward with its own parameters, and same-stage replicas'
parameters differ between SPARTA averaging rounds (each steps its own AdamW on the samples it saw), so a
stage's backward goes to the worker that ran its forward: on another replica it would differentiate a
function other than the one whose output the next stage saw, and the gradients would not match. Workers
insist on it: a head or body Backward needs the ticket its Forward left on that very worker. The trainer
still keeps every stage's input until the microbatch is done, so if that worker fails, is banned or leaves
between the two passes, the backward falls back to any other replica of the stage, running the Forward
there first: one retry with a slightly inconsistent gradient, not a lost microbatch.

Microbatches overlap: each runs its chain of calls on a thread of its own, and as many run at once as keep the
busiest stage busy, which behind internet round trips is many more than the number of stages (``inflight``: the
pipeline's bandwidth-delay product, from the trainer's own measurements, or ``max_inflight`` if given). Which
samples a step accumulates does not depend on it: the workers sum the same microbatches' gradients, in another
order.

Every request is signed with the trainer's keypair over the run, the stage, the kind, the worker it is sent to
(the public key of the signed DHT record the router picked), the microbatch, its sample range and the digests of
the tensors sent (``admission.RequestHeader``): no other worker accepts it, and only that worker can show it as
evidence of work in its stage's gradient averaging (``client.averaging.work``). A worker's receipt names the
trainer by its public key, and the worker signs it for the round the trainer trains (``client.receipts``): the
trainer keeps it as proof of the work, whatever the worker reports. A microbatch is a consecutive range of
sample indices, so its receipts can name it by ``[sample_start, sample_end)``.

Every response comes from an untrusted worker and is checked (shapes, dtype, finite values, the receipt's
digests against what was actually exchanged, its round and the worker's signature); a worker that answers
badly or not at all is banned for ``ban_seconds`` and the call moves to a peer of the same stage. Training
stalls, saying so in the log, only when a stage has no usable worker at all.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import grpc
import torch
from solders.keypair import Keypair

from client.data import SampleDataset
from client.pipeline.admission import RequestHeader, encode_request, now_ms
from client.pipeline.checks import SIGNED, Checker, CheckPolicy, Reply, signed_answer
from client.pipeline.compute import input_digest
from client.pipeline.data import microbatches
from client.pipeline.discovery import WorkerRecord
from client.pipeline.inflight import InflightMeter, memory_cap, windowed_map
from client.pipeline.messages import (
    MessageError,
    WireTensor,
    decode_message,
    tensor_digest,
)
from client.pipeline.model import ModelSpec, stage_names
from client.pipeline.router import DEFAULT_BAN_SECONDS, Directory, PipelineError, StageFinder
from client.pipeline.rpc import StageClient
from client.pipeline.wire import DEFAULT_CODEC, codec_name, codec_of, is_finite
from client.receipts import Receipt, ReceiptRound, SignedReceipt

log = logging.getLogger(__name__)

BACKWARD_COST = 3.0  # a backward recomputes the forward, then differentiates: about three forwards of work
_BAN_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
PRECONDITION_BACKOFF = 0.25
"""Seconds before the first retry of a call a worker refused as out of its round; doubled each time, at most 2 s
(about 12 s over the default 8 attempts: a worker's step after a round's averaging)."""


Answered = tuple[WorkerRecord, dict[str, object], dict[str, WireTensor]]
"""A call's answer: the worker that gave it, its metadata and its tensors."""


class _BadResponse(Exception):
    """A worker's answer does not check out; the worker is treated as faulty."""


@dataclass(frozen=True)
class _Microbatch:
    """A microbatch in flight: its id, the sample indices ``[start, end)`` it covers and the round it trains in."""

    id: str
    start: int
    end: int
    round: ReceiptRound


@dataclass(frozen=True)
class MicrobatchResult:
    """One microbatch's outcome. ``workers`` are the uids that ran each stage's backward (and so hold its
    gradient and issued its receipt); ``forward_workers`` those that ran the forward passes (every stage but
    the tail). The two agree except where a forward's worker failed before its backward."""

    microbatch_id: str
    indices: tuple[int, ...]
    loss: float
    workers: dict[str, str]
    forward_workers: dict[str, str]
    receipts: dict[str, SignedReceipt]


@dataclass
class TrainResult:
    microbatches: list[MicrobatchResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def losses(self) -> list[float]:
        return [m.loss for m in self.microbatches]

    @property
    def workers(self) -> list[dict[str, str]]:
        return [m.workers for m in self.microbatches]


def consecutive_microbatches(indices: Sequence[int], microbatch_size: int) -> list[list[int]]:
    """``indices`` in microbatches of ``microbatch_size``, each a consecutive range of sample indices (what a request
    and a receipt name), or ``ValueError``."""
    chunks = microbatches(indices, microbatch_size)
    for chunk in chunks:
        if chunk != list(range(chunk[0], chunk[0] + len(chunk))):
            raise ValueError(f"microbatch {chunk} is not a consecutive range of sample indices")
    return chunks


class PipelineTrainer:
    """Trains through remote stage workers found in a directory (normally the DHT)."""

    def __init__(
        self,
        config: ModelSpec,
        dataset: SampleDataset,
        directory: Directory,
        *,
        keypair: Keypair | None = None,
        run_id: str = "psyswarm",
        wire_codec: str = DEFAULT_CODEC,
        forward_timeout: float = 30.0,
        backward_timeout: float = 75.0,
        max_attempts: int = 8,
        ban_seconds: float = DEFAULT_BAN_SECONDS,
        stall_timeout: float | None = None,
        max_inflight: int | None = None,
        refresh_period: float = 2.0,
        stall_log_period: float = 10.0,
        checks: CheckPolicy | None = None,
    ) -> None:
        """``keypair`` signs every request (a fresh identity if omitted, which only workers serving any signed
        trainer accept) for the run ``run_id``, its activations in the run's ``wire_codec``. ``stall_timeout=None``
        waits for a missing stage forever. ``max_inflight`` microbatches run at once, keeping several stages busy
        (pipeline parallelism); ``None`` chooses the number from what the trainer's own calls measured, the
        pipeline's bandwidth-delay product (``inflight``), within a memory budget. ``checks`` asks a second replica
        the questions of a share of the microbatches and settles disagreements (``checks``); None checks nothing."""
        if dataset.seq_len != config.seq_len:
            raise ValueError(f"dataset seq_len {dataset.seq_len} differs from the model's {config.seq_len}")
        if (max_inflight is not None and max_inflight < 1) or max_attempts < 1:
            raise ValueError("max_inflight and max_attempts must be at least 1")
        self.config = config
        self.dataset = dataset
        self.directory = directory
        self.keypair = keypair or Keypair()
        self.trainer_id = bytes(self.keypair.pubkey()).hex()
        self.run_id = run_id
        self._session = uuid.uuid4().hex[:12]  # microbatch ids never repeat, even across restarts
        self.wire_codec = codec_name(wire_codec)
        self.timeouts = {False: forward_timeout, True: backward_timeout}
        self.max_attempts = max_attempts
        self.max_inflight = max_inflight
        self.stages = stage_names(config.num_stages)
        self.meter = InflightMeter(self.stages)
        self.finder = StageFinder(directory, self.stages, ban_seconds=ban_seconds, stall_timeout=stall_timeout,
                                  refresh_period=refresh_period, stall_log_period=stall_log_period)
        self.routers = self.finder.routers
        self.checker = Checker(checks, self.routers) if checks is not None else None
        self.bytes_sent = self.bytes_received = 0
        self._clients: dict[str, StageClient] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    # ----- public API -----

    def train(
        self,
        indices: Sequence[int],
        microbatch_size: int,
        *,
        on_microbatch: Callable[[MicrobatchResult], None] | None = None,
        round_: ReceiptRound | None = None,
    ) -> TrainResult:
        """Forward and backward every microbatch of ``indices``; gradients accumulate on the workers. Each
        microbatch (consecutive chunks of ``indices``) must be a consecutive range of sample indices.

        Results come back in the order of ``indices``; ``on_microbatch`` sees each as it completes in that
        order (progress logs, or a test acting mid-run). Every receipt must be signed for ``round_`` (a coordinated
        run's round; standalone, round 0 of ``run_id``): a worker that signs for another is answering badly.
        """
        chunks = consecutive_microbatches(indices, microbatch_size)
        result = TrainResult()
        started = time.perf_counter()
        threads = self.max_inflight or memory_cap(self.config.num_stages, microbatch_size * self.config.seq_len,
                                                  self.config.d_model)

        def deliver(micro: MicrobatchResult) -> None:
            result.microbatches.append(micro)
            if on_microbatch is not None:
                on_microbatch(micro)

        round_ = round_ or ReceiptRound(self.run_id, 0, 0)
        for router in self.routers.values():
            router.begin_round()
        windowed_map(lambda chunk: self._microbatch(chunk, round_), chunks, lambda: self.inflight(microbatch_size),
                     threads=threads, on_result=deliver)
        result.seconds = time.perf_counter() - started
        return result

    def inflight(self, microbatch_size: int) -> int:
        """Microbatches of ``microbatch_size`` samples to keep in flight now: ``max_inflight`` if set, else the
        measured choice (``inflight.InflightMeter``) within the memory budget for the stages' inputs."""
        if self.max_inflight is not None:
            return self.max_inflight
        limit = memory_cap(self.config.num_stages, microbatch_size * self.config.seq_len, self.config.d_model)
        return min(limit, self.meter.choose(self._replicas))

    def _replicas(self, stage: str) -> int:
        known, banned = self.routers[stage].counts()
        return max(1, known - banned)

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    # ----- one microbatch -----

    def _microbatch(self, indices: list[int], round_: ReceiptRound) -> MicrobatchResult:
        micro = _Microbatch(f"{self._session}/{next(self._ids)}", indices[0], indices[-1] + 1, round_)
        tokens = self.dataset.batch(indices).to(torch.uint8 if self.config.vocab <= 256 else torch.int64)
        targets = tokens[:, 1:].contiguous()
        inputs = [tokens[:, :-1].contiguous()]
        forward_records: dict[str, WorkerRecord] = {}
        workers: dict[str, str] = {}
        unsent: set[str] = set()  # stages whose forward ran and whose backward was not yet sent
        checked = self.checker is not None and self.checker.chosen(micro.id)
        partners: dict[str, WorkerRecord | None] = {}  # the replica that answered a checked Forward, per stage
        previous: WorkerRecord | None = None  # the worker of the stage before: the microbatch's lane
        try:
            for stage in self.stages[:-1]:
                reply = self._call(stage, micro, False, {"input": inputs[-1]}, after=previous)
                if checked:
                    reply, partners[stage] = self._checked(stage, micro, False, {"input": inputs[-1]}, reply, None)
                record, _, out = reply
                forward_records[stage] = previous = record
                unsent.add(stage)
                inputs.append(out["output"])
            receipts: dict[str, SignedReceipt] = {}
            tail = self.stages[-1]
            tensors = {"input": inputs[-1], "targets": targets}
            reply = self._call(tail, micro, True, tensors, after=previous)
            if checked:
                reply, _ = self._checked(tail, micro, True, tensors, reply, None)
            record, meta, out = reply
            loss = float(meta["loss"])
            workers[tail], receipts[tail] = record.uid, receipt_of(meta)
            grad = out["grad_input"]
            for position in range(len(self.stages) - 2, -1, -1):
                stage = self.stages[position]
                tensors = {"input": inputs[position], "grad_output": grad}
                unsent.remove(stage)  # from here its call releases its own charge if it fails
                reply = self._call(stage, micro, True, tensors, affinity=forward_records[stage])
                if checked and position > 0:  # a head's Backward returns nothing to compare
                    reply, _ = self._checked(stage, micro, True, tensors, reply, partners.pop(stage, None))
                record, meta, out = reply
                workers[stage], receipts[stage] = record.uid, receipt_of(meta)
                grad = out.get("grad_input")
        except BaseException:
            # A forward's choice was charged with its backward too; a microbatch that fails releases the
            # backwards it will never send, a checked one its partners' too.
            backward_cost = targets.numel() * BACKWARD_COST
            for stage in unsent:
                self.routers[stage].release(forward_records[stage].uid, backward_cost)
                if (partner := partners.get(stage)) is not None:
                    self.routers[stage].release(partner.uid, backward_cost)
            raise
        log.debug("microbatch %s: loss %.4f via %s", micro.id, loss, workers)
        forward_workers = {stage: record.uid for stage, record in forward_records.items()}
        return MicrobatchResult(micro.id, tuple(indices), loss, workers, forward_workers, receipts)

    def _checked(self, stage: str, micro: _Microbatch, backward: bool, tensors: dict[str, WireTensor],
                 first: Answered, partner: WorkerRecord | None) -> tuple[Answered, WorkerRecord | None]:
        """``first`` checked (``checks.Checker.check``): the answer to go on with, the replica for this Backward."""
        assert self.checker is not None
        batch, length = tensors["input"].shape[:2]
        costs = {False: batch * length * 1.0, True: batch * length * BACKWARD_COST}

        def exchange(record: WorkerRecord, backward_: bool) -> tuple[dict[str, object], dict[str, WireTensor]]:
            sent = tensors if backward_ == backward else {"input": tensors["input"]}
            return self._exchange(stage, record, micro, backward_, sent, costs[backward_])

        reply, partner = self.checker.check(stage, micro.id, backward, Reply(*first), partner, exchange, costs,
                                            then_backward=not backward and stage != self.stages[0],
                                            forward_first=backward and stage != self.stages[-1])
        return (reply.record, reply.meta, reply.out), partner

    # ----- one call, with routing, retries and bans -----

    def _call(
        self,
        stage: str,
        micro: _Microbatch,
        backward: bool,
        tensors: dict[str, WireTensor],
        *,
        affinity: WorkerRecord | None = None,
        after: WorkerRecord | None = None,
    ) -> Answered:
        """One Forward or Backward, checked. ``affinity`` is the worker that ran this stage's forward: the
        first attempt goes to it while it is usable; retries, and a first attempt without it, go to the
        router's pick (in the lane of ``after``, the worker of the stage before, where it may), which must first
        run the stage's Forward for a head or body Backward (the worker's ticket for it)."""
        method = "Backward" if backward else "Forward"
        batch, length = tensors["input"].shape[:2]
        costs = {False: batch * length * 1.0, True: batch * length * BACKWARD_COST}
        needs_ticket = backward and stage != self.stages[-1]
        # Choosing a forward's worker also chooses its backward's, so the choice is charged with both: else a
        # round's microbatches, all chosen before any backward, would crowd onto one replica. A Backward that
        # is chosen at all is the tail's, which has no forward, or a failover, which runs the forward first.
        charge = costs[True] + (costs[False] if stage != self.stages[-1] else 0.0)
        router = self.routers[stage]
        tried: set[str] = set()
        failures = 0
        last_error = ""
        while failures < self.max_attempts:
            claimed = self.finder.claim(stage, affinity, micro.id) if affinity is not None else None
            affinity = None  # only the first attempt: a retry goes wherever the router picks
            record = claimed or self.finder.pick(stage, charge, tried, after)
            owed = costs[backward] if claimed is not None else charge  # what this attempt leaves charged if it fails
            try:
                if needs_ticket and claimed is None:
                    self._exchange(stage, record, micro, False, {"input": tensors["input"]}, costs[False])
                    owed -= costs[False]
                out_meta, out = self._exchange(stage, record, micro, backward, tensors, costs[backward])
            except grpc.RpcError as exc:
                router.release(record.uid, owed)
                last_error = f"{exc.code().name}: {exc.details()}"
                if claimed is not None and needs_ticket and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Routine when the worker stepped between the two passes (its tickets go with the step):
                    # not a failure; the next attempt runs the Forward first, wherever the router picks.
                    log.info("%s of %s: %s; running its Forward again", method, micro.id, exc.details())
                    continue
                if exc.code() in _BAN_CODES:
                    log.warning(
                        "worker %s (%s) unreachable, banned for %.0f s: %s",
                        record.uid,
                        record.address,
                        router.ban_seconds,
                        last_error,
                    )
                    router.ban(record.uid)
                    continue
                log.warning("%s on %s failed, retrying elsewhere: %s", method, record.uid, last_error)
                known, banned = router.counts()
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and len(tried | {record.uid}) >= known - banned:
                    # Every worker of the stage tried: often one that has not stepped into this round yet (its
                    # averaging can outlast the coordinator's phase change). Give it time rather than spend every
                    # attempt at once.
                    time.sleep(min(PRECONDITION_BACKOFF * 2**failures, 2.0))
            except (MessageError, _BadResponse, KeyError, TypeError, ValueError) as exc:
                router.release(record.uid, owed)
                last_error = f"bad response: {exc}"
                log.warning("worker %s sent a bad %s response, banned: %s", record.uid, method, exc)
                router.ban(record.uid)
            else:
                return record, out_meta, out
            failures += 1
            tried.add(record.uid)
        raise PipelineError(f"{method} for stage {stage} failed {failures} times; last error: {last_error}")

    def _exchange(
        self,
        stage: str,
        record: WorkerRecord,
        micro: _Microbatch,
        backward: bool,
        tensors: dict[str, WireTensor],
        cost: float,
    ) -> tuple[dict[str, object], dict[str, WireTensor]]:
        """Sign and send one request to ``record``, check the answer, and tell the router how long it took;
        raises ``grpc.RpcError``, ``MessageError`` or ``_BadResponse``."""
        digests = {name: tensor_digest(tensor) for name, tensor in tensors.items()}
        # The worker's key is its signed DHT record's: the request serves that worker only.
        header = RequestHeader(run_id=self.run_id, stage=stage, kind="backward" if backward else "forward",
                               trainer=self.trainer_id, worker=record.pubkey, microbatch_id=micro.id,
                               sample_start=micro.start, sample_end=micro.end, dtype=self.wire_codec,
                               issued_at=now_ms(), digests=digests)
        request = encode_request(self.keypair, header, tensors)
        router = self.routers[stage]
        batch, length = tensors["input"].shape[:2]
        sent = router.clock()
        response = self._client(record.address).call(
            "Backward" if backward else "Forward", request, timeout=self.timeouts[backward]
        )
        meta, out = decode_message(response, max_elements=batch * length * self.config.d_model)
        check_response(header, record, tensors, meta, out, stages=self.stages, d_model=self.config.d_model,
                       round_=micro.round)
        meta[SIGNED] = signed_answer(dataclasses.asdict(header), record, meta, out)
        answered = router.clock()
        router.report(record.uid, cost, sent, answered)
        self.meter.record(stage, backward, record.uid, sent, answered)
        with self._lock:
            self.bytes_sent += len(request)
            self.bytes_received += len(response)
        return meta, out

    def _client(self, address: str) -> StageClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                # Responses are bounded by the decoder's element limit; this only caps what gRPC buffers.
                limit = 2 * 4 * self.config.seq_len * self.config.d_model * 1024 + (1 << 20)
                client = self._clients[address] = StageClient(address, max_message_bytes=limit)
            return client


def check_response(
    header: RequestHeader,
    record: WorkerRecord,
    sent: dict[str, WireTensor],
    meta: dict[str, object],
    out: dict[str, WireTensor],
    *,
    stages: Sequence[str],
    d_model: int,
    round_: ReceiptRound,
) -> None:
    """Raise ``_BadResponse`` unless the answer to the request ``header`` sent to ``record`` has exactly the form
    the pipeline of ``stages`` expects and a receipt true to the exchanged tensors, of ``round_``, signed by the
    worker's own key: one the witnesses would refuse proves nothing and would make this trainer's commitment
    false."""
    stage, backward = header.stage, header.kind == "backward"
    is_head, is_tail = stage == stages[0], stage == stages[-1]
    batch, length = sent["input"].shape[:2]
    hidden_shape = (batch, length, d_model)
    name = (
        None if (backward and is_head) or (is_tail and not backward) else ("grad_input" if backward else "output")
    )
    if set(out) != ({name} if name else set()):
        raise _BadResponse(f"expected tensors {[name] if name else []}, got {sorted(out)}")
    if name is not None:
        tensor = out[name]
        if codec_of(tensor) != header.dtype or tuple(tensor.shape) != hidden_shape:
            raise _BadResponse(
                f"{name} is {codec_of(tensor)} {list(tensor.shape)}, "
                f"expected {header.dtype} {list(hidden_shape)}"
            )
        if not is_finite(tensor):
            raise _BadResponse(f"{name} holds NaN or infinite values")
    if is_tail and not (isinstance(meta.get("loss"), float) and torch.isfinite(torch.tensor(meta["loss"]))):
        raise _BadResponse(f"loss {meta.get('loss')!r} is not a finite number")
    if backward:
        work = Receipt(
            trainer_id=header.trainer,
            microbatch_id=header.microbatch_id,
            stage=stage,
            worker_uid=record.uid,
            sample_start=header.sample_start,
            sample_end=header.sample_end,
            input_digest=input_digest(header.digests),
            grad_output_digest=header.digests.get("grad_output", ""),
            grad_input_digest=tensor_digest(out[name]) if name else "",
        )
        receipt = receipt_of(meta)
        if receipt.work != work:
            raise _BadResponse("the receipt does not match the exchanged tensors")
        if receipt.belongs_to != round_:
            raise _BadResponse(f"the receipt is signed for {receipt.belongs_to}, not {round_}")
        if receipt.worker != record.pubkey or not receipt.verifies():
            raise _BadResponse("the receipt is not signed by the worker's own key")


def receipt_of(meta: dict[str, object]) -> SignedReceipt:
    """The signed receipt a worker's answer carries in its metadata."""
    return SignedReceipt(**{f.name: meta[f"receipt.{f.name}"] for f in fields(SignedReceipt)})
