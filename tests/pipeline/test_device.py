"""Devices and precision: ``--device`` parsing against what the machine has, and a CPU worker that computes,
keeps its weights and its optimizer state in float32 (the CUDA path needs a GPU, which this machine lacks: its
choice of bf16 is tested as a decision, with torch's view of the hardware replaced)."""

from __future__ import annotations

import pytest
import torch
from solders.keypair import Keypair
from typer.testing import CliRunner

from client.cli import app
from client.identity import save_keypair
from client.pipeline import device as devices
from client.pipeline.compute import StageCompute
from client.pipeline.device import DeviceError, compute_dtype, parse_device
from client.pipeline.messages import decode_message
from client.pipeline.optim import OptimizerConfig
from client.receipts import ReceiptRound, SignedReceipt
from tests.pipeline.conftest import TINY, signed_request

TRAINER = Keypair()


@pytest.fixture
def one_gpu(monkeypatch) -> None:
    """torch sees one CUDA GPU with bf16 support (nothing is ever put on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_cpu_and_auto_without_a_gpu_compute_on_the_cpu_in_float32() -> None:
    assert not torch.cuda.is_available(), "this test describes a machine without a GPU"
    for text in ("auto", "cpu", " CPU "):
        assert parse_device(text) == torch.device("cpu")
    assert compute_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "cuda:-1", "", "cpu:0", "cuda:1:2", "mps"])
def test_a_malformed_device_is_refused_by_name(text: str) -> None:
    with pytest.raises(DeviceError, match=r"is not one of auto, cpu, cuda or cuda:N"):
        parse_device(text)


def test_a_gpu_the_machine_lacks_is_refused() -> None:
    for text in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError, match="no CUDA GPU is available here"):
            parse_device(text)


def test_with_one_gpu_auto_picks_it_and_it_computes_in_bf16(one_gpu) -> None:
    assert parse_device("auto") == parse_device("cuda") == parse_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=r"has 1 CUDA GPU\(s\), numbered from 0"):
        parse_device("cuda:1")
    assert compute_dtype(torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype(torch.device("cpu")) == torch.float32, "a GPU elsewhere changes nothing for the CPU"


def test_a_gpu_without_bf16_computes_in_float32(one_gpu, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert compute_dtype(torch.device("cuda", 0)) == torch.float32
    assert isinstance(devices.autocast(torch.device("cuda", 0)), type(devices.autocast(torch.device("cpu"))))


def test_a_cpu_stage_computes_and_keeps_everything_in_float32() -> None:
    worker, round_ = Keypair(), ReceiptRound("psyswarm", 0, 0)
    compute = StageCompute(TINY, "body1", OptimizerConfig(), uid="body1.0.0", run_id="psyswarm", max_batch_size=4,
                           device=parse_device("cpu"), signer=worker)
    x = torch.randn(2, TINY.seq_len, TINY.d_model, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(2, TINY.seq_len, TINY.d_model, generator=torch.Generator().manual_seed(1))
    expected = compute.module(x)
    _, out = decode_message(compute.forward(compute.parse(signed_request(TRAINER, "body1", "Forward", {"input": x},
                                                                         worker=compute.key), backward=False)),
                            max_elements=10**6)
    assert out["output"].dtype == torch.float32 and torch.equal(out["output"], expected.detach())
    payload = signed_request(TRAINER, "body1", "Backward", {"input": x, "grad_output": grad}, worker=compute.key)
    response, _ = compute.backward(compute.parse(payload, backward=True),
                                   lambda work: SignedReceipt.sign(worker, work, round_))
    _, back = decode_message(response, max_elements=10**6)
    assert back["grad_input"].dtype == torch.float32
    assert compute.step().applied
    state = [t for s in compute.optimizer.optimizer.state.values() for t in s.values()]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in compute.module.parameters())


COMMANDS = {"worker": ["worker", "--stage", "head", "--run-id", "r"],
            "join-run": ["join-run", "--run-id", "r", "--role", "worker", "--server", "127.0.0.1:1",
                         "--initial-peer", "/ip4/127.0.0.1/tcp/1"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("device", "message"), [("tpu", "is not one of"), ("cuda:0", "no CUDA GPU is available")])
def test_the_commands_refuse_a_bad_device_in_one_line(tmp_path, command: str, device: str, message: str) -> None:
    key = tmp_path / "id.json"
    save_keypair(Keypair(), key)
    result = CliRunner().invoke(app, [*COMMANDS[command], "--keypair", str(key), "--device", device])
    assert result.exit_code == 2 and message in result.output and "--device" in result.output


@pytest.mark.parametrize(("role", "inflight", "message"), [
    ("trainer", "-1", "give auto or a whole number from 1 to 32"),
    ("worker", "4", "a worker sends no microbatches"),
])
def test_join_run_refuses_a_bad_inflight_in_one_line(tmp_path, role: str, inflight: str, message: str) -> None:
    key = tmp_path / "id.json"
    save_keypair(Keypair(), key)
    args = ["join-run", "--run-id", "r", "--role", role, "--server", "127.0.0.1:1",
            "--initial-peer", "/ip4/127.0.0.1/tcp/1", "--keypair", str(key), "--inflight", inflight]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in " ".join(result.output.replace("│", " ").split()), result.output
