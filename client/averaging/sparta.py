"""SPARTA: sparse parameter averaging between the workers of one pipeline stage.

Every ``sparta_every`` optimizer steps, each stage averages a fraction p = 1/``sparta_partitions`` of its
parameters with its same-stage peers through hivemind's DecentralizedAverager. Averaging round k averages
partition k mod P, so every parameter is averaged once per P averaging rounds and no two rounds overlap.

Masks. Each tensor's elements are ranked by 64-bit keys drawn from SHA-256 in counter mode, keyed by the run
seed and the parameter's global name; the element of rank r belongs to partition r mod P. Every peer derives
the same partitions from nothing but (seed, name, size, P), whatever its torch or NumPy version: torch's
RNG promises no such thing across versions (Node0 pins torch exactly to make its masks agree).

Rounds. ``SpartaAverager.average`` copies partition k into shared-memory buffers (one per tensor, padded to
the largest partition so every round has the same schema), runs one hivemind step with the given weight,
and adds the change (averaged − sent) back into the live parameters under the worker's lock. Adding the
change rather than overwriting keeps any optimizer step taken while the network round ran. Only finite
changes are applied: where a group ended up with no weight for some elements (a weighted peer failed
mid-round and the rest weigh 0) those elements keep their local value instead of becoming NaN.

Codec. In a run whose ``grad_values`` is float16, int8 or int4, a slice travels as its change since the group last
averaged it, in that codec, and every peer adds the average change to that common value (``anchored``): about a
quarter of the bytes in int8 and a seventh in int4, where rounding the parameters themselves would move each by
more than a step does.

Weights. A round's weight is the caller's, at most ``max_weight`` (the swarm's replicas weigh 1 each when they
trained since the last round, 0 otherwise: ``client.join.stage_replica.REPLICA_WEIGHT``); a groupmate claiming
more is dropped before the all-reduce, and one that sends its parts with another weight than it declared is
banned by every honest reducer (``stage_averager``): in a group of two, where the robust reduction trusts both
members, a liar's pull on the result is at most max_weight / (max_weight + the honest weight), one half when
both weigh alike, not everything.

Faults. A groupmate whose declaration does not pass (a stranger, another round, a malformed, negative or
too large weight) is dropped before the all-reduce and the others average among themselves (``stage_averager``).
hivemind bans a sender that stalls or dies, keeps each failed reducer's shard at its local value, and
finishes the round with what it has; a round that raises still applies whatever parts completed. There is
no retry: the next round starts afresh. ``average`` counts consecutive failures that are this peer's own —
its averaging process dead or wedged — so the caller can withdraw a worker that keeps failing
(``AveragingResult.remove``). Anything a groupmate can cause (no group formed, a groupmate dropped, an
all-reduce that raised because a peer broke off or lied) is reported but never counted: in a two-worker
stage both workers see such a failure when either one is broken, and a liar must not be able to get the
honest withdrawn — that could empty a stage, the one failure the swarm cannot survive. A worker that
averages with nobody for long is the coordinator's health checks' business, not the averager's.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from client.averaging.anchored import AnchoredAverager, Anchors
from client.averaging.auditor import AUDIT_RATE
from client.averaging.membership import Membership, Roster
from client.averaging.rounds import GRACE, Wedged, holding, run_round
from client.averaging.state_transfer import SharedState, StateExpectation
from client.averaging.values import GradValues, encoded_bytes

if TYPE_CHECKING:
    import hivemind
    from hivemind.utils import MPFuture

    from client.pipeline.worker import StageWorker

log = logging.getLogger("psyswarm.sparta")

_KEYS_PER_DIGEST = 4  # a SHA-256 digest holds four 64-bit keys


def element_ranks(seed: int, name: str, numel: int) -> np.ndarray:
    """A permutation's inverse: the rank of each of ``numel`` elements, keyed by (seed, name) through SHA-256.

    Ties between keys (probability ~numel²/2⁶⁵) are broken by position with a stable sort, so the result is a
    pure function of the arguments.
    """
    key = hashlib.sha256(f"psyswarm-sparta:{seed}:{name}".encode()).digest()
    blocks = -(-numel // _KEYS_PER_DIGEST)
    stream = b"".join(hashlib.sha256(key + i.to_bytes(8, "little")).digest() for i in range(blocks))
    keys = np.frombuffer(stream, dtype="<u8")[:numel]
    order = np.argsort(keys, kind="stable")
    ranks = np.empty(numel, dtype=np.int64)
    ranks[order] = np.arange(numel)
    return ranks


class SpartaMasks:
    """The partition of every parameter tensor of a stage into ``partitions`` disjoint, balanced slices."""

    def __init__(self, shapes: Sequence[tuple[str, int]], partitions: int, seed: int) -> None:
        """``shapes`` is (global parameter name, number of elements) in the stage's fixed parameter order."""
        if partitions < 1:
            raise ValueError(f"partitions must be at least 1, got {partitions}")
        names = [name for name, _ in shapes]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        self.partitions = partitions
        self.names = names
        self.numels = [numel for _, numel in shapes]
        self.slice_sizes = [-(-numel // partitions) for numel in self.numels]  # the largest partition per tensor
        self._seed = seed
        self._assignment: list[np.ndarray] | None = None

    def draw(self) -> list[np.ndarray]:
        """Each element's partition (int32: 4 bytes a parameter), drawn on the first call. It costs about a second
        per 3 million parameters (SHA-256 in counter mode), so it waits for its first use: an averager that only
        serves state, as a PowerGossip run's does, never draws it."""
        if self._assignment is None:
            self._assignment = [(element_ranks(self._seed, name, numel) % self.partitions).astype(np.int32)
                                for name, numel in zip(self.names, self.numels, strict=True)]
        return self._assignment

    def indices(self, partition: int) -> list[torch.Tensor]:
        """Flat element indices of ``partition`` in each tensor, ascending (so every peer packs them alike)."""
        if not 0 <= partition < self.partitions:
            raise ValueError(f"partition must be in 0..{self.partitions - 1}, got {partition}")
        return [torch.from_numpy(np.flatnonzero(a == partition)) for a in self.draw()]


def averaging_index(step: int, every: int) -> int | None:
    """The averaging round due once the swarm has completed ``step`` optimizer steps, or None.

    A round is due after every ``every``-th step (steps 1, 2, … count completed rounds, as the coordinator's
    ``state.step`` does); round ``step // every`` averages partition ``(step // every) % P``.
    """
    if every < 1:
        raise ValueError(f"sparta_every must be at least 1, got {every}")
    return step // every if step > 0 and step % every == 0 else None


class AveragingStatus(Enum):
    AVERAGED = "averaged"  # a group ran the all-reduce (hivemind may have dropped failing peers on the way)
    SKIPPED = "skipped"  # nothing to do: alone in the stage, every weight 0, or a round still running
    FAILED = "failed"  # no group formed, or the all-reduce raised; completed parts were kept


@dataclass(frozen=True)
class AveragingResult:
    averaging_index: int
    partition: int
    status: AveragingStatus
    reason: str
    weight: float
    group_size: int  # admitted peers in the group, this one included (0 when none formed)
    refused: int  # groupmates dropped because their declaration did not pass (strangers, other rounds…)
    total_weight: float  # summed weight of the group (NaN when unknown)
    elements: int  # parameter elements in the partition
    payload_bytes: int  # bytes of this peer's padded slice as it travelled (levels and scales; 0 without a group)
    payload_values: GradValues | None  # changes in the run's codec, values in float32, or None without a group
    delta_norm: float  # L2 norm of the change applied to the parameters
    seconds: float
    consecutive_failures: int
    remove: bool  # this worker has failed too often in a row: the caller should withdraw it


@dataclass(frozen=True)
class SpartaSettings:
    """Timeouts, group sizes and the audit rate of averaging rounds.

    hivemind requires ``request_timeout`` < ``min_matchmaking_time`` (or matchmaking can deadlock). A round
    lasts at most ``matchmaking_timeout`` to form a group plus ``allreduce_timeout`` to run it; a peer that
    sends nothing for ``chunk_timeout`` seconds is dropped as a sender, and a reducer silent for twice that is
    dropped too (its shard keeps local values).
    """

    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    matchmaking_timeout: float = 15.0
    allreduce_timeout: float = 30.0
    chunk_timeout: float = 5.0
    min_group_size: int = 2
    target_group_size: int | None = None
    max_failures: int = 3
    audit_rate: float = AUDIT_RATE  # how often this peer audits each other reducer of a round (``auditor``)

    def __post_init__(self) -> None:
        if not 0 < self.request_timeout < self.min_matchmaking_time:
            raise ValueError("request_timeout must be positive and below min_matchmaking_time "
                             "(hivemind's matchmaking can deadlock otherwise)")
        if self.matchmaking_timeout <= self.min_matchmaking_time:
            raise ValueError("matchmaking_timeout must exceed min_matchmaking_time")
        if self.allreduce_timeout <= 2 * self.chunk_timeout or self.chunk_timeout <= 0:
            raise ValueError("allreduce_timeout must exceed twice chunk_timeout (the reducers' timeout)")
        if self.min_group_size < 2 or (self.target_group_size is not None
                                       and self.target_group_size < self.min_group_size):
            raise ValueError("min_group_size must be at least 2 and target_group_size at least min_group_size")
        if self.max_failures < 1:
            raise ValueError("max_failures must be at least 1")
        if not 0 <= self.audit_rate <= 1:
            raise ValueError(f"audit_rate must be in [0, 1], got {self.audit_rate}")


def averager_prefix(run_id: str, stage: str, kind: str = "sparta") -> str:
    """The DHT prefix of a stage's averagers of one ``kind`` (``sparta``, ``grad``, ``gossip``): one per run, stage
    and kind, so stages, runs and kinds of rounds never mix.

    hivemind forbids '.' in prefixes and run ids may hold one, hence the hash; the stage stays readable.
    """
    digest = hashlib.sha256(f"{run_id}\0{stage}".encode()).hexdigest()[:16]
    return f"{kind}-{stage}-{digest}"


class SpartaAverager:
    """Averages one stage's parameters with its same-stage peers, a SPARTA partition per call.

    Create it before the worker starts serving gRPC: it forks hivemind's averaging process, and a fork is
    safest before gRPC starts its threads. One averager per DHT node (it takes the node's peer id).
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.Tensor]],
        dht: hivemind.DHT,
        *,
        run_id: str,
        stage: str,
        partitions: int,
        seed: int,
        membership: Membership,
        lock: AbstractContextManager[Any] | None = None,
        settings: SpartaSettings | None = None,
        state_provider: Callable[[], SharedState] | None = None,
        max_weight: float = math.inf,
        values: GradValues = GradValues.FLOAT32,
        serving_only: bool = False,
    ) -> None:
        """``membership`` is this peer's key and the stage's roster (who may average with it); ``lock`` guards
        the live parameters (a worker's ``compute.lock``); ``state_provider`` is what this peer serves to
        joiners once ``sharing`` is on; ``max_weight`` the most weight any peer may claim in a round (the
        module docstring); ``values`` the run's codec, in which slices travel as changes since their last
        average (``client.averaging.anchored``) unless it is float32; ``serving_only``: it will run no rounds, only
        serve state (a PowerGossip run's), so it keeps no anchors (a float32 copy of the stage) whatever ``values``,
        and draws no partition."""
        if not max_weight > 0:
            raise ValueError(f"max_weight must be positive, got {max_weight}")
        self.settings = settings or SpartaSettings()
        self.max_weight = float(max_weight)
        self.parameters = [p for _, p in named_parameters]
        if not self.parameters:
            raise ValueError("a stage with no parameters has nothing to average")
        self.masks = SpartaMasks([(n, p.numel()) for n, p in named_parameters], partitions, seed)
        if not serving_only:
            self.masks.draw()  # now, before the averaging process forks: it reads the partition too
        self.lock = lock if lock is not None else nullcontext()
        self.run_id, self.stage = run_id, stage
        self.prefix = averager_prefix(run_id, stage)
        self.consecutive_failures = 0
        self._round_cv = threading.Condition()  # guards _round_active: one round at a time, donors serve between
        self._round_active = False
        self._pipe = threading.Lock()  # hivemind's control pipe to its process takes one sender at a time
        self._control: Any = None
        self._buffers = [torch.zeros(size, dtype=p.dtype) for size, p in zip(self.masks.slice_sizes,
                                                                              self.parameters, strict=True)]
        s = self.settings
        self._averager = AnchoredAverager(
            self._buffers,
            dht,
            prefix=self.prefix,
            membership=membership,
            state_provider=self._serve(state_provider) if state_provider is not None else None,
            min_group_size=s.min_group_size,
            audit_rate=s.audit_rate,
            target_group_size=s.target_group_size,
            min_matchmaking_time=s.min_matchmaking_time,
            request_timeout=s.request_timeout,
            allreduce_timeout=s.allreduce_timeout,
            next_chunk_timeout=s.chunk_timeout,
            allow_state_sharing=False,
            max_weight=self.max_weight,
            masks=self.masks,
            values=GradValues.FLOAT32 if serving_only else values,
        )

    @classmethod
    def for_worker(cls, worker: StageWorker, dht: hivemind.DHT, *, partitions: int, seed: int,
                   roster: Callable[[], Roster], settings: SpartaSettings | None = None,
                   state_provider: Callable[[], SharedState] | None = None,
                   max_weight: float = math.inf, values: GradValues = GradValues.FLOAT32,
                   serving_only: bool = False) -> SpartaAverager:
        """The averager of a ``StageWorker``'s parameters, under its lock, in its run's namespace, averaging
        with the workers ``roster`` lists under the worker's key."""
        return cls(list(worker.compute.module.named_parameters()), dht, run_id=worker.run_id, stage=worker.stage,
                   partitions=partitions, seed=seed, membership=Membership(worker.keypair, roster),
                   lock=worker.compute.lock, settings=settings, state_provider=state_provider,
                   max_weight=max_weight, values=values, serving_only=serving_only)

    # ----- the round -----

    def average(self, averaging_index: int, weight: float, *, peers: int | None = None) -> AveragingResult:
        """Average partition ``averaging_index % P`` with the stage's peers; blocks for the whole round.

        ``weight`` is 0 in the sync phases (this peer receives the average and adds nothing to it), positive
        when active; above ``max_weight`` (rounds this worker missed) it counts as ``max_weight``, the most its
        groupmates admit. ``peers`` is how many other workers the caller sees in the stage (DHT records): with 0,
        the round is skipped at once instead of waiting for a group that cannot form.
        """
        if averaging_index < 0:
            raise ValueError(f"averaging_index must be non-negative, got {averaging_index}")
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be finite and non-negative, got {weight}")
        weight = min(weight, self.max_weight)
        partition = averaging_index % self.masks.partitions
        indices = self.masks.indices(partition)
        started = time.monotonic()

        def result(status: AveragingStatus, reason: str, group: int = 0, total: float = math.nan,
                   delta: float = 0.0, counts: bool = True) -> AveragingResult:
            sent = self._averager.values_sent if group else None
            if status == AveragingStatus.FAILED and counts:
                self.consecutive_failures += 1
            elif status == AveragingStatus.AVERAGED:
                self.consecutive_failures = 0
            outcome = AveragingResult(
                averaging_index=averaging_index, partition=partition, status=status, reason=reason, weight=weight,
                group_size=group, refused=self._averager.last_refused, total_weight=total,
                elements=sum(len(i) for i in indices),
                payload_bytes=0 if sent is None else sum(encoded_bytes(sent, b.numel()) for b in self._buffers),
                payload_values=sent, delta_norm=delta,
                seconds=time.monotonic() - started, consecutive_failures=self.consecutive_failures,
                remove=self.consecutive_failures >= self.settings.max_failures)
            log.log(logging.WARNING if status == AveragingStatus.FAILED else logging.INFO,
                    "%s averaging round %d (partition %d): %s%s, group of %d, %.1f s%s", self.stage, averaging_index,
                    partition, status.value, f" ({reason})" if reason else "", group, outcome.seconds,
                    "" if sent is None else f", slice of {outcome.payload_bytes / 1e3:.1f} kB in {sent.value}")
            return outcome

        if peers == 0:
            return result(AveragingStatus.SKIPPED, "no other worker in the stage")
        if not self._averager.is_alive():
            return result(AveragingStatus.FAILED, "the averaging process is not running")
        if not self._claim_round():
            return result(AveragingStatus.SKIPPED, "the previous averaging round is still running")
        wedged = False
        try:
            sent = self._load_buffers(indices)
            gathered, failure = self._step(averaging_index, weight)
            # A dead averaging process may have died holding the buffers' lock: nothing came back from it.
            received = self._read_buffers() if self._averager.is_alive() else sent
            delta = self._apply(indices, sent, received)
        except Wedged as exc:
            gathered, failure, delta, wedged = {}, str(exc), 0.0, True
        finally:
            self._control = None
            self._release_round()
        group = self._averager.last_group_size
        if failure is not None:
            own = wedged or not self._averager.is_alive()
            return result(AveragingStatus.FAILED, failure, group, delta=delta, counts=own)
        if not gathered:
            return result(AveragingStatus.SKIPPED, "no groupmate was admitted", group)
        total = sum(float(g.get("weight", 0.0)) for g in gathered.values())
        if total == 0:
            return result(AveragingStatus.SKIPPED, "every weight in the group is 0", group, total, delta)
        partial = "partial: some peer's parts did not arrive, and those elements kept values without them"
        return result(AveragingStatus.AVERAGED, partial if self._averager.last_partial else "", group, total, delta)

    def _claim_round(self) -> bool:
        """Mark a round (or an anchors' install) under way; False if one already is."""
        with self._round_cv:
            if self._round_active:
                return False
            self._round_active = True
            return True

    def _release_round(self) -> None:
        with self._round_cv:
            self._round_active = False
            self._round_cv.notify_all()

    def _load_buffers(self, indices: list[torch.Tensor]) -> list[torch.Tensor]:
        with self._buffers_locked(), self.lock, torch.no_grad():
            for buffer, param, idx in zip(self._buffers, self.parameters, indices, strict=True):
                buffer.zero_()
                buffer[: len(idx)] = param.detach().reshape(-1)[idx]
            return [b.clone() for b in self._buffers]

    def _read_buffers(self) -> list[torch.Tensor]:
        with self._buffers_locked():
            return [b.clone() for b in self._buffers]

    def _buffers_locked(self) -> AbstractContextManager[None]:
        """The averager's own lock over the shared buffers, with a bound: a wedged averaging process must
        surface as an error, not hang training."""
        s = self.settings
        return holding(self._averager.lock_averaged_tensors, s.matchmaking_timeout + s.allreduce_timeout + GRACE)

    def _step(self, averaging_index: int, weight: float) -> tuple[dict[Any, dict[str, Any]], str | None]:
        """Run one hivemind step; returns (gathered round data by peer, failure reason or None)."""
        s = self.settings
        declaration: dict[str, Any] = {"round": averaging_index, "weight": float(weight)}
        if self._averager.anchors:
            declaration["anchor"] = self._averager.declared_anchor(averaging_index)
        return run_round(self._averager, self._pipe, averaging_index, declaration, weight,
                         matchmaking_timeout=s.matchmaking_timeout, allreduce_timeout=s.allreduce_timeout,
                         on_control=lambda control: setattr(self, "_control", control))

    def _apply(self, indices: list[torch.Tensor], sent: list[torch.Tensor], received: list[torch.Tensor]) -> float:
        """Add the finite part of (received − sent) to the live parameters; returns its L2 norm."""
        squared = 0.0
        with self.lock, torch.no_grad():
            for param, idx, before, after in zip(self.parameters, indices, sent, received, strict=True):
                change = (after - before)[: len(idx)]
                change = torch.where(torch.isfinite(change), change, torch.zeros_like(change))
                if change.any():
                    flat = param.data.view(-1)
                    flat[idx] += change.to(flat.device)  # the averager's buffers are on the CPU, a GPU worker's not
                    squared += float(change.double().square().sum())
        return math.sqrt(squared)

    # ----- state sharing -----

    def _serve(self, provider: Callable[[], SharedState]) -> Callable[[], SharedState]:
        """``provider``'s state, with this peer's anchors after it when it holds any (``anchored``)."""

        def serve() -> SharedState:
            # Hand out the post-round parameters of a round in progress rather than the pre-round ones. (A
            # round never blocks on this: it only waits for rounds, and the copy-back is atomic under the
            # parameters' lock anyway, so a state is never half averaged.)
            self._between_rounds()
            state = provider()
            anchors = self._averager.served_anchors()
            if anchors is None:
                return state
            return SharedState({**state.metadata, "anchored": list(anchors.partitions)},
                               [*state.tensors, *anchors.values])

        return serve

    def _between_rounds(self) -> None:
        """Wait, within a round's bound, until no round runs."""
        s = self.settings
        with self._round_cv:
            self._round_cv.wait_for(lambda: not self._round_active,
                                    timeout=s.matchmaking_timeout + s.allreduce_timeout + GRACE)

    @property
    def anchor_layout(self) -> dict[str, Any]:
        """What a joiner's ``StateExpectation`` needs to accept a donor's anchors (none in a float32 run)."""
        return {"anchors": self._averager.anchor_numels, "partitions": self.masks.partitions}

    def install_anchors(self, anchors: Anchors) -> bool:
        """Take a donor's anchors (``anchored``), downloaded with its state, once no round runs (a round asked for
        meanwhile is skipped as if the previous one still ran); False, and nothing changed, when a round still runs
        after a round's bound: the anchors only spare bytes, and the rounds set their own."""
        self._between_rounds()
        if not self._claim_round():
            log.warning("%s: an averaging round is still running; the donor's anchors are not taken", self.stage)
            return False
        try:
            self._averager.install_anchors(anchors)
        finally:
            self._release_round()
        return True

    @property
    def sharing(self) -> bool:
        """Whether joiners may download this peer's state: only an active (synchronised) worker should."""
        return self._averager.allow_state_sharing

    @sharing.setter
    def sharing(self, enabled: bool) -> None:
        with self._pipe:
            self._averager.allow_state_sharing = enabled

    def set_sharing_priority(self, priority: float) -> None:
        """Joiners try donors in decreasing priority: give the swarm step the state belongs to."""
        with self._pipe:
            self._averager.state_sharing_priority = float(priority)

    def fetch_state(self, expect: StateExpectation, *, timeout: float, chunk_timeout: float) -> MPFuture:
        """Start downloading a same-stage donor's state (see ``StageAverager.fetch_state``)."""
        with self._pipe:
            return self._averager.fetch_state(expect, timeout=timeout, chunk_timeout=chunk_timeout)

    @property
    def bytes_received(self) -> int:
        """State bytes received so far by the running ``fetch_state`` (for a progress bar)."""
        return self._averager.bytes_received

    @property
    def averager(self) -> AnchoredAverager:
        """The underlying hivemind averager (its process id, its tensors' lock: monitoring and tests)."""
        return self._averager

    @property
    def round_stage(self) -> str:
        """hivemind's stage of the running round (LOOKING_FOR_GROUP, RUNNING_ALLREDUCE…), or IDLE."""
        control = self._control
        return control.stage.name if control is not None else "IDLE"

    def shutdown(self) -> None:
        if self._averager.is_alive():
            self._averager.shutdown()
