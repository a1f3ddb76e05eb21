"""A worker over real gRPC: bad input to every RPC is refused with the reason, and it keeps serving."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest
import torch
from solders.keypair import Keypair

from client.pipeline.messages import decode_message, encode_message
from client.pipeline.rpc import StageClient
from client.pipeline.trainer import receipt_of
from client.pipeline.worker import StageWorker

from .conftest import TINY, signed_request

B, T, D = 2, TINY.seq_len, TINY.d_model
MAX_BATCH = 4
KEYS = {stage: Keypair() for stage in ("head", "body1", "tail")}  # each stage's worker's: requests name it


@pytest.fixture(scope="module")
def workers():
    """One worker per stage without a DHT: only the RPC surface is under test here."""
    started = {s: StageWorker(TINY, s, max_batch_size=MAX_BATCH, keypair=KEYS[s]).start() for s in KEYS}
    clients = {s: StageClient(w.address, max_message_bytes=64 << 20) for s, w in started.items()}
    yield started, clients
    for client in clients.values():
        client.close()
    for worker in started.values():
        worker.stop(grace=0)


TRAINER = Keypair()


def request(stage: str, method: str, tensors: dict[str, torch.Tensor], **options: object) -> bytes:
    """A request signed for the worker of ``stage``."""
    options.setdefault("worker", bytes(KEYS[stage].pubkey()))
    return signed_request(TRAINER, stage, method, tensors, **options)  # type: ignore[arg-type]


def tokens(batch: int = B, length: int = T) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), dtype=torch.uint8)


def hidden(batch: int = B, length: int = T, width: int = D) -> torch.Tensor:
    return torch.randn(batch, length, width)


def valid(stage: str, method: str) -> bytes:
    tensors = {"input": tokens() if stage == "head" else hidden()}
    if stage == "tail":
        tensors["targets"] = tokens()
    elif method == "Backward":
        tensors["grad_output"] = hidden()
    return request(stage, method, tensors)


# Signed payloads are built when their test runs: a request signed at collection would have expired by
# then in a long session (a worker accepts requests issued within the last 600 s).
BAD = [
    ("head", "Forward", b"garbage", "bad magic"),
    ("head", "Forward", b"", "truncated"),
    ("head", "Forward", lambda: valid("head", "Forward")[:-3], "truncated"),
    ("head", "Forward", lambda: request("body1", "Forward", {"input": tokens()}),
     "stage 'body1' sent to a worker of stage"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, trainer=""), "'trainer'"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, trainer="t"), "64 lowercase hex"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, worker="W" * 64), "'worker'"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, microbatch=7), "'microbatch'"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, dtype="float64"), "'dtype'"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, sample_start=-1), "'sample_start'"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()}, end=B + 1),
     "do not match the batch of 2"),
    ("head", "Forward", lambda: request("head", "Forward", {}), "needs tensors"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens(), "x": tokens()}), "needs tensors"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": hidden()}), "uint8 or int64"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": torch.full((B, T), 300)}), "outside 0..255"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": torch.full((B, T), -1)}), "outside 0..255"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens(length=T + 1)}), "sequence length"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens(batch=MAX_BATCH + 1)}), "batch size"),
    ("head", "Forward", lambda: request("head", "Forward", {"input": tokens()[0]}), "2 dimensions"),
    ("body1", "Forward", lambda: request("body1", "Forward", {"input": hidden(width=D + 1)}), "d_model"),
    ("body1", "Forward", lambda: request("body1", "Forward", {"input": hidden()[..., :0]}), "d_model"),
    ("body1", "Forward", lambda: request("body1", "Forward", {"input": hidden() * float("nan")}), "NaN"),
    ("body1", "Forward", lambda: request("body1", "Forward", {"input": tokens()}), "in this run's wire codec float32"),
    # A full-size tensor beyond the worker's batch limit is refused before being decoded.
    ("body1", "Forward", lambda: request("body1", "Forward", {"input": hidden(batch=64)}), "exceeds"),
    ("body1", "Backward", lambda: request("body1", "Backward", {"input": hidden()}), "grad_output"),
    (
        "body1",
        "Backward",
        lambda: request("body1", "Backward", {"input": hidden(), "grad_output": hidden(batch=1)}),
        "must match the output shape",
    ),
    ("head", "Backward", lambda: request("head", "Backward", {"input": tokens(), "grad_output": hidden() / 0}), "NaN"),
    ("tail", "Forward", lambda: request("tail", "Forward", {"input": hidden()}), "targets"),
    (
        "tail",
        "Backward",
        lambda: request("tail", "Backward", {"input": hidden(), "targets": tokens(length=3)}),
        "targets shape",
    ),
    (
        "tail",
        "Backward",
        lambda: request("tail", "Backward", {"input": hidden(), "targets": tokens(), "grad_output": hidden()}),
        "needs tensors",
    ),
    ("tail", "Info", b"junk", "malformed Info"),
    ("tail", "Info", encode_message({}, {"x": torch.zeros(1)}), "exceeds the limit of 0"),
    ("tail", "Info", encode_message({}, {"x": torch.zeros(0)}), "carries no tensors"),
]


@pytest.mark.parametrize("stage, method, payload, reason", BAD, ids=[f"{s}-{m}-{r}" for s, m, _, r in BAD])
def test_bad_request_gets_invalid_argument_and_worker_keeps_serving(workers, stage, method, payload, reason):
    started, clients = workers
    with pytest.raises(grpc.RpcError) as raised:
        clients[stage].call(method, payload() if callable(payload) else payload, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in raised.value.details()
    # The worker still serves a valid request afterwards.
    _, out = decode_message(clients[stage].call("Forward", valid(stage, "Forward"), timeout=10), max_elements=10**6)
    assert stage == "tail" or out["output"].shape == (B, T, D)
    assert started[stage].compute.samples_accumulated == 0  # a refused request changes nothing


def test_every_method_answers_a_valid_request(workers) -> None:
    started, clients = workers
    info, _ = decode_message(clients["body1"].call("Info", encode_message({}, {}), timeout=10), max_elements=0)
    assert info["stage"] == "body1" and info["model"] == TINY.fingerprint() and info["config.d_model"] == D
    _, out = decode_message(clients["body1"].call("Forward", valid("body1", "Forward"), timeout=10), max_elements=10**6)
    assert out["output"].shape == (B, T, D)
    tail_meta, tail_out = decode_message(
        clients["tail"].call("Backward", valid("tail", "Backward"), timeout=10), max_elements=10**6
    )
    assert tail_out["grad_input"].shape == (B, T, D) and 4 < tail_meta["loss"] < 7
    [receipt] = started["tail"].drain_receipts()
    assert (receipt.trainer_id, receipt.sample_start, receipt.sample_end) == (bytes(TRAINER.pubkey()).hex(), 0, B)
    assert receipt.grad_input_digest == tail_meta["receipt.grad_input_digest"]
    assert started["tail"].drain_receipts() == []
    # The answer carries the receipt the worker signed, with its identity, for the round it serves (standalone: 0).
    assert receipt_of(tail_meta) == receipt and receipt.worker == started["tail"].pubkey.hex() and receipt.verifies()
    assert (receipt.epoch, receipt.round) == (0, 0)
    altered = dataclasses.replace(receipt, sample_end=B + 1)
    assert altered.signature == receipt.signature and not altered.verifies()

    before = [p.clone() for p in started["tail"].parameters()]
    stats = started["tail"].step()
    assert stats.samples == B and stats.grad_norm > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, started["tail"].parameters(), strict=True))
    assert started["tail"].step().samples == 0  # gradients were zeroed


def test_phase_one_worker_refuses_batches(workers) -> None:
    started, clients = workers
    started["body1"].sync_phase = 1
    try:
        with pytest.raises(grpc.RpcError) as raised:
            clients["body1"].call("Forward", valid("body1", "Forward"), timeout=10)
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        started["body1"].sync_phase = 0
    with pytest.raises(ValueError, match="sync phase"):
        started["body1"].sync_phase = 3


def test_a_worker_unsure_of_its_state_refuses_batches_and_says_why(workers) -> None:
    """A worker whose gradient round was cut short answers nothing until its digest is checked, so no answer of it
    is compared with its stage's while they may honestly differ; the trainer goes to another replica."""
    started, clients = workers
    started["body1"].unsure = "its gradient round of step 3 did not complete (no group)"
    try:
        for method in ("Forward", "Backward"):
            with pytest.raises(grpc.RpcError) as raised:
                clients["body1"].call(method, valid("body1", method), timeout=10)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "until its state is checked: its gradient round of step 3" in raised.value.details()
        assert started["body1"].drain_receipts() == []  # nothing was computed, nothing receipted
    finally:
        started["body1"].unsure = None
    _, out = decode_message(clients["body1"].call("Forward", valid("body1", "Forward"), timeout=10),
                            max_elements=10**6)
    assert out["output"].shape == (B, T, D)  # served again once the check is over


def test_half_precision_activations_in_a_half_precision_run(workers) -> None:
    _, clients = workers
    inputs = hidden().half()
    forward = request("body1", "Forward", {"input": inputs}, microbatch="half", dtype="float16")
    with pytest.raises(grpc.RpcError, match="this run's wire codec is 'float32'"):  # the module's run is fp32
        clients["body1"].call("Forward", forward, timeout=10)
    with StageWorker(TINY, "body1", max_batch_size=MAX_BATCH, wire_codec="float16", keypair=KEYS["body1"]) as half:
        client = StageClient(half.address, max_message_bytes=64 << 20)
        _, out = decode_message(client.call("Forward", forward, timeout=10), max_elements=10**6)
        assert out["output"].dtype == torch.float16
        backward = request(
            "body1", "Backward", {"input": inputs, "grad_output": hidden().half()}, microbatch="half", dtype="float16"
        )
        _, out = decode_message(client.call("Backward", backward, timeout=10), max_elements=10**6)
        assert out["grad_input"].dtype == torch.float16
        client.close()


def test_batches_wait_while_held_and_run_once_released(workers) -> None:
    """While an averaging round holds the worker, requests queue instead of competing with it for the CPU."""
    started, clients = workers
    answered: list[float] = []

    def forward() -> None:
        clients["head"].call("Forward", valid("head", "Forward"), timeout=10)
        answered.append(time.monotonic())

    with started["head"].batches_held():
        caller = threading.Thread(target=forward)
        caller.start()
        time.sleep(0.5)
        assert not answered and started["head"].load == 1  # queued, not run
        released = time.monotonic()
    caller.join(10)
    assert answered and answered[0] >= released
