"""Names of pipeline stages: the names workers announce in the DHT and checkpoints are filed under.

Kept free of heavy imports so that the CLI's status view and the coordinator client can use them without
loading torch.

May import: nothing outside this module.
"""

from __future__ import annotations


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
