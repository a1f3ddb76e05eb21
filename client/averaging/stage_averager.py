"""hivemind's DecentralizedAverager with what a pipeline stage needs on top of it.

``DecentralizedAverager`` runs in its own process and averages a fixed list of shared-memory tensors with the
peers it meets under one DHT prefix. ``StageAverager`` adds, inside that process:

- a group check before any tensor moves: every peer of the group declares (through hivemind's all-gather)
  the averaging round it is in and its weight. Peers that disagree on the round would average different
  SPARTA slices element by element, so the round fails for all of them instead; a group whose weights are all
  0 skips the all-reduce, since hivemind's reducer divides by the summed weight and would produce NaN;
- state transfer to joiners with a byte counter the host reads for a progress bar, and checks on what
  arrives: a donor is an untrusted peer, so tensors of the wrong number, shape or dtype, non-finite values, or
  metadata of another run, stage or model are refused and the next donor is tried.

The donor side is hivemind's own state sharing (``allow_state_sharing``, declared under
``<prefix>.all_averagers``); what a donor serves comes from ``state_provider``, called in the host process.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing as mp
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

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
        state_provider: Callable[[], SharedState] | None = None,
        **kwargs: Any,
    ) -> None:
        # Shared with the averager's process, so they must exist before it forks.
        self._round = mp.Value(ctypes.c_int64, -1, lock=False)
        self._group_size = mp.Value(ctypes.c_int32, 0, lock=False)
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

    def prepare_round(self, averaging_index: int) -> None:
        """Declare the round the next ``step`` belongs to; groups only form among peers of the same round."""
        self._round.value = averaging_index
        self._group_size.value = 0
        self.set_group_bits(format(averaging_index % 256, "08b"))

    @property
    def last_group_size(self) -> int:
        """Peers in the group of the last step (0: no group formed)."""
        return int(self._group_size.value)

    @property
    def bytes_received(self) -> int:
        """State bytes received so far by the current ``fetch_state``."""
        return int(self._received.value)

    def get_current_state(self) -> tuple[dict[str, Any], Sequence[torch.Tensor], None]:
        """What this peer serves to joiners (hivemind calls it in the host process)."""
        if self._state_provider is None:
            return {}, [], None  # empty metadata: the joiner moves on to another donor
        state = self._state_provider()
        return state.metadata, state.tensors, None

    def fetch_state(self, expect: StateExpectation, *, timeout: float, chunk_timeout: float) -> MPFuture:
        """Start downloading a same-stage peer's state; the future holds ``(metadata, tensors, refusals)``,
        ``metadata`` None when no donor served an acceptable state."""
        self._received.value = 0
        future: MPFuture = MPFuture()
        self._outer_pipe.send(
            ("_fetch_state", [], dict(future=future, expect=expect, timeout=timeout, chunk_timeout=chunk_timeout))
        )
        return future

    # ----- averager process -----

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        self._group_size.value = group_info.group_size
        try:
            declared = [self._declaration(blob) for blob in group_info.gathered]
            rounds = {round_ for round_, _ in declared}
            if rounds != {self._round.value}:
                raise AllreduceException(f"peers of the group are in different averaging rounds: {sorted(rounds)}")
        except AllreduceException:
            self._close_group(group_info)
            raise
        if not any(weight > 0 for _, weight in declared):
            logger.info(f"averaging round {self._round.value}: every weight in the group is 0, skipped")
            self._close_group(group_info)
            return {peer: {"round": r, "weight": w}
                    for peer, (r, w) in zip(group_info.peer_ids, declared, strict=True)}
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    def _close_group(self, group_info: GroupInfo) -> None:
        """Mark a group that will run no all-reduce as finished, so a groupmate's stray request is turned away."""
        pending = self._running_groups.get(group_info.group_id)
        if pending is not None and not pending.done():
            pending.cancel()

    def _user_data(self, blob: bytes) -> Any:
        """What a groupmate passed as ``gather`` to its step, from its gathered blob (untrusted: may raise)."""
        _, _, user_bytes = self.serializer.loads(blob)
        return self.serializer.loads(user_bytes)

    def _declaration(self, blob: bytes) -> tuple[int, float]:
        """(round, weight) a groupmate declared in its gathered data; anything else fails the round."""
        try:
            user = self._user_data(blob)
            round_, weight = user["round"], user["weight"]
        except Exception as exc:  # a groupmate's bytes: any malformation must fail the round, not the process
            raise AllreduceException(f"a groupmate sent malformed round data: {exc!r}") from None
        if not isinstance(round_, int) or not isinstance(weight, int | float) or not 0 <= weight < math.inf:
            raise AllreduceException(f"a groupmate declared round {round_!r} with weight {weight!r}")
        return round_, float(weight)

    async def _fetch_state(self, future: MPFuture, expect: StateExpectation, timeout: float,
                           chunk_timeout: float) -> None:
        refusals: list[str] = []
        try:
            metadata, tensors = await asyncio.wait_for(self._fetch_from_donors(expect, chunk_timeout, refusals),
                                                       timeout)
            future.set_result((metadata, tensors, refusals))
        except TimeoutError:
            refusals.append(f"no same-stage peer served an acceptable state within {timeout:.0f} s"
                            if refusals else "no same-stage peer shares its state")
            future.set_result((None, [], refusals))
        except Exception as exc:  # report to the host instead of dying silently in the averager's process
            refusals.append(f"state download failed: {exc!r}")
            future.set_result((None, [], refusals))

    async def _fetch_from_donors(self, expect: StateExpectation, chunk_timeout: float,
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
                    metadata, tensors = await self._receive(stream, expect, chunk_timeout)
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

    async def _receive(self, stream: Any, expect: StateExpectation,
                       chunk_timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
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
