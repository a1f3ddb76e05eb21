"""Shared fixtures: a tiny model, the stdlib dataset, one real loopback DHT, workers that clean up, and
signed requests as a trainer sends them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from solders.keypair import Keypair

from client.data import ByteDataset, open_byte_dataset
from client.pipeline.admission import RequestHeader, encode_request, now_ms
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.messages import decode_message, encode_message, tensor_digest
from client.pipeline.model import ModelConfig
from client.pipeline.worker import StageWorker

TINY = ModelConfig(n_layers=3, d_model=32, n_heads=2, seq_len=16, num_stages=3, seed=7)


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def dataset() -> ByteDataset:
    return open_byte_dataset(["stdlib"], TINY.seq_len)


@pytest.fixture
def directory(dht, run_id: str) -> WorkerDirectory:
    return WorkerDirectory(dht, run_id, TINY.fingerprint())


@pytest.fixture
def start_worker(dht, run_id: str) -> Iterator[Callable[..., StageWorker]]:
    """Start in-process workers announced under this test's run id (through the shared DHT node unless given
    ``dht``); all are stopped at the end."""
    started: list[StageWorker] = []

    def start(stage: str, **options: object) -> StageWorker:
        options.setdefault("config", TINY)
        options.setdefault("dht", dht)
        worker = StageWorker(stage=stage, run_id=run_id, **options)  # type: ignore[arg-type]
        started.append(worker.start())
        return worker

    yield start
    for worker in started:
        worker.stop(grace=0)


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def signed_request(
    keypair: Keypair,
    stage: str,
    method: str,
    tensors: dict[str, torch.Tensor],
    *,
    worker: bytes | str,
    run_id: str = "psyswarm",
    microbatch: str | None = None,
    start: int = 0,
    end: int | None = None,
    dtype: str = "float32",
    issued_at: int | None = None,
    **meta_overrides: object,
) -> bytes:
    """A Forward or Backward request signed by ``keypair`` as ``PipelineTrainer`` signs one for the worker whose
    public key is ``worker`` (raw or hex), covering samples ``[start, end)`` (``end`` defaults to
    ``start + batch``); ``meta_overrides`` then replace metadata fields without re-signing."""
    batch = int(tensors["input"].shape[0]) if "input" in tensors and tensors["input"].dim() else 1
    header = RequestHeader(
        run_id=run_id,
        stage=stage,
        kind=method.lower(),
        trainer=bytes(keypair.pubkey()).hex(),
        worker=worker if isinstance(worker, str) else worker.hex(),
        microbatch_id=microbatch or uuid.uuid4().hex[:12],
        sample_start=start,
        sample_end=start + batch if end is None else end,
        dtype=dtype,
        issued_at=now_ms() if issued_at is None else issued_at,
        digests={name: tensor_digest(tensor) for name, tensor in tensors.items()},
    )
    payload = encode_request(keypair, header, tensors)
    if not meta_overrides:
        return payload
    meta, decoded = decode_message(payload, max_elements=1 << 30)
    return encode_message({**meta, **meta_overrides}, decoded)  # type: ignore[dict-item]
