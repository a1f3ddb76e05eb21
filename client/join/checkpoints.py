"""Where a worker saves its stage at the end of an epoch: a local directory, or a Hugging Face repo.

A checkpoint of stage ``s`` is ``<stage>.pt`` (the stage's ``state_dict``) and ``<stage>.json``
(``{"step": N}``, the swarm step it was taken at, which tells a joiner how stale it is). Locally they live
in ``<dir>/<run_id>/epoch-<E>/``; on the Hub in the repo's branch ``epoch-<E>``, so that every stage's
worker reports the same (repo, revision) and the coordinator sees the checkpoint complete. Files are
written to a temporary name and renamed, so a crash never leaves a half-written stage behind.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("psyswarm.checkpoints")


def revision_for(epoch: int) -> str:
    return f"epoch-{epoch}"


def save_stage(directory: Path, stage: str, tensors: dict[str, torch.Tensor], step: int) -> list[Path]:
    """Write ``<stage>.pt`` and ``<stage>.json`` into ``directory`` atomically; returns both paths."""
    directory.mkdir(parents=True, exist_ok=True)
    weights, meta = directory / f"{stage}.pt", directory / f"{stage}.json"
    for target, write in ((weights, lambda tmp: torch.save(tensors, tmp)),
                          (meta, lambda tmp: tmp.write_text(json.dumps({"step": step})))):
        tmp = target.with_name(target.name + ".tmp")
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
