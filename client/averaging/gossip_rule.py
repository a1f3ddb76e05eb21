"""PowerGossip's pure functions (Vogels et al., 2020; the round: ``client.averaging.gossip``): which part of each
tensor a pair mixes at a round, which way each of the two moves, and how far one round may move a replica.

A pair mixes each matrix along the rank-r directions in which the two differ most, and every other tensor (norms'
gains, biases, matrices too small to factor) an eighth at a round, every eighth element in turn.

A pair has no majority: whatever the partner sends, the robust reduction of two parts is their mean, so a lying
partner can move an honest replica anywhere along the directions it mixes. The bound comes from training instead:
two honest replicas drift apart only by the steps they take, so no round may move a tensor farther than
``MOVE_BOUND`` times this replica's own change of that tensor since it last mixed. A liar's pull on a round is then
at most what a couple of the replica's own rounds of training could do, and the training it joins pulls back.
"""

from __future__ import annotations

import math

import torch

VECTOR_SLICES = 8
"""Tensors sent whole are mixed this fraction at a round (every ``VECTOR_SLICES``-th element from the round's offset),
which keeps them under the factors' bytes: in float32 they would otherwise cost as much as every matrix's factors."""
MOVE_BOUND = 2.0
"""The most one round may move a tensor, in multiples of this replica's own change of it since its last mix. Two
honest replicas each step about as far, so their half distance along a few directions seldom exceeds it
(``tests/benchmarks/bench_seeds.py --bound``: the loss with and without it)."""


def sign(first: bool) -> int:
    """The sign a pair member sends its values with: + for the group's first peer, − for the second, so that the
    pair's mean is their half difference D = (M_first − M_second) / 2, and both then hold the same D."""
    return 1 if first else -1


def vector_part(numel: int, index: int) -> slice:
    """The elements of a whole-sent tensor (flattened) that round ``index`` mixes."""
    return slice(index % VECTOR_SLICES, numel, VECTOR_SLICES)


def part_size(numel: int) -> int:
    """The most elements ``vector_part`` holds at any round: the size of its buffer."""
    return -(-numel // VECTOR_SLICES)


def bounded(move: torch.Tensor, own_change: torch.Tensor, bound: float = MOVE_BOUND) -> tuple[torch.Tensor, bool]:
    """``move`` scaled down to at most ``bound`` × the norm of ``own_change`` (this replica's change of the same
    elements since it last mixed), and whether it had to be. A replica that did not train is not moved at all."""
    size = float(torch.linalg.vector_norm(move, dtype=torch.float64))
    if not math.isfinite(size):
        return torch.zeros_like(move), True
    limit = math.inf if bound == math.inf else bound * float(torch.linalg.vector_norm(own_change, dtype=torch.float64))
    if size <= limit:
        return move, False
    return move * (limit / size), True
