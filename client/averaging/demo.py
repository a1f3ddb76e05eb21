"""The DeMo codec (Peng, Quesnelle & Kingma 2024, "Decoupled Momentum Optimization", as Psyche runs it): pure
functions on tensors and index declarations, so that every peer computes the same thing from the same inputs.

DeMo sends, instead of a gradient, the fast-moving components of a momentum: each tensor's momentum is cut into
chunks of ``chunk`` elements, each chunk goes through an orthonormal DCT-II, and a peer keeps the ``topk``
largest coefficients of each chunk. The DCT concentrates a smooth chunk's energy in few coefficients, and the
rest stays in the momentum (decoupled momentum) until it grows large enough to be sent.

Why the indices are declared: an all-reduce averages vectors of one length, element by element, so every peer
must send its coefficients at the same places. Each peer declares its chosen positions (for each chunk, ``topk``
ascending positions within it: small ints, one byte each in hivemind's msgpack) in its sealed declaration; every
admitted peer computes the same union U of the admitted declarations and sends its own coefficients at every
index of U. A declaration is a groupmate's untrusted input, so ``index_refusal`` checks it completely (count,
type, range, order) before it can shape U: a peer can make U at most ``topk`` per chunk larger, never malformed.

Why a basis matrix: torch has no DCT, and an FFT-based one would differ between builds in its last bits. The basis
is computed in float64 with numpy from its closed form and rounded to float32, the same on every peer; a DCT of
chunks is one matrix product (``chunks @ D.T``) and the inverse another (``coeffs @ D``), D being orthonormal.
Orthonormality also keeps any part of what a peer sends within the norm of its momentum, which the declared-norm
limits of the averaging layer rely on.

The round (``client.averaging.gradients``) sends, for each chunked gradient g (vectors and tensors smaller
than a chunk go in full), the fast-moving components of a momentum m, in one all-reduce:

    declare:  c = DCT(β·m + g, per chunk of ``chunk``);  the ``topk`` largest |c| of each chunk, their positions
    average:  U = the union of the admitted peers' positions (sorted: the same on every peer);  a = avg(c[U])
    result:   sign(IDCT(a scattered at U, zeros elsewhere));  momentum: m ← β·m + g − IDCT(c[U] at U)  (decoupled)

The positions are untrusted input: a groupmate whose list is malformed (count, type, range, order) or not the one its
seal covers (the sealed declaration holds their digest; the lists themselves travel beside it, read from the tensors
the host shares with the averaging process) is dropped like any groupmate whose declaration does not pass. Its
declared norm bounds its whole momentum, so every part it sends (c at U, the full tensors) lies within it. The result
goes through sign(), as in Psyche, although the worker's AdamW follows (which normalises each parameter's step by its
own running scale anyway): a component leaves the momentum only when it has grown large, often after many steps, so
the decoded averages are bursts that would inflate AdamW's second moment for many steps after; their signs keep every
step's scale alike. Measured (tests/benchmarks/bench_gradients.py's README setting, DeMo 64/4 with SPARTA, 100
rounds, training loss against one process, single runs that vary by a few points): with sign +8.6 % and +4.7 % at β
0.999, +3.6 % and +6.1 % at β 0.9; without sign +12.9 % (β 0.999) and +13.4 % (β 0.9). β made no difference beyond
that noise; the default is 0.9 because the declared norm bounds the whole momentum, which at 0.999 holds up to a
thousand steps of untransmitted gradient and so loosens every groupmate's limit. DeMo's momentum moves, like
PowerSGD's error feedback, only when the round fully succeeded. """

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAX_CHUNK = 128
"""The largest chunk: a position within it is a msgpack positive fixint (one byte on the wire)."""


@functools.lru_cache(maxsize=8)
def dct_basis(chunk: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (chunk × chunk, float32): row k is the k-th cosine, D @ D.T = I."""
    n = np.arange(chunk, dtype=np.float64)
    basis = np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * chunk)) * math.sqrt(2 / chunk)
    basis[0] /= math.sqrt(2)
    return torch.from_numpy(basis.astype(np.float32))


def chunk_count(shape: Sequence[int], chunk: int) -> int | None:
    """How many chunks a gradient of ``shape`` is cut into, or None if it is sent in full: vectors (biases,
    norms), and tensors smaller than one chunk."""
    numel = math.prod(int(s) for s in shape)
    return -(-numel // chunk) if len(shape) >= 2 and numel >= chunk else None


def chunked(tensor: torch.Tensor, chunk: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded into rows of ``chunk`` elements (float32)."""
    flat = tensor.detach().reshape(-1).float()
    rows = -(-flat.numel() // chunk)
    return torch.nn.functional.pad(flat, (0, rows * chunk - flat.numel())).reshape(rows, chunk)


def unchunked(chunks: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The inverse of ``chunked``: the padding dropped, the rest in ``shape``."""
    return chunks.reshape(-1)[: math.prod(shape)].reshape(tuple(shape))


def encode(chunks: torch.Tensor) -> torch.Tensor:
    """The DCT-II coefficients of each row."""
    return chunks @ dct_basis(chunks.shape[1]).T


def decode(coefficients: torch.Tensor) -> torch.Tensor:
    """The rows whose DCT-II coefficients these are (the inverse of ``encode``)."""
    return coefficients @ dct_basis(coefficients.shape[1])


def top_positions(coefficients: torch.Tensor, topk: int) -> list[int]:
    """For each row, the positions of its ``topk`` largest coefficients in magnitude, ascending; all rows'
    concatenated, as a peer declares them."""
    picked = torch.topk(coefficients.abs(), topk, dim=1).indices
    return torch.sort(picked, dim=1).values.reshape(-1).tolist()


def index_refusal(declared: Any, chunks: int, chunk: int, topk: int) -> str:
    """Why ``declared`` is not one tensor's index declaration (``chunks`` × ``topk`` ints, each chunk's ``topk``
    strictly ascending in [0, ``chunk``)), or "" when it is."""
    if not isinstance(declared, list | tuple):
        return f"indices that are not a list ({type(declared).__name__})"
    if len(declared) != chunks * topk:
        return f"{len(declared)} indices, not {chunks * topk} ({topk} for each of {chunks} chunks)"
    if not all(type(i) is int for i in declared):  # bool is an int's subclass, and not an index
        return "indices that are not all ints"
    if not all(0 <= i < chunk for i in declared):
        return f"indices outside [0, {chunk})"
    positions = np.asarray(declared, dtype=np.int64).reshape(chunks, topk)
    if not bool((np.diff(positions, axis=1) > 0).all()):
        return "indices that are not ascending and distinct within each chunk"
    return ""


def declaration_refusal(declared: Any, counts: Sequence[int], chunk: int, topk: int, sealed: Any) -> str:
    """Why a groupmate's declared positions may not shape the union, or "": one well-formed list per chunked
    gradient (``counts``: their chunk counts), and the lists whose ``digest`` its seal covers (``sealed``)."""
    if not isinstance(declared, list | tuple) or len(declared) != len(counts):
        return f"it declares no list of {len(counts)} index lists (DeMo)"
    for i, (positions, n) in enumerate(zip(declared, counts, strict=True)):
        refusal = index_refusal(positions, n, chunk, topk)
        if refusal:
            return f"it declares, for chunked gradient {i}, {refusal}"
    if digest(declared) != sealed:
        return "it declares indices that its seal does not cover"
    return ""


def digest(declared: Sequence[Sequence[int]]) -> str:
    """The SHA-256 (hex) of well-formed index declarations, one per chunked tensor (positions below 256, so one
    byte each; every length is fixed by the run's settings and the tensors' shapes): what a peer seals, as the
    declarations themselves are too large for the seal's path (``client.averaging.gradients``)."""
    hashed = hashlib.sha256()
    for positions in declared:
        hashed.update(bytes(positions))
    return hashed.hexdigest()


def union(declarations: Sequence[Sequence[int]], chunk: int, topk: int) -> torch.Tensor:
    """The sorted flat indices (into a tensor's ``chunked`` coefficients) that any of ``declarations`` names:
    the same on every peer given the same declarations, whatever their order."""
    offsets = (torch.arange(len(declarations[0]) // topk) * chunk).repeat_interleave(topk)
    named = [offsets + torch.tensor(list(positions), dtype=torch.int64) for positions in declarations]
    return torch.unique(torch.cat(named), sorted=True)


def scatter(values: torch.Tensor, indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped as ``like`` (chunked coefficients): ``values`` at the flat ``indices``, zeros elsewhere."""
    dense = torch.zeros(like.numel(), dtype=values.dtype)
    dense[indices] = values
    return dense.reshape(like.shape)


@dataclass(frozen=True)
class Sending:
    """One peer's side of a DeMo round for its chunked gradients: the candidates c = β·m + g (chunks), their
    coefficients, the union of the group's declared positions and what it sends, its coefficients there (which the
    all-reduce replaces in place by the group's average)."""

    candidates: list[torch.Tensor]
    coefficients: list[torch.Tensor]
    unions: list[torch.Tensor]
    sent: list[torch.Tensor]

    @classmethod
    def of(cls, grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor], declared: Sequence[Any], chunk: int,
           topk: int, beta: float) -> Sending:
        """From the gradients, their momenta and the admitted peers' declared positions (each already checked by
        ``declaration_refusal``)."""
        candidates = [beta * m + chunked(g, chunk) for g, m in zip(grads, momenta, strict=True)]
        coefficients = [encode(c) for c in candidates]
        unions = [union([d[i] for d in declared], chunk, topk) for i in range(len(grads))]
        return cls(candidates, coefficients, unions, [c.reshape(-1)[u] for c, u in zip(coefficients, unions,
                                                                                          strict=True)])

    def keep_unsent(self, grads: Sequence[torch.Tensor], momenta: Sequence[torch.Tensor]) -> None:
        """Decoupled momentum: m ← c less what this peer sent (its own coefficients at the union)."""
        for g, m, c, coefficient, u in zip(grads, momenta, self.candidates, self.coefficients, self.unions,
                                           strict=True):
            m.copy_(c - decode(scatter(coefficient.reshape(-1)[u], u, c)))
            m.reshape(-1)[g.numel():] = 0  # the padding stands for no parameter

    def step_on_average(self, grads: Sequence[torch.Tensor]) -> None:
        """Each gradient becomes the sign of the IDCT of the averaged coefficients (zeros off the union)."""
        for g, c, averaged, u in zip(grads, self.candidates, self.sent, self.unions, strict=True):
            g.copy_(unchunked(decode(scatter(averaged, u, c)), g.shape).sign())
