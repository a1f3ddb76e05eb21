"""Names of pipeline stages: the names workers announce in the DHT and checkpoints are filed under.

Kept free of heavy imports so that the CLI's status view and the coordinator client can use them without
loading torch.

May import: nothing outside this module.
"""

from __future__ import annotations

import hashlib

HAND_PICKED_INDICES = 1 << 16
"""uid indices below this are chosen by hand; every index derived from a key is above it."""


def stage_names(num_stages: int) -> list[str]:
    """``head, body1, …, bodyK, tail`` for ``num_stages`` = K + 2 stages."""
    if num_stages < 2:
        raise ValueError("a pipeline needs at least 2 stages (head and tail)")
    return ["head", *(f"body{i}" for i in range(1, num_stages - 1)), "tail"]


def stage_name(stage: int, num_stages: int) -> str:
    """The name of stage number ``stage``."""
    return stage_names(num_stages)[stage]


def checkpoint_location(repo: str, revision: str, *, hub: bool) -> str:
    """A saved checkpoint as ``psyswarm export --checkpoint`` takes it, and as every log and status line prints
    it: a local one's directory (``<dir>/<run_id>/epoch-<E>``, the run's checkpoint ``repo`` then its revision),
    or ``hub:<repo>@<revision>``."""
    return f"hub:{repo}@{revision}" if hub else f"{repo.rstrip('/')}/{revision}"


def worker_uid(stage: str, index: int) -> str:
    """The stage-prefixed id under which a worker announces itself."""
    return f"{stage}.0.{index}"


def default_index(pubkey: bytes) -> int:
    """The uid index bound to an identity: nobody else can announce it, and honest workers never collide."""
    return HAND_PICKED_INDICES + int.from_bytes(hashlib.sha256(pubkey).digest()[:8], "little")


def own_uid(stage: str, pubkey: bytes) -> str:
    """The uid a worker of ``stage`` with key ``pubkey`` announces and reports under in a coordinated run."""
    return worker_uid(stage, default_index(pubkey))
