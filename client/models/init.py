"""Deterministic initialisation shared by every model a run can train: the same numbers on every machine.

Every contributor builds only its own stage, yet all stages together must be exactly the model a single
process would build. So each parameter is drawn from its own random stream, seeded by the run's seed and the
parameter's name in the *whole* model, with NumPy's legacy ``RandomState`` (whose streams NumPy freezes across
versions, unlike torch's generators, which also differ between devices).
"""

from __future__ import annotations

import hashlib

import numpy as np

from client.stages import stage_names


def parameter_stream(seed: int, name: str) -> np.random.RandomState:
    """The random stream of the parameter called ``name`` (its global name) in a run seeded with ``seed``."""
    digest = hashlib.sha256(f"psyswarm-init:{seed}:{name}".encode()).digest()
    return np.random.RandomState(int.from_bytes(digest[:4], "little"))


def split_layers(n_layers: int, num_stages: int) -> dict[str, range]:
    """Global layer indices held by each stage: as even as possible, earlier stages take the remainder."""
    if n_layers < num_stages:
        raise ValueError(f"{n_layers} layers cannot fill {num_stages} stages (each stage needs a layer)")
    base, extra = divmod(n_layers, num_stages)
    split: dict[str, range] = {}
    start = 0
    for i, name in enumerate(stage_names(num_stages)):
        count = base + (1 if i < extra else 0)
        split[name] = range(start, start + count)
        start += count
    return split
