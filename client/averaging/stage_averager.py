"""hivemind's DecentralizedAverager with what a pipeline stage needs on top of it.

``DecentralizedAverager`` runs in its own process and averages a fixed list of shared-memory tensors with the
peers it meets under one DHT prefix. ``StageAverager`` adds, inside that process:

- membership before any tensor moves (``client.averaging.membership``): every peer of the group declares
  (through hivemind's all-gather) the round it is in and its weight, sealed with its key. A leader refuses a
  follower whose declaration does not pass, and every groupmate admits to the all-reduce only the peers whose
  declarations pass (roster, epoch, round, seal, one seat per key, a weight no larger than ``max_weight``, a
  bandwidth and mode hivemind can take): the rest are dropped, not the round. A leader begins the round as soon
  as every member of the roster holds a seat, since no one else may join, rather than after
  ``min_matchmaking_time``. A reducer then refuses every part sent with another weight than its sender declared
  (hivemind's reducer weighs each part by the weight it arrives with, not by the declaration) and bans that
  sender for the round. A peer in another round would
  average other SPARTA slices element by element, so it is dropped like a stranger; a group whose admitted
  weights are all 0 skips the all-reduce (hivemind's reducer would give NaN);
- robust reduction (``client.averaging.robust``): each part is reduced by one CenteredClip step from the
  coordinate median rather than by the mean, so one admitted liar moves the result by a bounded amount; what
  another reducer returns is checked part by part (finite, within ``_result_bound``), and a reducer whose part
  fails keeps its shard at the local values, the rest of the tensor averaged;
- weights that follow work (``client.averaging.work``), where the round credits it: each groupmate's weight
  is at most the samples its trainer-signed Backward headers prove, each header naming that groupmate as the
  worker it was sent to, and each peer's parts carry the weight every groupmate credits it with;
- what the round stands for: the declarations it returns are those of the admitted peers whose contributions
  this peer's reducers did not refuse, so the weight a caller sums never counts a banned sender's claim;
- evidence of lies: a refused declaration that proves a roster member lied (``membership.falsehood``) is kept,
  with the prefix and peer id its seal covers, for the host to hand on as an accusation (``drain_lies``);
- reductions anyone can check (``client.averaging.audit``): every part sent is signed, every part returned comes
  with its reducer's signed statement of what it reduced, and after each round this peer audits each other
  reducer with probability ``audit_rate`` (``auditor``, which also serves the audits of its own reductions); a forged
  statement or a result that is not the robust mean of its inputs is kept as evidence for the host like a lie;
- state transfer to joiners (``client.averaging.state_transfer``): donors declared in sealed DHT records, tried
  only when a roster member sealed them, and every state checked as it arrives.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing as mp
import queue
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time, get_logger
from hivemind.utils.asyncio import achain, as_aiter, azip

from client.averaging.auditor import AUDIT_RATE, Auditor
from client.averaging.membership import Declared, Membership, Roster, check, falsehood, seal
from client.averaging.runner import RobustRunner
from client.averaging.state_transfer import SharedState, StateTransfer
from client.averaging.work import WorkRule
from client.helper_processes import forking_helpers, receive_whole

logger = get_logger(__name__)

MAX_LIES = 64
"""Proven lies the averaging process keeps for its host between two drains (more are dropped: one per liar and
round is all an accusation needs)."""
PART_BYTES = 1 << 16
"""The size of the parts a reducer reduces, signs and may be audited on: what one piece of evidence carries k + 1
of (hivemind's default, 512 KiB, would make each accusation megabytes)."""


class StageAverager(StateTransfer, Auditor, DecentralizedAverager):
    """A DecentralizedAverager with the group check and state transfer described in the module docstring."""

    runner_class: type[RobustRunner] = RobustRunner

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        membership: Membership,
        state_provider: Callable[[], SharedState] | None = None,
        max_weight: float = math.inf,
        work: WorkRule | None = None,
        audit_rate: float = AUDIT_RATE,
        **kwargs: Any,
    ) -> None:
        """``max_weight``: the most a groupmate may declare (``membership``: what its role can honestly claim);
        ``work``: how rounds credit work, each weight then at most the samples a groupmate's evidence proves
        (``client.averaging.work``; None: declared weights stand); ``audit_rate``: the chance that this peer audits
        each other reducer of a round (``auditor``; a run's ``audit_rate``)."""
        # Shared with the averager's process, so they must exist before it forks.
        self._round = mp.Value(ctypes.c_int64, -1, lock=False)
        self._group_size = mp.Value(ctypes.c_int32, 0, lock=False)
        self._refused = mp.Value(ctypes.c_int32, 0, lock=False)
        self._partial = mp.Value(ctypes.c_bool, False, lock=False)
        self._membership = membership
        self._roster = Roster(-1, frozenset())  # the averaging process's copy, sent with each round
        self._received = mp.Value(ctypes.c_int64, 0, lock=False)
        self._state_provider = state_provider
        self._max_weight = float(max_weight)
        self._work = work
        self.audit_rate = audit_rate
        self._admitted_by_group: dict[bytes, dict[PeerID, Declared]] = {}  # the process's, during all-reduces
        self._seats: dict[PeerID, bytes] = {}  # the process's: each current follower's key, as it was checked
        self._lies: mp.Queue = mp.Queue(MAX_LIES)  # the process's proven lies, for the host (``drain_lies``)
        self._start_audits()
        kwargs.setdefault("part_size_bytes", PART_BYTES)
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        # Not hivemind's run_in_background: it sets SIGINT to SIG_IGN in this (host) process, which raises outside
        # the main thread and leaves Ctrl+C ignored for good. The averaging process is deaf to Ctrl+C instead:
        # the host shuts it down in order.
        with forking_helpers():
            self.start()
        self.wait_until_ready()

    def run(self) -> None:
        """The averaging process: hivemind's, reading each command from the host whole (a roster or a round's gather
        can be large: ``client.helper_processes.receive_whole``)."""
        receive_whole(self._inner_pipe)
        super().run()

    # ----- host side -----

    def prepare_round(self, averaging_index: int, declaration: dict[str, Any]) -> dict[str, Any]:
        """Declare the round the next ``step`` belongs to (groups only form among peers of the same round) and
        hand the averaging process the current roster; returns ``declaration`` sealed, to gather."""
        roster = self._membership.roster()
        self._outer_pipe.send(("_set_roster", [roster], {}))
        self._round.value = averaging_index
        self._group_size.value = self._refused.value = self._partial.value = 0
        self.set_group_bits(format(averaging_index % 256, "08b"))
        return seal(self._membership, self.prefix, self.peer_id.to_bytes(), roster.epoch, declaration)

    @property
    def last_group_size(self) -> int:
        """Admitted peers in the group of the last step, this one included (0: no group formed)."""
        return int(self._group_size.value)

    @property
    def last_partial(self) -> bool:
        """Whether an all-reduce of the last step went on without some peer's parts (hivemind drops one that fails)."""
        return bool(self._partial.value)

    @property
    def last_refused(self) -> int:
        """Groupmates of the last step dropped because their declaration did not pass."""
        return int(self._refused.value)

    def drain_lies(self) -> list[dict[str, Any]]:
        """The lies proven since the last drain, each as evidence anyone can check: refused declarations as
        ``{"prefix", "peer" (hex), "declaration"}`` (``membership.falsehood`` with this averager's limits), false
        reductions as ``{"reduction": …}`` (``audit.evidence``)."""
        lies = []
        with contextlib.suppress(queue.Empty):
            while True:
                lies.append(self._lies.get_nowait())
        return lies

    # ----- averager process -----

    async def _set_roster(self, roster: Roster) -> None:
        self._roster = roster

    def _check(self, blob: bytes, peer: PeerID) -> Declared | str:
        """A groupmate's gathered declaration if it may take part in this round, else why not."""
        try:
            user = self._user_data(blob)
        except Exception as exc:  # a groupmate's bytes: any malformation costs it its place, nothing more
            return f"malformed round data ({type(exc).__name__})"
        return check(user, self.prefix, peer.to_bytes(), self._roster, int(self._round.value), self._max_weight,
                     self._work)

    def _keep_if_lie(self, blob: bytes, peer: PeerID) -> None:
        """Keep a refused declaration for the host if it proves that a member of the roster lied
        (``membership.falsehood``; a stranger's lies are refused like the rest of it: it has no place to lose)."""
        try:
            declaration = self._user_data(blob)
        except Exception:  # a groupmate's bytes: unreadable ones prove nothing against anyone
            return
        lie = falsehood(declaration, self.prefix, peer.to_bytes(), self._max_weight, self._work)
        if lie is not None and lie[0] in self._roster.members:
            self._keep({"prefix": self.prefix, "peer": peer.to_bytes().hex(), "declaration": declaration})

    def _keep(self, proof: dict[str, Any]) -> None:
        with contextlib.suppress(queue.Full):
            self._lies.put_nowait(proof)

    def _admit(self, group_info: GroupInfo) -> tuple[GroupInfo, dict[PeerID, Declared]]:
        """The group restricted to the peers whose declarations pass, in the leader's order; a key declared by
        two peers seats neither. Every honest groupmate computes the same from the same gathered list."""
        blobs = dict(zip(group_info.peer_ids, group_info.gathered, strict=True))
        checked = {peer: self._check(blob, peer) for peer, blob in blobs.items()}
        seats: dict[bytes, int] = {}
        for found in checked.values():
            if isinstance(found, Declared):
                seats[found.member] = seats.get(found.member, 0) + 1
        admitted: dict[PeerID, Declared] = {}
        for peer, found in checked.items():
            if isinstance(found, Declared) and seats[found.member] > 1:
                found = "its key is declared by another peer of the group too"
            if isinstance(found, str):
                logger.warning(f"averaging round {self._round.value}: dropped groupmate {peer}: {found}")
                self._keep_if_lie(blobs[peer], peer)
            else:
                admitted[peer] = found
        kept = [i for i, peer in enumerate(group_info.peer_ids) if peer in admitted]
        group = GroupInfo(group_info.group_id, tuple(group_info.peer_ids[i] for i in kept),
                          tuple(group_info.gathered[i] for i in kept))
        return group, admitted

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        group, admitted = self._admit(group_info)
        self._refused.value = group_info.group_size - group.group_size
        self._group_size.value = group.group_size
        if self.peer_id not in admitted or group.group_size < 2:
            self._close_group(group_info)
            return {}
        if not any(declared.weight > 0 for declared in admitted.values()):
            logger.info(f"averaging round {self._round.value}: every weight in the group is 0, skipped")
            self._close_group(group_info)
            return self._reported(admitted, admitted)
        if self._work is not None:  # its parts carry the weight every groupmate credits it, not its claim
            kwargs["weight"] = admitted[self.peer_id].weight
        ids = self._group_ids(group.group_id)
        self._admitted_by_group.update(dict.fromkeys(ids, admitted))
        try:
            gathered = await self._aggregate_admitted(group, admitted, min_vector_size, **kwargs)
        finally:
            for group_id in ids:
                self._admitted_by_group.pop(group_id, None)
        refused = self._refused_senders(ids)
        self._audit_later(ids)
        return self._reported(admitted, [peer for peer in gathered if peer not in refused])

    @staticmethod
    def _reported(admitted: dict[PeerID, Declared], peers: typing.Iterable[PeerID]) -> dict[PeerID, dict[str, Any]]:
        """What the host learns of each of ``peers``: its declaration with the weight it averaged with, less its
        evidence (already checked here)."""
        return {peer: {**{k: v for k, v in admitted[peer].body.items() if k != "work"},
                       "weight": admitted[peer].weight} for peer in peers}

    def _group_ids(self, group_id: bytes) -> list[bytes]:
        """The ids of the all-reduces one group runs: its own (PowerSGD's phases add theirs)."""
        return [group_id]

    def _complete(self, group_id: bytes) -> bool:
        """Whether the all-reduce of ``group_id`` heard from every sender and every reducer, and kept every
        result (a reducer whose result was refused counts as failed: ``RobustRunner``)."""
        runner: AllReduceRunner = self._running_groups[group_id].result()
        return not runner.banned_senders and runner.tensor_part_container.failed_size == 0

    def _refused_senders(self, ids: Sequence[bytes]) -> set[PeerID]:
        """The senders this peer's reducers banned in the all-reduces ``ids`` (refused parts, silence)."""
        refused: set[PeerID] = set()
        for group_id in ids:
            pending = self._running_groups.get(group_id)
            if pending is not None and pending.done() and not pending.cancelled() and pending.exception() is None:
                refused |= pending.result().banned_senders
        return refused

    async def _aggregate_admitted(self, group_info: GroupInfo, admitted: dict[PeerID, Declared],
                                  min_vector_size: int, **kwargs: Any) -> Any:
        """The all-reduce among the admitted peers (hivemind's, or a subclass's phases); ``admitted`` holds
        their checked declarations, for a subclass's limits."""
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:
        """hivemind's leader, refusing a follower whose declaration does not pass before it joins the group.
        (hivemind finds streaming handlers by ``typing.AsyncIterator`` annotations.)"""
        found = self._check(request.gather, context.remote_id)
        if isinstance(found, str):
            logger.info(f"refused {context.remote_id} a place in an averaging group: {found}")
            self._keep_if_lie(request.gather, context.remote_id)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            if response.code == averaging_pb2.ACCEPTED:
                await self._seat(context.remote_id, found.member)
            yield response

    async def _seat(self, follower: PeerID, member: bytes) -> None:
        """Record the key ``follower`` was accepted for (its declaration checked as it joined, not again), and begin
        the round once every member of the roster holds a seat: no one else may join, so the group need not wait
        out ``min_matchmaking_time``. A key seated twice counts once, so a member running two peers cannot start a
        round without an honest member. This is hivemind's own early assembly (what its ``target_group_size``
        does), at the point hivemind does it: right after a follower is accepted, while its join holds the lock
        over joins."""
        matchmaking = self._matchmaking
        self._seats = {peer: key for peer, key in self._seats.items() if peer in matchmaking.current_followers}
        self._seats[follower] = member
        seated = {self._membership.key, *self._seats.values()}
        if (len(seated) >= matchmaking.min_group_size and seated >= self._roster.members
                and not matchmaking.assembled_group.done()):
            await matchmaking.leader_assemble_group()

    async def rpc_aggregate_part(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's handler, with every incoming part checked (``_part_refusal``) before the reducer sees it: a
        refused part raises inside the runner's handler, which bans the sender for the rest of the round.
        (hivemind finds streaming handlers by ``typing.AsyncIterator`` annotations.)"""
        request = await anext(stream)
        if request.group_id not in self._running_groups:
            await self._pending_groups_registered.wait()  # the leader's answer may arrive after a groupmate's parts
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        runner: AllReduceRunner = await future
        checked = self._checked_parts(achain(as_aiter(request), stream), request.group_id, context.remote_id)
        async for message in runner.rpc_aggregate_part(checked, context):
            yield message

    async def _checked_parts(self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], group_id: bytes,
                             peer: PeerID) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        declared = self._admitted_by_group.get(group_id, {}).get(peer)
        async for message in stream:
            refusal = "is not an admitted groupmate" if declared is None else self._part_refusal(
                message, group_id, peer, declared)
            if refusal:
                raise AllreduceException(f"{peer} {refusal}")
            yield message

    def _part_refusal(self, message: averaging_pb2.AveragingData, group_id: bytes, peer: PeerID,
                      declared: Declared) -> str:
        """Why a groupmate's part may not be reduced, or "": it must carry the weight its sender declared (a
        double, as declared: no rounding)."""
        if message.weight != declared.weight:
            return f"sent weight {message.weight}, declared {declared.weight}"
        return ""

    def _result_bound(self, group_id: bytes) -> float:
        """The largest L2 norm any part of the all-reduce ``group_id`` can honestly come back with from another
        reducer (none known here: only a non-finite part is refused)."""
        return math.inf

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        """hivemind's in-place all-reduce with ``RobustRunner``: each part reduced by CenteredClip, each part
        another reducer returns checked against ``_result_bound``."""
        group_id = group_info.group_id if group_id is None else group_id
        keys = {peer: declared.member for peer, declared in self._admitted_by_group.get(group_id, {}).items()}
        runner = self.runner_class(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                              group_id=group_id, ordered_peer_ids=group_info.peer_ids, signer=self._membership.keypair,
                              keys=keys, result_bound=self._result_bound(group_id), **kwargs)
        self._remember(group_id, runner.reductions)
        self._running_groups[group_id].set_result(runner)
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.lerp_(averaged, self._averaging_alpha)  # at alpha 1 (every round here) exactly the average
            self.last_updated = get_dht_time()
            self._state_updated.set()
        self._partial.value = self._partial.value or not self._complete(group_id)

    def _close_group(self, group_info: GroupInfo) -> None:
        """Mark a group that will run no all-reduce as finished, so a groupmate's stray request is turned away."""
        pending = self._running_groups.get(group_info.group_id)
        if pending is not None and not pending.done():
            pending.cancel()

    def _user_data(self, blob: bytes) -> Any:
        """What a groupmate passed as ``gather`` to its step, from its gathered blob (untrusted: raises unless
        hivemind's header, its bandwidth and mode, is one that hivemind's load balancing can take: a groupmate
        declaring mode 7 or bandwidth "x" would otherwise fail every admitted group's all-reduce)."""
        bandwidth, mode, user_bytes = self.serializer.loads(blob)
        if bandwidth is not None and (not isinstance(bandwidth, int | float) or isinstance(bandwidth, bool)
                                      or not 0 <= bandwidth < math.inf):
            raise ValueError(f"bandwidth {bandwidth!r}")
        AveragingMode(mode)
        return self.serializer.loads(user_bytes)
