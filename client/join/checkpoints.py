"""Where a worker saves its stage: at the end of an epoch (a checkpoint) and every few steps (a snapshot).

A checkpoint of stage ``s`` is ``<stage>.pt`` (the stage's ``state_dict``) and ``<stage>.json``
(``{"step": N}``, the swarm step it was taken at, which tells a joiner how stale it is). Locally they live
in ``<dir>/<run_id>/epoch-<E>/``; on the Hub in the repo's branch ``epoch-<E>``, so that every stage's
worker reports the same (repo, revision) and the coordinator sees the checkpoint complete. Files are
written to a temporary name and renamed, so a crash never leaves a half-written stage behind.

An epoch's checkpoint misses every stage whose workers died before Cooldown, and a stage that empties ends
the epoch: its next worker would find neither a checkpoint nor a peer, and start again from the run's seed.
So an active worker also saves a snapshot every ``SNAPSHOT_EVERY`` steps, the same two files in
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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("psyswarm.checkpoints")

SNAPSHOT_EVERY = 10
"""Steps between two snapshots of a stage, unless the worker is told otherwise (``join-run --snapshot-every``): a
stage that empties loses at most this many steps of its training."""
SNAPSHOTS_KEPT = 2
"""A stage's snapshots kept on disk: the newest may be cut short by a crash, the one before it is whole."""
_SNAPSHOT_NAME = re.compile(r"step-(\d+)")


def revision_for(epoch: int) -> str:
    return f"epoch-{epoch}"


def snapshot_root(checkpoint_dir: Path, run_id: str) -> Path:
    """Where a run's snapshots live under a worker's checkpoint directory."""
    return checkpoint_dir / run_id / "snapshots"


def snapshot_dirs(root: Path, stage: str) -> list[tuple[int, Path]]:
    """The snapshots of ``stage`` under ``root``, as (step, directory), newest first."""
    if not root.is_dir():
        return []
    found = [(int(match[1]), path) for path in root.iterdir()
             if (match := _SNAPSHOT_NAME.fullmatch(path.name)) and (path / f"{stage}.pt").is_file()]
    return sorted(found, reverse=True)


def save_snapshot(root: Path, stage: str, tensors: dict[str, torch.Tensor], step: int) -> list[Path]:
    """Save ``stage`` as it stands after ``step`` steps, then drop its snapshots older than the kept ones."""
    files = save_stage(root / f"step-{step}", stage, tensors, step)
    for _, directory in snapshot_dirs(root, stage)[SNAPSHOTS_KEPT:]:
        with contextlib.suppress(OSError):  # other workers on this machine may be filling or pruning it too
            for name in (f"{stage}.pt", f"{stage}.json"):
                (directory / name).unlink(missing_ok=True)
            directory.rmdir()  # fails while other stages' snapshots of that step remain, which is as it should
    return files


def save_stage(directory: Path, stage: str, tensors: dict[str, torch.Tensor], step: int) -> list[Path]:
    """Write ``<stage>.pt`` and ``<stage>.json`` into ``directory`` atomically; returns both paths. Each writer
    has its own temporary name: several workers of one stage may share a machine, and so a directory."""
    import torch  # here, not at the top: the CLI reads this module's defaults without loading torch

    directory.mkdir(parents=True, exist_ok=True)
    weights, meta = directory / f"{stage}.pt", directory / f"{stage}.json"
    for target, write in ((weights, lambda tmp: torch.save(tensors, tmp)),
                          (meta, lambda tmp: tmp.write_text(json.dumps({"step": step})))):
        tmp = target.with_name(f"{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        write(tmp)
        tmp.replace(target)
    return [weights, meta]


def upload_stage(files: list[Path], repo: str, revision: str, *, token: str | None, endpoint: str | None) -> None:
    """Put a saved stage on the Hub in branch ``revision`` (created if needed), in one commit."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=endpoint, token=token)
    api.create_branch(repo, branch=revision, exist_ok=True)
    api.create_commit(repo, operations=[CommitOperationAdd(path_in_repo=f.name, path_or_fileobj=str(f)) for f in files],
                      commit_message=f"psyswarm: {files[0].stem} at {revision}", revision=revision)
    log.info("uploaded %s to %s@%s", ", ".join(f.name for f in files), repo, revision)
