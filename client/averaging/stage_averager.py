"""hivemind's DecentralizedAverager with what a pipeline stage needs on top of it.

``DecentralizedAverager`` runs in its own process and averages a fixed list of shared-memory tensors with the
peers it meets under one DHT prefix. ``StageAverager`` adds, inside that process:

- membership before any tensor moves (``client.averaging.membership``): every peer of the group declares
  (through hivemind's all-gather) the round it is in and its weight, sealed with its key. A leader refuses a
  follower whose declaration does not pass, and every groupmate admits to the all-reduce only the peers whose
  declarations pass (roster, epoch, round, seal, one seat per key, a bandwidth and mode hivemind can
  take): the rest are dropped, not the round. A peer in another round would average other SPARTA slices
  element by element, so it is dropped like a stranger; a group whose admitted weights are all 0 skips the
  all-reduce (hivemind's reducer would give NaN);
- robust reduction (``client.averaging.robust``): each part is reduced by one CenteredClip step from the
  coordinate median rather than by the mean, so one admitted liar moves the result by a bounded amount;
- state transfer to joiners with a byte counter the host reads for a progress bar, and checks on what
  arrives: a donor must be on the stage's roster and seal its declaration for its peer id (a stranger is
  refused at its metadata), and is untrusted even so: tensors of the wrong number, shape or dtype,
  non-finite values, or metadata of another run, stage or model are refused and the next donor is tried.

The donor side is hivemind's own state sharing (``allow_state_sharing``, declared under
``<prefix>.all_averagers``); what a donor serves comes from ``state_provider``, called in the host process.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing as mp
import random
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from client.averaging.membership import STATE_SHARING, Declared, Membership, Roster, check, seal
from client.averaging.robust import RobustRunner
from client.helper_processes import forking_helpers

logger = get_logger(__name__)

# hivemind streams state in chunks of 64 KiB; a donor may not send more than the expected bytes plus this.
_CHUNK_SLACK_BYTES = 2**16
_DONOR_POLL = 0.5  # seconds between looks for donors in the DHT
_DONOR_ATTEMPTS = 3  # downloads from one donor whose stream broke off before giving up on it


class _BrokenOff(ValueError):
    """A donor's state stream ended before its last tensor: hivemind's transport closes a stream quietly when
    a send fails, so this says nothing about the donor's honesty and the download may be tried again."""


@dataclass(frozen=True)
class SharedState:
    """What a donor serves: small metadata (msgpack-serialisable) and tensors in ``metadata['keys']`` order."""

    metadata: dict[str, Any]
    tensors: Sequence[torch.Tensor]


@dataclass(frozen=True)
class StateExpectation:
    """What a joiner accepts: ``identity`` entries must appear verbatim in the donor's metadata, and the
    tensors must match ``names``, ``shapes`` and ``dtypes`` one for one. Picklable: it travels to the
    averager's process."""

    identity: dict[str, Any]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError("names, shapes and dtypes must have one entry per tensor")
        sizes = (math.prod(s) * torch.empty((), dtype=getattr(torch, d)).element_size()
                 for s, d in zip(self.shapes, self.dtypes, strict=True))
        object.__setattr__(self, "nbytes", sum(sizes))

    @classmethod
    def of(cls, identity: dict[str, Any], tensors: dict[str, torch.Tensor]) -> StateExpectation:
        """The expectation matching a local module's ``state_dict()``."""
        return cls(
            identity=dict(identity),
            names=tuple(tensors),
            shapes=tuple(tuple(t.shape) for t in tensors.values()),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors.values()),
        )

    def check_metadata(self, metadata: object) -> None:
        if not isinstance(metadata, dict):
            raise ValueError("its metadata is not a dict")
        for key, value in self.identity.items():
            if metadata.get(key) != value:
                raise ValueError(f"it serves {key}={metadata.get(key)!r}, this node needs {value!r}")
        keys = metadata.get("keys")
        if not isinstance(keys, list | tuple) or tuple(keys) != self.names:
            raise ValueError("its tensor names differ from this stage's")


class StageAverager(DecentralizedAverager):
    """A DecentralizedAverager with the group check and state transfer described in the module docstring."""

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        membership: Membership,
        state_provider: Callable[[], SharedState] | None = None,
        **kwargs: Any,
    ) -> None:
        # Shared with the averager's process, so they must exist before it forks.
        self._round = mp.Value(ctypes.c_int64, -1, lock=False)
        self._group_size = mp.Value(ctypes.c_int32, 0, lock=False)
        self._refused = mp.Value(ctypes.c_int32, 0, lock=False)
        self._membership = membership
        self._roster = Roster(-1, frozenset())  # the averaging process's copy, sent with each round
        self._received = mp.Value(ctypes.c_int64, 0, lock=False)
        self._state_provider = state_provider
        super().__init__(averaged_tensors, dht, start=False, **kwargs)
        # Not hivemind's run_in_background: it sets SIGINT to SIG_IGN in this (host) process, which raises outside
        # the main thread and leaves Ctrl+C ignored for good. The averaging process is deaf to Ctrl+C instead:
        # the host shuts it down in order.
        with forking_helpers():
            self.start()
        self.wait_until_ready()

    # ----- host side -----

    def prepare_round(self, averaging_index: int, declaration: dict[str, Any]) -> dict[str, Any]:
        """Declare the round the next ``step`` belongs to (groups only form among peers of the same round) and
        hand the averaging process the current roster; returns ``declaration`` sealed, to gather."""
        roster = self._membership.roster()
        self._outer_pipe.send(("_set_roster", [roster], {}))
        self._round.value = averaging_index
        self._group_size.value = self._refused.value = 0
        self.set_group_bits(format(averaging_index % 256, "08b"))
        return seal(self._membership, self.prefix, self.peer_id.to_bytes(), roster.epoch, declaration)

    @property
    def last_group_size(self) -> int:
        """Admitted peers in the group of the last step, this one included (0: no group formed)."""
        return int(self._group_size.value)

    @property
    def last_refused(self) -> int:
        """Groupmates of the last step dropped because their declaration did not pass."""
        return int(self._refused.value)

    @property
    def bytes_received(self) -> int:
        """State bytes received so far by the current ``fetch_state``."""
        return int(self._received.value)

    def get_current_state(self) -> tuple[dict[str, Any], Sequence[torch.Tensor], None]:
        """What this peer serves to joiners (hivemind calls it in the host process)."""
        if self._state_provider is None:
            return {}, [], None  # empty metadata: the joiner moves on to another donor
        state = self._state_provider()
        roster = self._membership.roster()
        donor = seal(self._membership, self.prefix, self.peer_id.to_bytes(), roster.epoch,
                     {"round": STATE_SHARING, "weight": 0.0})
        return {**state.metadata, "donor": donor}, state.tensors, None

    def fetch_state(self, expect: StateExpectation, *, timeout: float, chunk_timeout: float) -> MPFuture:
        """Start downloading a same-stage peer's state; the future holds ``(metadata, tensors, refusals)``,
        ``metadata`` None when no donor served an acceptable state."""
        self._received.value = 0
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_fetch_state", [], dict(future=future, expect=expect, timeout=timeout,
                                                        chunk_timeout=chunk_timeout,
                                                        roster=self._membership.roster())))
        return future

    # ----- averager process -----

    async def _set_roster(self, roster: Roster) -> None:
        self._roster = roster

    def _check(self, blob: bytes, peer: PeerID) -> Declared | str:
        """A groupmate's gathered declaration if it may take part in this round, else why not."""
        try:
            user = self._user_data(blob)
        except Exception as exc:  # a groupmate's bytes: any malformation costs it its place, nothing more
            return f"malformed round data ({type(exc).__name__})"
        return check(user, self.prefix, peer.to_bytes(), self._roster, int(self._round.value))

    def _admit(self, group_info: GroupInfo) -> tuple[GroupInfo, dict[PeerID, Declared]]:
        """The group restricted to the peers whose declarations pass, in the leader's order; a key declared by
        two peers seats neither. Every honest groupmate computes the same from the same gathered list."""
        checked = {peer: self._check(blob, peer) for peer, blob in zip(group_info.peer_ids, group_info.gathered,
                                                                          strict=True)}
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
            return {peer: declared.body for peer, declared in admitted.items()}
        return await self._aggregate_admitted(group, admitted, min_vector_size, **kwargs)

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
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                      group_id: bytes | None = None, **kwargs: Any) -> None:
        """hivemind's in-place all-reduce with ``RobustRunner``: each part reduced by CenteredClip."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = RobustRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                              group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        self._running_groups[group_id].set_result(runner)
        async for tensor, update in azip(as_aiter(*tensors), runner):
            tensor.add_(update, alpha=self._averaging_alpha)
            self.last_updated = get_dht_time()
            self._state_updated.set()

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

    async def _fetch_state(self, future: MPFuture, expect: StateExpectation, timeout: float,
                           chunk_timeout: float, roster: Roster) -> None:
        refusals: list[str] = []
        try:
            metadata, tensors = await asyncio.wait_for(
                self._fetch_from_donors(expect, chunk_timeout, roster, refusals), timeout)
            future.set_result((metadata, tensors, refusals))
        except TimeoutError:
            refusals.append(f"no same-stage peer served an acceptable state within {timeout:.0f} s"
                            if refusals else "no same-stage peer shares its state")
            future.set_result((None, [], refusals))
        except Exception as exc:  # report to the host instead of dying silently in the averager's process
            refusals.append(f"state download failed: {exc!r}")
            future.set_result((None, [], refusals))

    async def _fetch_from_donors(self, expect: StateExpectation, chunk_timeout: float, roster: Roster,
                                 refusals: list[str]) -> tuple[dict[str, Any] | None, list[torch.Tensor]]:
        """Try donors, freshest first, until one serves an acceptable state; look again while none is listed
        (a donor that just turned sharing on is declared in the DHT a moment later). Ends by the caller's
        timeout when nobody serves."""
        refused: set[PeerID] = set()
        broken_off: dict[PeerID, int] = {}
        while True:
            donors = {peer: priority for peer, priority in (await self._donors()).items() if peer not in refused}
            # Highest priority (the freshest state) first; random among equals so one donor is not swamped.
            for peer in sorted(donors, key=lambda p: (-donors[p], random.random())):
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata, tensors = await self._receive(stream, expect, chunk_timeout, peer, roster)
                except _BrokenOff as exc:  # the transport ended the stream early: the donor may still be fine
                    broken_off[peer] = broken_off.get(peer, 0) + 1
                    if broken_off[peer] >= _DONOR_ATTEMPTS:
                        refused.add(peer)
                    refusals.append(f"{peer}: {exc} (attempt {broken_off[peer]} of {_DONOR_ATTEMPTS})")
                    self._received.value = 0
                    continue
                except Exception as exc:  # a faulty or malicious donor: note why and try the next one
                    refused.add(peer)
                    refusals.append(f"{peer}: {exc}")
                    self._received.value = 0
                    continue
                return metadata, tensors
            await asyncio.sleep(_DONOR_POLL)

    async def _donors(self) -> dict[PeerID, float]:
        """Peers of this prefix that declare they share their state, with their priority."""
        key = f"{self._matchmaking.group_key_manager.prefix}.all_averagers"
        found = await self.dht.get(key, latest=True, return_future=True)
        donors: dict[PeerID, float] = {}
        if found is not None and isinstance(found.value, dict):
            for subkey, item in found.value.items():
                if isinstance(item, ValueWithExpiration) and isinstance(item.value, int | float):
                    try:
                        donors[PeerID(subkey)] = float(item.value)
                    except Exception:  # a malformed subkey someone stored: not a donor
                        continue
        donors.pop(self.peer_id, None)
        return donors

    async def _receive(self, stream: Any, expect: StateExpectation, chunk_timeout: float, donor: PeerID,
                       roster: Roster) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The donor's state, refused (ValueError) at its metadata unless the donor is a roster member who sealed
        its declaration for the peer id this stream comes from, then tensor by tensor as it arrives."""
        metadata: dict[str, Any] | None = None
        tensors: list[torch.Tensor] = []
        parts: list[Any] = []
        remaining = received = 0
        async for message in aiter_with_timeout(stream, chunk_timeout):
            if message.metadata:
                if metadata is not None:
                    raise ValueError("it sent metadata twice")
                metadata = self.serializer.loads(message.metadata)
                expect.check_metadata(metadata)
                admitted = check(metadata.get("donor"), self.prefix, donor.to_bytes(), roster, STATE_SHARING)
                if isinstance(admitted, str):
                    raise ValueError(f"it is not a worker of this stage: {admitted}")
            if metadata is None:
                raise ValueError("it sent tensors before metadata")
            part = message.tensor_part
            index = len(tensors)
            if remaining == 0:
                if index == len(expect.names):
                    raise ValueError(f"it sent more than the {index} expected tensors")
                if part.dtype != expect.dtypes[index] or tuple(part.size) != expect.shapes[index]:
                    raise ValueError(f"tensor {expect.names[index]} arrives as {part.dtype}{list(part.size)}, "
                                     f"expected {expect.dtypes[index]}{list(expect.shapes[index])}")
                remaining, parts = max(part.chunks, 1), []
            parts.append(part)
            received += len(part.buffer)
            if received > expect.nbytes + _CHUNK_SLACK_BYTES * len(expect.names):
                raise ValueError("it sent more bytes than the stage's state holds")
            self._received.value = received
            remaining -= 1
            if remaining == 0:
                tensor = deserialize_torch_tensor(combine_from_streaming(parts))
                if tuple(tensor.shape) != expect.shapes[index] or not torch.isfinite(tensor).all():
                    raise ValueError(f"tensor {expect.names[index]} is malformed or not finite")
                tensors.append(tensor)
        if metadata is None:
            raise ValueError("it does not share its state")
        if remaining or len(tensors) != len(expect.names):
            raise _BrokenOff(f"its state stopped after {len(tensors)} of {len(expect.names)} tensors")
        return metadata, tensors
