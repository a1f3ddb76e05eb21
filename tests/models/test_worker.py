"""A worker of a Hugging Face model's stage over real gRPC: requests a trainer forges against the model's own
shapes are refused and change nothing."""

from __future__ import annotations

import grpc
import pytest
import torch
from solders.keypair import Keypair

from client.pipeline.messages import decode_message
from client.pipeline.rpc import StageClient
from client.pipeline.worker import StageWorker
from tests.pipeline.conftest import signed_request

from .conftest import SEQ_LEN, VOCAB, tiny_spec

TRAINER = Keypair()


@pytest.fixture(scope="module")
def head():
    worker = StageWorker(tiny_spec("qwen2"), "head", max_batch_size=4).start()
    client = StageClient(worker.address, max_message_bytes=64 << 20)
    yield worker, client
    client.close()
    worker.stop(grace=0)


@pytest.mark.parametrize("bad", [
    torch.full((2, SEQ_LEN), VOCAB, dtype=torch.uint8),  # one past the vocabulary, though a valid byte
    torch.full((2, SEQ_LEN), 5000, dtype=torch.int64),
    torch.full((2, SEQ_LEN + 1), 1, dtype=torch.int64),  # longer than the model's seq_len
])
def test_a_head_refuses_ids_outside_its_vocabulary_and_keeps_serving(head, bad) -> None:
    worker, client = head
    before = [p.clone() for p in worker.parameters()]
    with pytest.raises(grpc.RpcError) as raised:
        client.call("Backward", signed_request(TRAINER, "head", "Backward",
                                               {"input": bad, "grad_output": torch.ones(2, bad.shape[1], 32)},
                                               worker=worker.pubkey), timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"outside 0..{VOCAB - 1}" in raised.value.details() or "sequence length" in raised.value.details()
    assert worker.compute.samples_accumulated == 0
    assert all(torch.equal(a, b) for a, b in zip(before, worker.parameters(), strict=True))
    ok = torch.full((2, SEQ_LEN), VOCAB - 1, dtype=torch.int64)
    _, out = decode_message(client.call("Forward", signed_request(TRAINER, "head", "Forward", {"input": ok},
                                                                  worker=worker.pubkey), timeout=10),
                            max_elements=10**6)
    assert out["output"].shape == (2, SEQ_LEN, 32)
