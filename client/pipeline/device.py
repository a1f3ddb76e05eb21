"""Where a worker computes, and in which precision.

A worker keeps its stage's parameters and optimizer state in float32 on its device (the master weights: an
update far smaller than a weight still changes it) and computes forward and backward under bfloat16
autocast where the device does that well: a CUDA GPU with bfloat16 support, where matrix products run on
tensor cores at several times the float32 rate and activations take half the memory.

On the CPU it computes in float32. CPU autocast exists, but on CPUs without bfloat16 units (most of the
ones contributors have) it is slower than float32, not faster, and it would make a CPU worker compute a
different function from the single-process reference the pipeline is tested against. Activations leave a
worker in the run's wire codec (``client.pipeline.wire``) whatever its compute dtype: every worker and
trainer of a run must agree on it, so it is the run's choice, and bfloat16 there is what sends a bf16
worker's activations as they were computed.
"""

from __future__ import annotations

import contextlib
import re

import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d{1,3}))?")


class DeviceError(ValueError):
    """A device that is malformed or not on this machine; the message says which and what is available."""


def parse_device(text: str) -> torch.device:
    """``auto`` (the first GPU when there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``; refuses a
    GPU this machine does not have instead of failing at the first tensor moved there."""
    match = _DEVICE.fullmatch(text.strip().lower())
    if match is None:
        raise DeviceError(f"device {text!r} is not one of {DEVICE_CHOICES}")
    name = match[0]
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"device {text!r}: no CUDA GPU is available here (torch {torch.__version__}); use cpu")
    index = int(match[1] or 0)
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                          f"numbered from 0")
    return torch.device("cuda", index)


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype a stage computes in on ``device``: bfloat16 on a CUDA GPU that supports it, else float32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a stage's forward and backward run in: bfloat16 autocast where ``compute_dtype`` says so
    (the parameters stay float32), nothing otherwise."""
    dtype = compute_dtype(device)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
