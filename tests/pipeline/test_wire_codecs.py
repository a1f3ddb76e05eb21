"""The run's wire codec over real gRPC: every codec trains as one process does, a worker and a trainer agree
on the bytes (receipts match), a request in another codec is refused, and hostile 8-bit payloads (bad scales,
out-of-range values, scales that overflow the gradients) never reach a worker's parameters."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from solders.keypair import Keypair

from client.data import ByteDataset
from client.pipeline.discovery import STATE_UP, WorkerRecord
from client.pipeline.local import LocalTrainer
from client.pipeline.messages import MAX_SCALE, BlockQuantized, decode_message
from client.pipeline.rpc import StageClient
from client.pipeline.trainer import PipelineError, PipelineTrainer
from client.pipeline.wire import WIRE_CODECS, to_wire
from client.pipeline.worker import StageWorker
from coordinator_program.spec.config import WireCodec, parse_run_spec
from coordinator_program.spec.state import CoordinatorState, Phase
from tests.join.test_stage_replica import SPEC, places

from .conftest import TINY, signed_request

RUN = "wire"
STAGES = ("head", "body1", "tail")
B, T, D = 2, TINY.seq_len, TINY.d_model
# How far each codec's per-microbatch losses may stray from one process's (measured: 0, 5e-5, 6e-5, 4e-4).
LOSS_TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-3, "int8": 4e-3}
_microbatches = itertools.count()


class StaticDirectory:
    """The trainer's view of workers started here, without a DHT."""

    def __init__(self, workers: list[StageWorker]) -> None:
        self.records = [
            WorkerRecord(RUN, w.stage, w.uid, w.address, 0, 0, 0.0, TINY.fingerprint(), w.pubkey.hex(), math.inf,
                         STATE_UP)
            for w in workers
        ]

    def workers(self, stage: str) -> list[WorkerRecord]:
        return [r for r in self.records if r.stage == stage]


@pytest.fixture
def start() -> Iterator[Callable[..., StageWorker]]:
    started: list[StageWorker] = []

    def make(stage: str, codec: str, **options: object) -> StageWorker:
        worker = StageWorker(TINY, stage, run_id=RUN, max_batch_size=4, wire_codec=codec, **options)  # type: ignore[arg-type]
        started.append(worker.start())
        return worker

    yield make
    for worker in started:
        worker.stop(grace=0)


BY_ID = operator.attrgetter("microbatch_id")


@pytest.mark.parametrize("codec", WIRE_CODECS)
def test_each_codec_trains_as_one_process_and_both_sides_receipts_match(
    start, dataset: ByteDataset, codec: str
) -> None:
    workers = [start(stage, codec) for stage in STAGES]
    trainer = PipelineTrainer(TINY, dataset, StaticDirectory(workers), run_id=RUN, wire_codec=codec)
    reference = LocalTrainer(TINY, dataset)
    try:
        for first in (0, 8):
            result = trainer.train(range(first, first + 8), microbatch_size=4)
            expected = reference.train(range(first, first + 8), 4)
            assert result.losses == pytest.approx(expected, abs=LOSS_TOLERANCE[codec])
            for worker in workers:
                assert worker.step().applied
            reference.step()
            for worker in workers:  # what each worker hashed is what the trainer sent and received (in any order)
                assert sorted(worker.drain_receipts(), key=BY_ID) == sorted(
                    (m.receipts[worker.stage] for m in result.microbatches), key=BY_ID)
    finally:
        trainer.close()
    if codec == "int8":
        assert result.losses != pytest.approx(expected, abs=1e-6)  # the activations really were quantised


def test_a_trainer_in_another_codec_is_refused_with_the_reason(start, dataset: ByteDataset) -> None:
    workers = [start(stage, "int8") for stage in STAGES]
    trainer = PipelineTrainer(TINY, dataset, StaticDirectory(workers), run_id=RUN, wire_codec="float16",
                              max_attempts=2)
    try:
        with pytest.raises(PipelineError, match="request encoded in wire codec 'float16', but this run's wire codec "
                                                "is 'int8'"):
            trainer.train(range(4), microbatch_size=4)
    finally:
        trainer.close()
    assert all(w.compute.samples_accumulated == 0 for w in workers)


class Hostile:
    """A trainer's signed requests to one int8 body1 worker, honest or not."""

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker
        self.keypair = Keypair()
        self.client = StageClient(worker.address, max_message_bytes=64 << 20)

    def call(self, method: str, tensors: dict, *, microbatch: str, dtype: str = "int8") -> dict:
        payload = signed_request(self.keypair, "body1", method, tensors, run_id=RUN, microbatch=microbatch,
                                 dtype=dtype, worker=self.worker.pubkey)
        return decode_message(self.client.call(method, payload, timeout=30), max_elements=1 << 20)[1]

    def microbatch(self, inputs: torch.Tensor, grad: object) -> None:
        """Forward then Backward, as a trainer sends them; ``grad`` in any wire form."""
        name = f"mb{next(_microbatches)}"
        self.call("Forward", {"input": to_wire(inputs, "int8")}, microbatch=name)
        self.call("Backward", {"input": to_wire(inputs, "int8"), "grad_output": grad}, microbatch=name)

    def refused(self, inputs: torch.Tensor, grad: object) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as raised:
            self.microbatch(inputs, grad)
        return raised.value


def _hidden(scale: float = 1.0) -> torch.Tensor:
    return torch.randn(B, T, D) * scale


def _with_scale(scale: float) -> BlockQuantized:
    honest = BlockQuantized.quantize(_hidden(0.01))
    scales = honest.scales.clone()
    scales[0, 3, 0] = scale
    return BlockQuantized(honest.values, scales)


def _snapshot(worker: StageWorker) -> list[torch.Tensor]:
    with worker.compute.lock:
        return [p.detach().clone() for p in worker.parameters()]


@pytest.mark.parametrize(
    "grad, reason",
    [
        (lambda: _with_scale(math.nan), "quantisation scales must be finite"),
        (lambda: _with_scale(math.inf), "quantisation scales must be finite"),
        (lambda: _with_scale(-1.0), "quantisation scales must be finite"),
        (lambda: _with_scale(MAX_SCALE * 4), "quantisation scales must be finite"),
        (lambda: BlockQuantized(torch.full((B, T, D), -128, dtype=torch.int8), torch.ones(B, T, 1)),
         "values must lie in -127..127"),
        (lambda: BlockQuantized(torch.full((B, T, D), 127, dtype=torch.int8), torch.full((B, T, 1), MAX_SCALE)),
         "Backward refused"),  # decodes to finite values whose gradients overflow
        (lambda: _hidden(0.01), "must be in this run's wire codec int8, got float32"),
    ],
    ids=["nan-scale", "inf-scale", "negative-scale", "huge-scale", "minus-128", "largest-scale", "float32"],
)
def test_hostile_quantised_gradients_never_reach_the_parameters(start, grad, reason: str) -> None:
    """Honest int8 microbatches on a worker and its twin; the worker also gets a hostile grad_output. It is
    refused with the reason, and after the step both hold the same finite parameters."""
    worker, twin = start("body1", "int8"), start("body1", "int8")
    honest, twin_honest, hostile = Hostile(worker), Hostile(twin), Hostile(worker)
    for position in range(3):
        inputs, honest_grad = _hidden(), to_wire(_hidden(0.01), "int8")
        if position == 1:
            error = hostile.refused(_hidden(), grad())
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert reason in error.details()
        honest.microbatch(inputs, honest_grad)
        twin_honest.microbatch(inputs, honest_grad)
    assert worker.step().applied and twin.step().applied
    after = _snapshot(worker)
    assert all(bool(torch.isfinite(p).all()) for p in after)
    assert all(torch.equal(a, b) for a, b in zip(after, _snapshot(twin), strict=True))


def test_a_request_in_another_codec_is_refused_before_it_runs(start) -> None:
    worker = start("body1", "int8")
    wire = Hostile(worker)
    for dtype, tensor in (("float32", _hidden()), ("bfloat16", _hidden().bfloat16())):
        with pytest.raises(grpc.RpcError) as raised:
            wire.call("Forward", {"input": tensor}, microbatch="other", dtype=dtype)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"request encoded in wire codec '{dtype}', but this run's wire codec is 'int8'" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:  # claims int8, carries float32
        wire.call("Forward", {"input": _hidden()}, microbatch="liar")
    assert "input must be in this run's wire codec int8, got float32" in raised.value.details()
    out = wire.call("Forward", {"input": to_wire(_hidden(), "int8")}, microbatch="honest")["output"]
    assert isinstance(out, BlockQuantized) and out.shape == (B, T, D)


def test_the_runs_codec_reaches_a_contributors_worker(new_dht, run_id: str) -> None:
    """``wire_codec = "int8"`` in the run's state.toml: the worker a contributor starts for it serves int8 only."""
    from client.averaging.membership import Roster
    from client.contributor.run_model import model_config
    from client.join.stage_replica import StageReplica

    spec = parse_run_spec({**SPEC, "run_id": run_id, "model": {**SPEC["model"], "wire_codec": "int8"}})
    assert spec.model.wire_codec == WireCodec.Int8Block
    state = CoordinatorState(run_id=run_id, main_authority=bytes(32), join_authority=bytes(32), phase=Phase.Warmup,
                             step=0, config=spec.config, model=spec.model, checkpoints=places(spec.checkpoint))
    replica = StageReplica.create(state, "body1", model_config(state), dht=new_dht(), keypair=Keypair(),
                                  host="127.0.0.1", trainer_allowed=lambda pubkey: True,
                                  roster=lambda: Roster(0, frozenset()), say=lambda line: None)
    try:
        assert replica.worker.compute.wire_codec == "int8"
    finally:
        replica.stop()
