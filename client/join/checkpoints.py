"""Where a worker saves its stage: at the end of an epoch (a checkpoint) and every few steps (a snapshot).

A checkpoint of stage ``s`` is three files (``stage_files``):
- ``<stage>.safetensors``: the stage's ``state_dict`` in fp32, keyed by the full model's tensor names, so that
  merging every stage's file gives the whole model (``client.models.export``). Safetensors, not pickle:
  a checkpoint may come from anyone on the Hub, and reading it must never run code.
- ``<stage>.optim.pt``: the AdamW state of each parameter, keyed by the parameter's name (``{name: {"step",
  "exp_avg", "exp_avg_sq"}}``), plain tensors read back with ``torch.load(weights_only=True)``, which refuses
  anything but tensors and containers. Hyper-parameters are not saved: they come from the run's config, never
  from a file. Optional: a stage without it starts with fresh moments.
- ``<stage>.json``: ``{"step": N}``, the swarm step it was taken at, which tells a joiner how stale it is.

Locally they live in ``<dir>/<run_id>/epoch-<E>/``; on the Hub in the repo's branch ``epoch-<E>``, so that a stage's
workers report the same (repo, revision): the coordinator keeps each stage's first place of the epoch. Files are
written to a temporary name and renamed, so a crash never leaves a half-written stage behind.

An epoch's checkpoint misses every stage whose workers died before Cooldown, and a stage that empties ends
the epoch: its next worker would find neither a checkpoint nor a peer, and start again from the run's seed.
So an active worker also saves a snapshot every ``SNAPSHOT_EVERY`` steps, the same files in
``<dir>/<run_id>/snapshots/step-<N>/``, keeping its stage's ``SNAPSHOTS_KEPT`` newest; a worker taking a
stage starts from the newest one when nothing newer holds it (``client.join.stage_replica``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger("psyswarm.checkpoints")

SNAPSHOT_EVERY = 10
"""Steps between two snapshots of a stage, unless the worker is told otherwise (``join-run --snapshot-every``): a
stage that empties loses at most this many steps of its training."""
SNAPSHOTS_KEPT = 2
"""A stage's snapshots kept on disk: the newest may be cut short by a crash, the one before it is whole."""
_SNAPSHOT_NAME = re.compile(r"step-(\d+)")
ADAMW_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})
"""What AdamW keeps per parameter, and all a saved optimizer state may hold."""

OptimizerState = dict[str, dict[str, "torch.Tensor"]]
"""A stage's optimizer state as saved: parameter name -> AdamW's tensors for it."""


class CheckpointError(ValueError):
    """A checkpoint file is unreadable or does not fit the stage; the message names the file and the problem."""


def stage_files(stage: str) -> tuple[str, str, str]:
    """(weights, optimizer state, metadata) file names of a stage, locally and on the Hub."""
    return f"{stage}.safetensors", f"{stage}.optim.pt", f"{stage}.json"


def revision_for(epoch: int) -> str:
    return f"epoch-{epoch}"


def snapshot_root(checkpoint_dir: Path, run_id: str) -> Path:
    """Where a run's snapshots live under a worker's checkpoint directory."""
    return checkpoint_dir / run_id / "snapshots"


def snapshot_dirs(root: Path, stage: str) -> list[tuple[int, Path]]:
    """The snapshots of ``stage`` under ``root``, as (step, directory), newest first."""
    if not root.is_dir():
        return []
    weights = stage_files(stage)[0]
    found = [(int(match[1]), path) for path in root.iterdir()
             if (match := _SNAPSHOT_NAME.fullmatch(path.name)) and (path / weights).is_file()]
    return sorted(found, reverse=True)


def save_snapshot(root: Path, stage: str, tensors: dict[str, torch.Tensor], step: int,
                  optimizer: OptimizerState | None = None) -> list[Path]:
    """Save ``stage`` as it stands after ``step`` steps, then drop its snapshots older than the kept ones."""
    files = save_stage(root / f"step-{step}", stage, tensors, step, optimizer)
    for _, directory in snapshot_dirs(root, stage)[SNAPSHOTS_KEPT:]:
        with contextlib.suppress(OSError):  # other workers on this machine may be filling or pruning it too
            for name in stage_files(stage):
                (directory / name).unlink(missing_ok=True)
            directory.rmdir()  # fails while other stages' snapshots of that step remain, which is as it should
    return files


def save_stage(directory: Path, stage: str, tensors: dict[str, torch.Tensor], step: int,
               optimizer: OptimizerState | None = None) -> list[Path]:
    """Write the stage's files into ``directory`` atomically, weights first; returns their paths (no optimizer
    file without ``optimizer``). Each writer has its own temporary name: several workers of one stage may share
    a machine, and so a directory."""
    import torch  # here, not at the top: the CLI reads this module's defaults without loading torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weights_name, optim_name, meta_name = stage_files(stage)
    fp32 = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
    writes: list[tuple[Path, Callable[[Path], object]]] = [
        (directory / weights_name, lambda tmp: save_file(fp32, str(tmp), metadata={"format": "pt"}))]
    if optimizer is not None:
        writes.append((directory / optim_name, lambda tmp: torch.save(optimizer, tmp)))
    writes.append((directory / meta_name, lambda tmp: tmp.write_text(json.dumps({"step": step}))))
    for target, write in writes:
        tmp = target.with_name(f"{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        write(tmp)
        tmp.replace(target)
    return [target for target, _ in writes]


def upload_stage(files: list[Path], repo: str, revision: str, *, token: str | None, endpoint: str | None) -> None:
    """Put a saved stage on the Hub in branch ``revision`` (created if needed), in one commit."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_branch(repo, branch=revision, exist_ok=True)
    api.create_commit(repo, operations=[CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in files],
                      commit_message=f"psyswarm: {files[0].stem} at {revision}", revision=revision)
    log.info("uploaded %s to %s@%s", ", ".join(f.name for f in files), repo, revision)


# ----- reading: everything here may come from a stranger --------------------------------------------------

_HEADER_SLACK = 2**16  # bytes a file may hold beyond its tensors' for headers, names and the pickle itself
_ENTRY_SLACK = 2**10  # and per tensor (a safetensors header entry, a torch archive's record and its padding)


@dataclass(frozen=True)
class FileLimits:
    """The most bytes a stage's files can hold, from the stage itself: a file is checked against them before
    anything in it is decompressed or materialised (a small file must not unpack into gigabytes)."""

    weights: int
    optimizer: int

    @classmethod
    def of(cls, module: nn.Module) -> FileLimits:
        """``module``'s state in fp32 (as saved), and AdamW's two moments and step per parameter."""
        tensors = module.state_dict()
        weights = sum(4 * t.numel() + _ENTRY_SLACK for t in tensors.values()) + _HEADER_SLACK
        params = list(module.parameters())
        optimizer = sum(8 * p.numel() + 4 + 3 * _ENTRY_SLACK for p in params) + _HEADER_SLACK
        return cls(weights, optimizer)


def _check_size(path: Path, limit: int, where: str) -> None:
    size = path.stat().st_size
    if size > limit:
        raise CheckpointError(f"{where} is {size} bytes, more than this stage's state can hold ({limit})")


def _check_archive(path: Path, limit: int, where: str) -> None:
    """Refuse a torch archive that is too large, compressed (``torch.save`` stores its records uncompressed;
    a compressed one inflates inside ``torch.load`` before anything can be checked) or not a zip at all
    (the legacy format has no sizes to check)."""
    _check_size(path, limit, where)
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{where} is not a torch archive: {exc}") from None
    if any(record.compress_type != zipfile.ZIP_STORED for record in records):
        raise CheckpointError(f"{where} holds compressed records; torch.save writes none")
    unpacked = sum(record.file_size for record in records)
    if unpacked > limit:
        raise CheckpointError(f"{where} unpacks to {unpacked} bytes, more than this stage's state can hold "
                              f"({limit})")


def read_weights(path: Path, where: str, limit: int) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file of at most ``limit`` bytes, on the CPU (a parser that only reads
    tensors: no code runs)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        _check_size(path, limit, where)
    except OSError as exc:
        raise CheckpointError(f"{where} is not readable: {exc}") from None
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where} is not a readable safetensors file: {exc}") from None


def check_weights(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse ``tensors`` unless they are exactly the stage's: the same names, shapes and dtypes, all finite."""
    import torch

    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{where} does not match this stage: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in tensors.items():
        want = expected[name]
        if tensor.shape != want.shape or tensor.dtype != want.dtype:
            raise CheckpointError(f"{where}: {name} is {tensor.dtype} {list(tensor.shape)}, this stage needs "
                                  f"{want.dtype} {list(want.shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{where}: {name} holds non-finite values")


def read_optimizer_state(path: Path, where: str, limit: int) -> object:
    """An ``.optim.pt`` file's content, unpickled with ``weights_only=True`` (tensors and containers only) once
    its archive is known to unpack to at most ``limit`` bytes; ``check_optimizer_state`` says whether it fits."""
    import torch

    try:
        _check_archive(path, limit, where)
    except OSError as exc:
        raise CheckpointError(f"{where} is not readable: {exc}") from None
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises many types for a corrupt or hostile file; all mean "unusable"
        raise CheckpointError(f"{where} is not a loadable optimizer state: {exc}") from None


def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerState:
    """A copy of ``optimizer``'s per-parameter state, keyed by ``module``'s parameter names, on the CPU."""
    state = optimizer.state
    return {name: {k: v.detach().to("cpu", copy=True) for k, v in state[param].items()}
            for name, param in module.named_parameters() if param in state}


def check_optimizer_state(saved: object, module: nn.Module, where: str) -> OptimizerState:
    """``saved`` if it is AdamW state for some of ``module``'s parameters: per parameter exactly ``ADAMW_STATE``,
    moments of the parameter's shape and dtype, non-negative second moments and step, all finite."""
    import torch

    params = dict(module.named_parameters())
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} does not hold a dict of parameter states")
    for name, entry in saved.items():
        param = params.get(name) if isinstance(name, str) else None
        if param is None:
            raise CheckpointError(f"{where}: {name!r} is not a parameter of this stage")
        if not isinstance(entry, dict) or set(entry) != ADAMW_STATE:
            raise CheckpointError(f"{where}: the state of {name} must hold exactly {sorted(ADAMW_STATE)}")
        if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in entry.values()):
            raise CheckpointError(f"{where}: the state of {name} must hold float32 tensors")
        if entry["step"].numel() != 1 or any(entry[k].shape != param.shape for k in ("exp_avg", "exp_avg_sq")):
            raise CheckpointError(f"{where}: the state of {name} does not have its parameter's shape "
                                  f"{list(param.shape)}")
        if not all(bool(torch.isfinite(t).all()) for t in entry.values()):
            raise CheckpointError(f"{where}: the state of {name} holds non-finite values")
        if float(entry["step"]) < 0 or bool((entry["exp_avg_sq"] < 0).any()):
            raise CheckpointError(f"{where}: the state of {name} holds a negative step or second moment")
    return saved  # type: ignore[return-value]


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, saved: OptimizerState) -> None:
    """Replace ``optimizer``'s per-parameter state with a checked ``saved`` state, keeping its own
    hyper-parameters (``param_groups``): those are the run's, and a file has no say in them."""
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    params = dict(module.named_parameters())
    current = optimizer.state_dict()
    current["state"] = {index[id(params[name])]: dict(entry) for name, entry in saved.items()
                        if id(params[name]) in index}
    optimizer.load_state_dict(current)
