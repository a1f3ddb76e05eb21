"""A worker's step counts each sample of its round once, and no sample of another round: a real body1 worker over
gRPC on loopback, told its round's samples as the runner tells it, and a trainer's signed requests.

Without this, a trainer stalled by a stage that emptied finished its old round's microbatches once a replacement
worker appeared, and they landed in the replacement's first step beside the new round's: 40 samples in a step of
a 32-sample global batch. A trainer that sends the same samples again under a new microbatch id would do the same.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from solders.keypair import Keypair

from client.pipeline.rpc import StageClient
from client.pipeline.worker import StageWorker
from tests.pipeline.conftest import TINY, signed_request

RUN = "step-samples"
BATCH = 8  # the round's global batch
MICRO = 2


class Trainer:
    def __init__(self, worker: StageWorker) -> None:
        self.worker, self.keypair = worker, Keypair()
        self.client = StageClient(worker.address, max_message_bytes=64 << 20)

    def microbatch(self, start: int, microbatch: str | None = None) -> None:
        """Forward then Backward of samples ``[start, start + MICRO)``, as ``PipelineTrainer`` sends them."""
        name = microbatch or uuid.uuid4().hex[:12]
        inputs = torch.randn(MICRO, TINY.seq_len, TINY.d_model)
        grad = torch.randn(MICRO, TINY.seq_len, TINY.d_model) * 0.01
        for method, tensors in (("Forward", {"input": inputs}), ("Backward", {"input": inputs, "grad_output": grad})):
            request = signed_request(self.keypair, "body1", method, tensors, run_id=RUN, microbatch=name, start=start,
                                     worker=self.worker.pubkey)
            self.client.call(method, request, timeout=30)

    def refused(self, start: int, microbatch: str | None = None) -> str:
        samples = self.worker.compute.samples_accumulated
        with pytest.raises(grpc.RpcError) as raised:
            self.microbatch(start, microbatch)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert self.worker.compute.samples_accumulated == samples, "a refused Backward accumulates nothing"
        return raised.value.details()


@pytest.fixture
def worker() -> Iterator[StageWorker]:
    started = StageWorker(TINY, "body1", run_id=RUN, max_batch_size=4).start()
    yield started
    started.stop(grace=0)


def test_a_step_takes_its_rounds_samples_once_and_no_others(worker: StageWorker) -> None:
    trainer = Trainer(worker)
    worker.ledger.expect_samples(0, BATCH)  # round 0: samples 0-8
    for start in range(0, BATCH, MICRO):
        trainer.microbatch(start)
    assert "already differentiated" in trainer.refused(2)  # round 0's samples again, under a new microbatch id
    assert "not in the round" in trainer.refused(BATCH)  # round 1's, before round 0 has stepped
    assert worker.step().samples == BATCH

    worker.ledger.expect_samples(BATCH, 2 * BATCH)  # round 1: samples 8-16
    assert "not in the round" in trainer.refused(6)  # round 0's last microbatch, finished late
    assert "not in the round" in trainer.refused(BATCH + 7)  # straddles round 1's end
    for start in range(BATCH, 2 * BATCH, MICRO):
        trainer.microbatch(start)
    assert worker.step().samples == BATCH


def test_a_refused_backward_may_be_sent_again_and_a_standalone_worker_takes_any_samples(worker: StageWorker) -> None:
    trainer = Trainer(worker)
    trainer.microbatch(0)
    trainer.microbatch(0)  # no round given: a standalone worker steps by sample count, whatever the samples
    assert worker.step().samples == 2 * MICRO
    worker.ledger.expect_samples(0, BATCH)
    trainer.microbatch(0, "first")
    assert "already differentiated" in trainer.refused(0, "first")  # the replay check still holds
    trainer.microbatch(2, "second")
    assert worker.step().samples == 2 * MICRO


def test_a_forward_outside_the_round_is_refused(worker: StageWorker) -> None:
    """A signed answer (``client.answers``) names its samples, which then pin the round and so the parameters every
    replica answers with: otherwise a trainer could ask one replica before a step and two after it, and show an
    honest answer to differ from the "majority"."""
    trainer = Trainer(worker)
    worker.ledger.expect_samples(BATCH, 2 * BATCH)  # round 1
    inputs = {"input": torch.randn(MICRO, TINY.seq_len, TINY.d_model)}
    stale = signed_request(trainer.keypair, "body1", "Forward", inputs, run_id=RUN, start=0, worker=worker.pubkey)
    with pytest.raises(grpc.RpcError) as raised:
        trainer.client.call("Forward", stale, timeout=30)
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not in the round" in raised.value.details()
    current = signed_request(trainer.keypair, "body1", "Forward", inputs, run_id=RUN, start=BATCH,
                             worker=worker.pubkey)
    assert trainer.client.call("Forward", current, timeout=30)
