"""Per-step gradient averaging between the workers of one pipeline stage: full, or compressed with PowerSGD or DeMo.

Before its optimizer step, each worker of a stage averages its mean gradient with the same-stage workers of
the same round through hivemind (matchmaking, then a butterfly all-reduce in chunks with timeouts), weighted
by the samples each accumulated, so that the replicas step as one process stepping on the whole batch would.
Sync-phase workers take part with weight 0: they receive the average and step with it, adding nothing.

Full mode all-reduces the gradients themselves. PowerSGD (Vogels et al. 2019) sends, for each matrix-shaped
gradient G (m × n, with error feedback E: M = G + E) and rank r, two small all-reduces instead of one large:

    phase P:  P = avg(M Q)          (m × r)  then P̂ = orthonormal(P)
    phase Q:  Q = avg(Mᵀ P̂)         (n × r)  with every small tensor (biases, norms) averaged in full
    result:   P̂ Qᵀ;   error:  E ← M − P̂ (Mᵀ P̂)ᵀ   (what this worker's compression lost, re-sent next step)

Q is warm-started from the previous round's averaged Q when every peer of the group holds the one from the
same complete round (they declare its tag), and otherwise drawn afresh from the run's seed and the round, so
that peers never multiply by different Qs.

DeMo (``client.averaging.demo``: Psyche's DisTrO) sends, for each chunked gradient, the largest DCT coefficients
of a decoupled momentum at the union of the positions the admitted peers declared, in one all-reduce, and steps on
the sign of the decoded average (the round, and why the sign: ``demo``'s docstring).

Error feedback with a backup (the seeds' multi-party stack). hivemind's PowerSGDGradientAverager adds the
gradient to the error buffer before phase P and keeps it there when a phase fails, so a failed worker counts
its own error again next step on top of the local step it took. Here the buffer is copied to a backup when
the round starts and restored when either phase raises or ends incomplete (a peer banned as a sender or a
reducer whose shard never came back), so it only moves when both phases fully succeeded.

Faults. A failed all-reduce keeps its partial result (a dead reducer's shard keeps local values; a dead
sender is banned for the round) and is not retried; a worker whose round failed steps with what it has — its
own gradient, partly averaged at most — and stays consistent. Non-finite averaged elements fall back to the
local value.

Untrusted groupmates. Each peer declares its round, weight (samples), the trainer-signed headers of the Backwards
its gradient sums (in a coordinated run its weight is at most the samples they prove: ``client.averaging.work``)
and the L2 norm of what it will send; every part of its contribution in either phase is bounded by that norm (P̂
and Q̂ are orthonormal), and by what the run's codec (``values``: float32, float16, int8 or int4) can add to it. A peer
claiming more than ``max_weight`` samples (a round's global batch) is dropped before the all-reduce
(``membership``). A reducer bans for the round any sender whose part is non-finite, not in the run's codec, larger
than it declared, sent with a weight other than the declared one, or from a peer declaring a norm above ``factor``
× the group's lower median, so a poisoned contribution never enters an average. A reducer is a groupmate too: a
part it returns that is non-finite or larger than any honest average of the group could be (``_GroupLimits``)
fails that reducer, whose shard keeps the local values, while every other shard of the tensor is averaged. The
samples a round reports exclude every groupmate dropped, left without a limit, or banned by this peer's reducers
(a sender banned only by another reducer still counts: its other parts were taken).

Why not hivemind's own classes: ``GradientAverager`` keeps its own accumulators fed by ``accumulate_grads_``,
while a worker accumulates into ``.grad`` behind its admission bound; ``PowerSGDGradientAverager`` has the
error-buffer problem above, draws its initial Q from each process's own RNG (peers then multiply by different
Qs until some round succeeds), and hands the first phase tensor infos of the full gradients. Their building
blocks are used as they are: the all-reduce runner, the phase registration, ``orthogonalize_``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Self

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.optim.power_sgd_averager import AllReducePhases, PowerSGDGradientAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import enter_asynchronously
from hivemind.utils.math import orthogonalize_

from client.averaging import demo, packing
from client.averaging.membership import Declared, Membership, Roster
from client.averaging.powersgd import compressed_shape, seeded_matrix
from client.averaging.rounds import GRACE, Wedged, holding, run_round
from client.averaging.sparta import AveragingStatus, SpartaSettings, averager_prefix
from client.averaging.stage_averager import StageAverager
from client.averaging.values import GradValues, codec, decode, norm_bound
from client.averaging.work import WorkRule, evidence

if TYPE_CHECKING:
    import hivemind

    from client.pipeline.admission import RequestHeader
    from client.pipeline.worker import StageWorker

log = logging.getLogger("psyswarm.gradients")

_TAG_BYTES = 64  # room for a group id (hivemind's are 20-32 bytes) plus a phase name
_COMPLETE, _PARTIAL = 1, 2  # how the last round's phases ended, as the averaging process reports it


class GradAveraging(Enum):
    """A run's per-step gradient averaging (the state.toml ``grad_averaging`` values)."""

    OFF = "off"
    FULL = "full"
    POWERSGD = "powersgd"
    DEMO = "demo"


@dataclass(frozen=True)
class GradientSettings:
    """How a stage averages its gradients; ``timeouts`` are the same as SPARTA rounds'."""

    mode: GradAveraging = GradAveraging.FULL
    rank: int = 0  # PowerSGD's rank, 1..64
    timeouts: SpartaSettings = SpartaSettings()
    factor: float = 100.0  # a contribution above factor × the group's lower-median norm is refused
    max_weight: float = math.inf  # the most samples a peer may claim (a round's global batch)
    round_samples: int = 0  # a round's global batch: each weight is at most the samples its trainer-signed
    # Backwards prove (``client.averaging.work``); 0 takes declared weights as they are (a run without a coordinator)
    min_compression: float = 2.0  # PowerSGD compresses a matrix only if that shrinks it at least this much
    chunk: int = 0  # DeMo's chunk (elements per DCT), 2..demo.MAX_CHUNK
    topk: int = 0  # DeMo's coefficients sent per chunk, 1..chunk - 1
    beta: float = 0.9  # DeMo's momentum decay (why not Psyche's 0.999: the module docstring)
    values: GradValues = GradValues.FLOAT32  # how averaged values travel (``client.averaging.values``)

    def __post_init__(self) -> None:
        if self.mode == GradAveraging.OFF:
            raise ValueError("GradientSettings describe averaging: mode must be full, powersgd or demo")
        if (self.mode == GradAveraging.POWERSGD) != (1 <= self.rank <= 64):
            raise ValueError(f"rank must be 1..64 with powersgd and 0 otherwise, got {self.rank} with "
                             f"{self.mode.value}")
        if self.mode == GradAveraging.DEMO:
            if not (2 <= self.chunk <= demo.MAX_CHUNK and 1 <= self.topk < self.chunk):
                raise ValueError(f"demo needs a chunk of 2..{demo.MAX_CHUNK} elements and a topk of 1..chunk - 1, "
                                 f"got chunk {self.chunk} topk {self.topk}")
            if not 0 <= self.beta < 1:
                raise ValueError(f"demo's momentum beta must be in [0, 1), got {self.beta}")
        elif self.chunk or self.topk:
            raise ValueError(f"chunk and topk must be 0 unless mode is demo, got chunk {self.chunk} topk "
                             f"{self.topk} with {self.mode.value}")
        if not (self.factor > 1 and self.max_weight > 0 and self.min_compression >= 1 and self.round_samples >= 0):
            raise ValueError("factor must exceed 1, max_weight be positive, min_compression at least 1 and "
                             "round_samples not negative")


def round_payload(shapes: Sequence[Sequence[int]], settings: GradientSettings, group_size: int = 1) -> list[list[int]]:
    """The sizes of the tensors each all-reduce of one round hands hivemind, one list per all-reduce, for gradients
    of ``shapes`` in a group of ``group_size`` equal peers: full averaging's gradients as they are; PowerSGD's P
    factors, then its Q factors with the tensors sent in full, and DeMo's picks (the most a union of the group's can
    hold) with the tensors sent in full, each laid end to end in a piece per reducer (``packing``)."""
    def pieces(sizes: list[int]) -> list[int]:
        return packing.piece_sizes(sum(sizes), [1.0] * group_size)

    if settings.mode == GradAveraging.DEMO:
        union = min(settings.chunk, settings.topk * group_size)
        counts = [demo.chunk_count(shape, settings.chunk) for shape in shapes]
        return [pieces([math.prod(shape) if n is None else n * union for shape, n in zip(shapes, counts, strict=True)])]
    rank = settings.rank if settings.mode == GradAveraging.POWERSGD else 0
    factors = [compressed_shape(shape, rank, settings.min_compression) for shape in shapes]
    full = [math.prod(shape) for shape, factor in zip(shapes, factors, strict=True) if factor is None]
    compressed = [factor for factor in factors if factor is not None]
    if not compressed:
        return [full]
    return [pieces([rows * rank for rows, _ in compressed]), pieces([cols * rank for _, cols in compressed] + full)]


@dataclass(frozen=True)
class _GroupLimits:
    """The limits of a group's round: a bound on the L2 norm of any part each admitted groupmate may send (its
    declared norm), and one on any part an all-reduce can honestly return, ``result_norm`` = the root of the
    sum of their squares. (The robust reduction of a part lies between the coordinate median m and the parts
    x_i, so its norm is at most max(‖m‖, max ‖x_i‖), and ‖m‖² ≤ Σ_i ‖x_i‖², each coordinate of m being one
    of the x_i's; every part is within its sender's declared norm.)"""

    peers: dict[PeerID, float]
    result_norm: float


class _GradientRounds(StageAverager):
    """hivemind's averaging process for gradients: the contribution checks, PowerSGD's two phases and DeMo's round.

    ``GradientProcess`` orders a round's methods: StageAverager's membership check (DeMo: and the declared
    indices) → this class's limits (on the admitted peers) → ``_aggregate_phases`` (PowerSGD's two phases,
    DeMo's all-reduce over the union of indices, or hivemind's single all-reduce in full mode).
    """

    def __init__(self, grads: Sequence[torch.Tensor], dht: Any, *, names: Sequence[str],
                 shapes: Sequence[tuple[int, int] | None], rank: int, seed: int, errors: Sequence[torch.Tensor],
                 backup: Sequence[torch.Tensor], qs: Sequence[torch.Tensor], factor: float,
                 demo_chunks: Sequence[int | None] = (), momenta: Sequence[torch.Tensor] = (),
                 indices: Sequence[torch.Tensor] = (), chunk: int = 0, topk: int = 0, beta: float = 0.0,
                 values: GradValues = GradValues.FLOAT32, **kwargs: Any) -> None:
        """``demo_chunks``: in DeMo mode, each gradient's chunk count (None: sent in full), with ``momenta`` the
        momentum of each chunked one (chunks × ``chunk``), ``indices`` the positions the host picked for the next
        round (chunks × ``topk``, uint8), ``topk``, ``beta`` and ``values`` as in ``GradientSettings``."""
        # All shared with the averaging process, so they must exist before it forks.
        self._names, self._shapes, self._rank, self._seed = list(names), list(shapes), rank, seed
        self._errors, self._backup, self._qs = list(errors), list(backup), list(qs)
        self._factor = factor
        self._demo_chunks, self._momenta, self._indices = list(demo_chunks), list(momenta), list(indices)
        self._chunk, self._topk, self._beta = chunk, topk, beta
        self._outcome = mp.Value(ctypes.c_int32, 0, lock=False)
        self._tag = mp.Array(ctypes.c_char, _TAG_BYTES, lock=False)  # group id of the last complete phase Q
        self._limits: dict[bytes, _GroupLimits] = {}
        self._values = values
        super().__init__(grads, dht, compression=codec(values), **kwargs)

    def prepare_round(self, averaging_index: int, declaration: dict[str, Any]) -> dict[str, Any]:
        self._outcome.value = 0
        return super().prepare_round(averaging_index, declaration)

    @property
    def powersgd(self) -> bool:
        return any(shape is not None for shape in self._shapes)

    @property
    def outcome(self) -> int:
        return int(self._outcome.value)

    @property
    def q_tag(self) -> str:
        return bytes(self._tag.raw).rstrip(b"\0").hex()

    # ----- DeMo's index declarations -----

    async def _step(self, *, step: StepControl, future_for_init: Any) -> Any:
        """hivemind's step, the DeMo indices the host picked added to what this peer gathers: they travel beside
        the sealed declaration (which holds their digest), read here from the tensors the host shares with this
        process rather than sent with every step through hivemind's control pipe."""
        if self._chunk:
            bandwidth, mode, user = self.serializer.loads(step.data_for_gather)
            declaration = {**self.serializer.loads(user), "idx": [t.tolist() for t in self._indices]}
            step._data_for_gather = self.serializer.dumps([bandwidth, mode, self.serializer.dumps(declaration)])
        return await super()._step(step=step, future_for_init=future_for_init)

    def _user_data(self, blob: bytes) -> Any:
        """A groupmate's sealed declaration, less the DeMo indices beside it (``_declared_indices``)."""
        user = super()._user_data(blob)
        return {k: v for k, v in user.items() if k != "idx"} if isinstance(user, dict) else user

    def _declared_indices(self, blob: bytes) -> Any:
        """The DeMo indices a groupmate gathered beside its declaration (unchecked: ``_check`` checks them)."""
        user = super()._user_data(blob)
        return user.get("idx") if isinstance(user, dict) else None

    # ----- contribution checks -----

    def _check(self, blob: bytes, peer: PeerID) -> Declared | str:
        """StageAverager's membership check, then (DeMo) the declared indices: one well-formed list per chunked
        gradient, the ones its seal covers (by digest), so that every admitted peer computes the same union."""
        found = super()._check(blob, peer)
        if not self._chunk or isinstance(found, str):
            return found
        counts = [n for n in self._demo_chunks if n is not None]
        refusal = demo.declaration_refusal(self._declared_indices(blob), counts, self._chunk, self._topk,
                                           found.body.get("idx_digest"))
        return refusal or found

    def _group_ids(self, group_id: bytes) -> list[bytes]:
        return [group_id, *(group_id + phase.name.encode() for phase in AllReducePhases)]

    async def _aggregate_admitted(self, group_info: GroupInfo, admitted: dict[PeerID, Declared],
                                  min_vector_size: int, **kwargs: Any) -> Any:
        """The round with each admitted groupmate's limits in force; returns the declarations of those that
        have a limit (a groupmate with none added nothing: every reducer refused its parts)."""
        limits = self._group_limits(admitted)
        ids = self._group_ids(group_info.group_id)
        self._limits.update(dict.fromkeys(ids, limits))
        try:
            gathered = await super()._aggregate_admitted(group_info, admitted, min_vector_size, **kwargs)
        finally:
            for group_id in ids:
                self._limits.pop(group_id, None)
        return {peer: body for peer, body in gathered.items() if peer in limits.peers}

    def _group_limits(self, admitted: dict[PeerID, Declared]) -> _GroupLimits:
        """Each admitted groupmate's limit from its declaration (membership checked its weight against
        ``max_weight``); one that declares no finite norm, or one above ``factor`` × the group's lower median,
        gets none (all its parts refused)."""
        declared: dict[PeerID, tuple[float, float]] = {}
        for peer, declaration in admitted.items():
            norm = declaration.body.get("norm")
            if isinstance(norm, int | float) and not isinstance(norm, bool) and 0 <= norm < math.inf:
                declared[peer] = (declaration.weight, float(norm))
        typical = sorted(norm for weight, norm in declared.values() if weight > 0)
        bound = self._factor * typical[(len(typical) - 1) // 2] if typical else math.inf
        peers = {peer: norm for peer, (_, norm) in declared.items() if norm <= bound}
        # a weight-0 peer's parts count in no average, so they widen no bound on what a reducer returns
        weighing = [norm for peer, norm in peers.items() if declared[peer][0] > 0]
        return _GroupLimits(peers, math.sqrt(sum(norm**2 for norm in weighing)))

    def _result_bound(self, group_id: bytes) -> float:
        """No part of an honest average is larger than the group's ``result_norm``: a reducer is a groupmate
        too, and one that returns more for a part has that part (and the rest of its shard) kept local."""
        limits = self._limits.get(group_id)
        return norm_bound(self._values, limits.result_norm if limits is not None else 0.0, self.total_size)

    def _part_refusal(self, message: averaging_pb2.AveragingData, group_id: bytes, peer: PeerID,
                      declared: Declared) -> str:
        """StageAverager's weight check, then the sender's limit: no part larger than its declared norm."""
        refusal = super()._part_refusal(message, group_id, peer, declared)
        if refusal:
            return refusal
        limits = self._limits.get(group_id)
        limit = limits.peers.get(peer) if limits is not None else None
        if limit is None:
            return "declared an invalid or out-of-line contribution"
        try:
            part = decode(message.tensor_part, self._values)
        except ValueError as exc:
            return str(exc)
        norm = float(torch.linalg.vector_norm(part, dtype=torch.float64))
        if not norm <= norm_bound(self._values, limit, part.numel()):  # also refuses NaN and infinity
            return f"sent a part of norm {norm:.3g}, declared {limit:.3g}"
        return ""

    # ----- PowerSGD -----

    def _register_allreduce_group(self, group_info: GroupInfo) -> Any:
        if self.powersgd:  # both phases' ids, as hivemind's PowerSGD registers them
            return PowerSGDGradientAverager._register_allreduce_group(self, group_info)
        return super()._register_allreduce_group(group_info)

    def _close_group(self, group_info: GroupInfo) -> None:
        super()._close_group(group_info)
        for phase in AllReducePhases:
            pending = self._running_groups.get(group_info.group_id + phase.name.encode())
            if pending is not None and not pending.done():
                pending.cancel()

    async def _aggregate_phases(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        """Reached through StageAverager's ``super()`` once the group check passed."""
        if not self.powersgd and not self._chunk:
            gathered = await DecentralizedAverager._aggregate_with_group(self, group_info, min_vector_size, **kwargs)
            self._outcome.value = _COMPLETE if self._complete(group_info.group_id) else _PARTIAL
            return gathered
        try:
            users = [self._user_data(blob) for blob in group_info.gathered]
            bandwidths = [self.serializer.loads(blob)[0] for blob in group_info.gathered]
            fractions = await asyncio.get_event_loop().run_in_executor(
                None, load_balance_peers, self.total_size, bandwidths, min_vector_size)
            kwargs.pop("tensor_infos", None)  # they describe the gradients, not the phases' factors
            async with enter_asynchronously(self.get_tensors()) as grads:
                if self._chunk:
                    complete = await self._demo(grads, group_info, fractions, kwargs)
                    self._outcome.value = _COMPLETE if complete else _PARTIAL
                    return dict(zip(group_info.peer_ids, users, strict=True))
                for error, backup in zip(self._errors, self._backup, strict=True):
                    backup.copy_(error)
                try:
                    complete = await self._powersgd(grads, users, group_info, fractions, kwargs)
                except BaseException:
                    self._restore_errors()
                    raise
                if not complete:
                    self._restore_errors()
                self._outcome.value = _COMPLETE if complete else _PARTIAL
            return dict(zip(group_info.peer_ids, users, strict=True))
        except BaseException as exc:
            raise MatchmakingException(f"Unable to run PowerSGD all-reduce: {exc!r}") from exc

    def _restore_errors(self) -> None:
        for error, backup in zip(self._errors, self._backup, strict=True):
            error.copy_(backup)

    async def _powersgd(self, grads: Sequence[torch.Tensor], users: list[Any], group_info: GroupInfo,
                        fractions: Any, kwargs: dict[str, Any]) -> bool:
        """Both phases, in place in ``grads``; True when neither lost a peer. Raises when a phase fails."""
        weight = float(kwargs["weight"])
        compressed = [(g, shape, name) for g, shape, name in zip(grads, self._shapes, self._names, strict=True)
                      if shape is not None]
        full = [g for g, shape in zip(grads, self._shapes, strict=True) if shape is None]
        tags = {str(user.get("q", "")) for user in users}
        self._tag.raw = bytes(_TAG_BYTES)  # this peer's Q stops being a complete round's until this one is
        if len(tags) != 1 or "" in tags:  # peers hold different Qs (or none from a complete round): start afresh
            for q, (_, (_, cols), name) in zip(self._qs, compressed, strict=True):
                q.copy_(seeded_matrix(self._seed, f"{name}:{self._round.value}", cols, self._rank))
        ms = [g.reshape(shape) + e for (g, shape, _), e in zip(compressed, self._errors, strict=True)]
        for q in self._qs:
            orthogonalize_(q)  # keeps each part of M Q within M's norm, which the peers' limits rely on
        ps = [m @ q for m, q in zip(ms, self._qs, strict=True)]
        phase_p = group_info.group_id + AllReducePhases.PHASE_P.name.encode()
        await self._run_packed_(ps, group_info, phase_p, fractions, kwargs)
        for p in ps:
            orthogonalize_(p)
        for q, m, p in zip(self._qs, ms, ps, strict=True):
            torch.matmul(m.t(), p, out=q)
        if weight > 0:  # a weight-0 peer sent nothing, so its compression lost nothing either
            for error, m, p, q in zip(self._errors, ms, ps, self._qs, strict=True):
                error.copy_(m - p @ q.t())
        phase_q = group_info.group_id + AllReducePhases.PHASE_Q.name.encode()
        await self._run_packed_([*self._qs, *full], group_info, phase_q, fractions, kwargs)
        for (g, _, _), p, q in zip(compressed, ps, self._qs, strict=True):
            g.copy_((p @ q.t()).reshape(g.shape))
        complete = self._complete(phase_p) and self._complete(phase_q)
        if complete:
            self._tag.raw = phase_q[:_TAG_BYTES].ljust(_TAG_BYTES, b"\0")
        return complete

    async def _run_packed_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes,
                           fractions: Any, kwargs: dict[str, Any]) -> None:
        """One in-place all-reduce of ``tensors`` as a piece per reducer (``client.averaging.packing``)."""
        flat = packing.laid_end_to_end(tensors)
        pieces = list(flat.split(packing.piece_sizes(flat.numel(), fractions)))
        await self._run_allreduce_inplace_(pieces, group_info, group_id, peer_fractions=fractions, **kwargs)
        packing.put_back(flat, tensors)

    # ----- DeMo -----

    async def _demo(self, grads: Sequence[torch.Tensor], group_info: GroupInfo, fractions: Any,
                    kwargs: dict[str, Any]) -> bool:
        """DeMo's round in ``grads`` (``demo.Sending``): momentum moves only if complete (True); raises if failed."""
        chunked = [g for g, n in zip(grads, self._demo_chunks, strict=True) if n is not None]
        full = [g for g, n in zip(grads, self._demo_chunks, strict=True) if n is None]
        declared = [self._declared_indices(blob) for blob in group_info.gathered]
        sending = demo.Sending.of(chunked, self._momenta, declared, self._chunk, self._topk, self._beta)
        await self._run_packed_([*sending.sent, *full], group_info, group_info.group_id, fractions, kwargs)
        complete = self._complete(group_info.group_id)
        if complete and float(kwargs["weight"]) > 0:  # a weight-0 peer's coefficients went into no average
            sending.keep_unsent(chunked, self._momenta)
        sending.step_on_average(chunked)
        return complete


class _Phases(DecentralizedAverager):
    """Puts ``_GradientRounds._aggregate_phases`` where StageAverager's ``super()._aggregate_with_group`` goes
    (its ``_aggregate_admitted``)."""

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        return await self._aggregate_phases(group_info, min_vector_size, **kwargs)  # type: ignore[attr-defined]


class GradientProcess(_GradientRounds, _Phases):
    """The process class actually started (method order: membership, limits, phases, hivemind)."""


@dataclass(frozen=True)
class GradientResult:
    round: int
    status: AveragingStatus
    reason: str
    weight: float
    samples: int  # samples the gradient now stands for when averaged: the weights of the admitted groupmates with a
    # limit that this worker's reducers did not ban (never a dropped or refused one's claim); this worker's otherwise
    group_size: int  # admitted peers in the group, this one included (0 when none formed)
    refused: int  # groupmates dropped because their declaration did not pass
    complete: bool  # every peer's parts arrived (PowerSGD: its error feedback moved, DeMo: its momentum; otherwise
    # they were restored)
    seconds: float
    consecutive_failures: int

    @property
    def shared(self) -> bool:
        """Whether the stage's replicas that took part stepped on this very gradient: the round brought every part
        back, or there was nobody to average with. Otherwise this worker's state may honestly differ from theirs."""
        return self.complete or (self.status == AveragingStatus.SKIPPED and self.group_size == 0 and not self.reason)


class GradientAverager:
    """Averages a stage's gradients with its same-stage peers once per optimizer step (host side).

    Create it before the worker serves gRPC: it forks hivemind's averaging process. One per DHT node.
    """

    process_class: type[GradientProcess] = GradientProcess
    kind = "grad"  # its rounds' DHT prefix (``averager_prefix``)
    rounds = "gradient"  # what its log calls its rounds

    def __init__(self, named_parameters: Sequence[tuple[str, torch.Tensor]], dht: hivemind.DHT, *, run_id: str,
                 stage: str, seed: int, settings: GradientSettings, membership: Membership) -> None:
        if not named_parameters:
            raise ValueError("a stage with no parameters has nothing to average")
        self.settings = settings
        self.stage = stage
        self.names = [name for name, _ in named_parameters]
        rank = settings.rank if settings.mode == GradAveraging.POWERSGD else 0
        self.shapes = [compressed_shape(p.shape, rank, settings.min_compression) for _, p in named_parameters]
        self._buffers = [torch.zeros_like(p, dtype=torch.float32, device="cpu") for _, p in named_parameters]
        factors = [(shape, name) for shape, name in zip(self.shapes, self.names, strict=True) if shape is not None]
        self.errors = [torch.zeros(shape).share_memory_() for shape, _ in factors]
        self.backup = [torch.zeros(shape).share_memory_() for shape, _ in factors]
        qs = [torch.zeros(shape[1], max(rank, 1)).share_memory_() for shape, _ in factors]
        chunk = settings.chunk if settings.mode == GradAveraging.DEMO else 0
        self.demo_chunks = [demo.chunk_count(p.shape, chunk) if chunk else None for _, p in named_parameters]
        self.momenta = [torch.zeros(n, chunk).share_memory_() for n in self.demo_chunks if n is not None]
        self.indices = [torch.zeros(n * settings.topk, dtype=torch.uint8).share_memory_()
                        for n in self.demo_chunks if n is not None]
        self.consecutive_failures = 0
        self.last: GradientResult | None = None  # the last round's result, as ``average`` returned it
        self._pipe = threading.Lock()
        t = settings.timeouts
        self._control: Any = None
        self._process = self.process_class(
            self._buffers, dht, names=self.names, shapes=self.shapes, rank=rank, seed=seed, errors=self.errors,
            backup=self.backup, qs=qs, factor=settings.factor, demo_chunks=self.demo_chunks, momenta=self.momenta,
            indices=self.indices, chunk=chunk, topk=settings.topk, beta=settings.beta, values=settings.values,
            max_weight=settings.max_weight,
            membership=membership, prefix=averager_prefix(run_id, stage, self.kind), min_group_size=t.min_group_size,
            work=WorkRule(run_id, stage, settings.round_samples) if settings.round_samples else None,
            target_group_size=t.target_group_size, min_matchmaking_time=t.min_matchmaking_time,
            request_timeout=t.request_timeout, allreduce_timeout=t.allreduce_timeout,
            next_chunk_timeout=t.chunk_timeout, allow_state_sharing=False, audit_rate=t.audit_rate)

    @classmethod
    def for_worker(cls, worker: StageWorker, dht: hivemind.DHT, *, seed: int, settings: GradientSettings,
                   roster: Callable[[], Roster]) -> Self:
        """The averager of a ``StageWorker``'s gradients, in its run's namespace, averaging with the workers
        ``roster`` lists under the worker's key."""
        named = [(n, p) for n, p in worker.compute.module.named_parameters() if p.requires_grad]
        return cls(named, dht, run_id=worker.run_id, stage=worker.stage, seed=seed, settings=settings,
                   membership=Membership(worker.keypair, roster))


    # ----- the round -----

    def average(self, grads: Sequence[torch.Tensor], samples: int, index: int, weight: float, *,
                peers: int | None = None, work: Sequence[tuple[RequestHeader, str]] = ()) -> GradientResult:
        """Replace ``grads`` (this worker's mean gradients over ``samples`` samples, in parameter order) in place by
        the stage's average of round ``index``; blocks for the round. ``peers``: other workers the caller sees
        in the stage (0 skips the round at once); ``work``: the signed headers of the Backwards the gradients
        sum (``StageCompute.work``), this worker's evidence for its weight where the round credits work."""
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and non-negative, got {weight}")
        if len(grads) != len(self._buffers):
            raise ValueError(f"expected {len(self._buffers)} gradients, got {len(grads)}")
        started = time.monotonic()

        def result(status: AveragingStatus, reason: str, group: int = 0, total: float = 0.0,
                   complete: bool = False, counts: bool = True) -> GradientResult:
            if status == AveragingStatus.FAILED and counts:
                self.consecutive_failures += 1
            elif status == AveragingStatus.AVERAGED:
                self.consecutive_failures = 0
            outcome = GradientResult(
                round=index, status=status, reason=reason, weight=weight,
                samples=int(total) if status == AveragingStatus.AVERAGED else samples,
                group_size=group, refused=self._process.last_refused, complete=complete,
                seconds=time.monotonic() - started,
                consecutive_failures=self.consecutive_failures)
            self.last = outcome
            log.log(logging.WARNING if status == AveragingStatus.FAILED else logging.INFO,
                    "%s %s round %d: %s%s, group of %d, %.1f s", self.stage, self.rounds, index, status.value,
                    f" ({reason})" if reason else "", outcome.group_size, outcome.seconds)
            return outcome

        if peers == 0:
            return result(AveragingStatus.SKIPPED, "")
        if not self._process.is_alive():
            return result(AveragingStatus.FAILED, "the averaging process is not running")
        try:
            gather = self._load(grads, index, weight, work)
            t = self.settings.timeouts
            gathered, failure = run_round(self._process, self._pipe, index, gather, weight,
                                          matchmaking_timeout=t.matchmaking_timeout,
                                          allreduce_timeout=t.allreduce_timeout,
                                          on_control=lambda control: setattr(self, "_control", control))
            if self._process.is_alive():  # a dead process may have died holding the buffers' lock
                self._apply(grads)
        except Wedged as exc:
            return result(AveragingStatus.FAILED, str(exc))
        finally:
            self._control = None
        group, complete = self._process.last_group_size, self._process.outcome == _COMPLETE
        if failure is not None:  # only this peer's own faults count (see sparta.py)
            return result(AveragingStatus.FAILED, failure, group, counts=not self._process.is_alive())
        if not gathered:
            return result(AveragingStatus.SKIPPED, "no groupmate was admitted", group)
        total = sum(float(g.get("weight", 0.0)) for g in gathered.values())
        if total == 0:
            return result(AveragingStatus.SKIPPED, "every weight in the group is 0", group)
        return result(AveragingStatus.AVERAGED, "" if complete else "some peer's parts did not arrive", group,
                      total, complete)

    def _locked(self) -> Any:
        t = self.settings.timeouts
        return holding(self._process.lock_averaged_tensors, t.matchmaking_timeout + t.allreduce_timeout + GRACE)

    def _load(self, grads: Sequence[torch.Tensor], index: int, weight: float,
              work: Sequence[tuple[RequestHeader, str]] = ()) -> dict[str, Any]:
        """Copy the gradients into the shared buffers; returns what this peer declares to its group (its evidence
        only with a positive weight: a syncing worker proves nothing; in DeMo mode, the digest of the positions of
        its top coefficients, which the shared ``indices`` hand to the averaging process, and a norm that bounds
        its whole momentum: any of its coefficients at a union of indices lies within it, the DCT being
        orthonormal)."""
        with self._locked(), torch.no_grad():
            squared = 0.0
            errors, momenta, indices = iter(self.errors), iter(self.momenta), []
            shared = iter(self.indices)
            for buffer, grad, shape, chunks in zip(self._buffers, grads, self.shapes, self.demo_chunks, strict=True):
                buffer.copy_(grad)
                sent = buffer if shape is None else buffer.reshape(shape) + next(errors)
                if chunks is not None:
                    sent = self.settings.beta * next(momenta) + demo.chunked(buffer, self.settings.chunk)
                    indices.append(demo.top_positions(demo.encode(sent), self.settings.topk))
                    next(shared).copy_(torch.tensor(indices[-1], dtype=torch.uint8))
                squared += float(torch.linalg.vector_norm(sent, dtype=torch.float64)) ** 2
        declaration = {"round": index, "weight": float(weight), "norm": math.sqrt(squared), "q": self._process.q_tag,
                       "work": evidence(work) if weight > 0 and self.settings.round_samples else []}
        if self.settings.mode == GradAveraging.DEMO:  # even with no chunked gradient: the digest of no lists
            declaration["idx_digest"] = demo.digest(indices)
        return declaration

    def _apply(self, grads: Sequence[torch.Tensor]) -> None:
        """Whatever the buffers hold after the round (an average, a partial one, or the local values), finite
        elements only."""
        with self._locked(), torch.no_grad():
            for grad, buffer in zip(grads, self._buffers, strict=True):
                received = buffer.to(grad.device)
                grad.copy_(torch.where(torch.isfinite(received), received, grad))

    # ----- the optimizer's hook -----

    def exchange(self, round_of: Callable[[], int], weight_of: Callable[[int], float],
                 peers_of: Callable[[], int | None] = lambda: None,
                 work_of: Callable[[], Sequence[tuple[RequestHeader, str]]] = tuple,
                 ) -> Callable[[list[torch.Tensor], int], int]:
        """The ``StageOptimizer.gradient_exchange`` hook: averages the step's mean gradients in round
        ``round_of()`` with weight ``weight_of(samples)``, proved by ``work_of()``; returns the samples the result
        stands for."""

        def hook(grads: list[torch.Tensor], samples: int) -> int:
            return self.average(grads, samples, round_of(), weight_of(samples), peers=peers_of(),
                                work=work_of()).samples

        return hook

    @property
    def round_stage(self) -> str:
        """hivemind's stage of the running round (LOOKING_FOR_GROUP, RUNNING_ALLREDUCE…), or IDLE."""
        control = self._control
        return control.stage.name if control is not None else "IDLE"

    @property
    def process(self) -> GradientProcess:
        """The hivemind averaging process (its pid, its last group: monitoring and tests)."""
        return self._process

    def shutdown(self) -> None:
        if self._process.is_alive():
            self._process.shutdown()
