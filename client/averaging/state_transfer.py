"""A stage's state transfer to joiners, over hivemind's state sharing: who is tried, and what is accepted.

The donor side is hivemind's own state sharing (``allow_state_sharing``), but declared in the DHT the way every
psyswarm record is (``client.sealed``): under ``<prefix>.donors``, in the subkey of the donor's own key, sealed,
naming its peer id and priority. hivemind's ``<prefix>.all_averagers`` is writable by anyone, so a stranger could
list any number of peers at the highest priority, and a joiner would wait out each one's ``chunk_timeout`` before
reaching an honest donor; sealed records cannot be forged or overwritten by anyone but their owner, so a joiner
tries only the donors whose owners are on its roster (one per member, highest priority first), and a record
a stranger stored is never tried. What a donor serves comes from ``state_provider``, called in the host process.

The joiner side counts the bytes received (the host reads them for a progress bar) and checks what arrives: a
donor must be on the stage's roster and seal its declaration for its peer id (a member's record naming some
other peer gets that peer refused at its metadata), and is untrusted even so: tensors of the wrong number,
shape or dtype, non-finite values, or metadata of another run, stage or model are refused and the next donor
is tried. Where the stage's majority has vouched for digests of its state (``client.witness.digests``), a state
that hashes to none of them is refused as well, whatever step or priority its donor claims.

A donor in a run whose slices travel as changes serves its SPARTA anchors after the state's tensors (metadata
``"anchored"``: the partitions it holds one for; ``client.averaging.anchored``). They are checked for their
form like any tensor, and kept out of the digest: they are not the state, and a wrong one costs one float32 round.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration
from solders.keypair import Keypair

from client.averaging.membership import STATE_SHARING, Membership, Roster, check, seal
from client.pipeline.digests import state_digest
from client.sealed import store_sealed, within_lifetime

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
    digests: frozenset[str] = frozenset()  # when given, the state must hash to one (``client.pipeline.digests``)
    anchors: tuple[int, ...] = ()  # the SPARTA anchors' sizes a donor may serve after the state; () for none
    partitions: int = 0  # SPARTA's partitions, which a donor's "anchored" names
    nbytes: int = field(init=False)  # the state's bytes, without the anchors

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError("names, shapes and dtypes must have one entry per tensor")
        sizes = (math.prod(s) * torch.empty((), dtype=getattr(torch, d)).element_size()
                 for s, d in zip(self.shapes, self.dtypes, strict=True))
        object.__setattr__(self, "nbytes", sum(sizes))

    @classmethod
    def of(cls, identity: dict[str, Any], tensors: dict[str, torch.Tensor], digests: Collection[str] = (), *,
           anchors: Sequence[int] = (), partitions: int = 0) -> StateExpectation:
        """The expectation matching a local module's ``state_dict()`` (and, if any are given, one of ``digests``),
        with SPARTA anchors of ``anchors`` sizes over ``partitions`` partitions, if a donor serves them."""
        return cls(
            identity=dict(identity),
            names=tuple(tensors),
            shapes=tuple(tuple(t.shape) for t in tensors.values()),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors.values()),
            digests=frozenset(digests),
            anchors=tuple(anchors),
            partitions=partitions,
        )

    @property
    def anchor_nbytes(self) -> int:
        """The bytes of a donor's anchors, when it serves them (float32)."""
        return 4 * sum(self.anchors)

    def anchored(self, metadata: dict[str, Any]) -> tuple[int, ...]:
        """The partitions a donor's metadata says it serves anchors for (none: no anchor tensors follow), refused
        (ValueError) unless they are distinct partitions of this stage and this peer keeps anchors."""
        anchored = metadata.get("anchored", [])
        if not isinstance(anchored, list | tuple) or not all(
                isinstance(p, int) and not isinstance(p, bool) for p in anchored):
            raise ValueError("its anchored partitions are not a list of integers")
        if anchored and not self.anchors:
            raise ValueError("it serves anchors, and this run's slices travel as values")
        if len(set(anchored)) != len(anchored) or not all(0 <= p < self.partitions for p in anchored):
            raise ValueError(f"its anchored partitions are not distinct partitions in 0..{self.partitions - 1}")
        return tuple(anchored)

    def layout(self, anchored: bool) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each tensor a donor sends: the state's, then its anchors if it serves them."""
        state = list(zip(self.names, self.shapes, self.dtypes, strict=True))
        return state + [(f"anchor {i}", (n,), "float32") for i, n in enumerate(self.anchors)] if anchored else state

    def check_digest(self, tensors: Sequence[torch.Tensor]) -> None:
        """Refuse (ValueError) a complete state that hashes to none of ``digests``, when there are any: whatever
        the donor says of its step, only a state its stage's majority vouched for is loaded."""
        if self.digests and state_digest(dict(zip(self.names, tensors, strict=True))) not in self.digests:
            raise ValueError("its state hashes to no digest its stage's majority published")

    def check_metadata(self, metadata: object) -> None:
        if not isinstance(metadata, dict):
            raise ValueError("its metadata is not a dict")
        for key, value in self.identity.items():
            if metadata.get(key) != value:
                raise ValueError(f"it serves {key}={metadata.get(key)!r}, this node needs {value!r}")
        keys = metadata.get("keys")
        if not isinstance(keys, list | tuple) or tuple(keys) != self.names:
            raise ValueError("its tensor names differ from this stage's")


class StateTransfer:
    """The state-transfer half of ``StageAverager`` (a mixin ahead of hivemind's ``DecentralizedAverager``, whose
    donor declaration it replaces): the host's side first, then the averaging process's."""

    _membership: Membership
    _state_provider: Callable[[], SharedState] | None
    _received: Any  # an mp.Value: state bytes received by the running download, shared with the host

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
        ``metadata`` None when no donor served an acceptable state, ``tensors`` the state's and then, where
        ``expect.anchored(metadata)`` names partitions, the donor's anchors."""
        self._received.value = 0
        future: MPFuture = MPFuture()
        self._outer_pipe.send(("_fetch_state", [], dict(future=future, expect=expect, timeout=timeout,
                                                        chunk_timeout=chunk_timeout,
                                                        roster=self._membership.roster())))
        return future

    # ----- averager process -----

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
            donors = {peer: priority for peer, priority in (await self._donors(roster)).items() if peer not in refused}
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

    @property
    def donors_key(self) -> str:
        """The DHT key under which this stage's donors declare themselves, each in its own key's sealed subkey."""
        return f"{self.prefix}.donors"

    async def _donors(self, roster: Roster) -> dict[PeerID, float]:
        """The peers that roster members declare as their donors, with their priority: one per member (its
        subkey), none from anyone else. (A member's record may still name a peer that is not its own: the
        donor's metadata must carry its own seal, ``_receive``.)"""
        found = await self.dht.get(self.donors_key, latest=True, return_future=True)
        donors: dict[PeerID, float] = {}
        if found is not None and isinstance(found.value, dict):
            for owner, item in found.value.items():
                peer_priority = _donor(owner, item, roster)
                if peer_priority is not None:
                    donors[peer_priority[0]] = peer_priority[1]
        donors.pop(self.peer_id, None)
        return donors

    async def _declare_for_download_periodically(self) -> None:
        """hivemind's loop declaring this peer a donor (every ``declare_state_period`` and whenever sharing or its
        priority changes), storing a sealed record under ``donors_key`` instead of hivemind's open one; a
        record with no peer (None) withdraws the declaration when sharing stops."""
        loop = asyncio.get_event_loop()
        was_sharing = self.allow_state_sharing
        while True:
            expiration = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or was_sharing:
                record = ({"peer_id": self.peer_id.to_base58(), "priority": self.state_sharing_priority}
                          if self.allow_state_sharing else None)
                loop.run_in_executor(None, _declare, self.dht, self._membership.keypair, self.donors_key, record,
                                     expiration)
                was_sharing = self.allow_state_sharing
            self._state_updated.clear()
            try:
                await asyncio.wait_for(self._state_updated.wait(), timeout=max(0.0, expiration - get_dht_time()))
            except TimeoutError:
                pass

    async def _receive(self, stream: Any, expect: StateExpectation, chunk_timeout: float, donor: PeerID,
                       roster: Roster) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The donor's state (and its anchors, if it serves them), refused (ValueError) at its metadata unless the
        donor is a roster member who sealed its declaration for the peer id this stream comes from, then tensor by
        tensor as it arrives."""
        metadata: dict[str, Any] | None = None
        layout: list[tuple[str, tuple[int, ...], str]] = []
        limit = 0
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
                anchored = bool(expect.anchored(metadata))
                layout = expect.layout(anchored)
                limit = expect.nbytes + (expect.anchor_nbytes if anchored else 0) + _CHUNK_SLACK_BYTES * len(layout)
            if metadata is None:
                raise ValueError("it sent tensors before metadata")
            part = message.tensor_part
            index = len(tensors)
            if remaining == 0:
                if index == len(layout):
                    raise ValueError(f"it sent more than the {index} expected tensors")
                name, shape, dtype = layout[index]
                if part.dtype != dtype or tuple(part.size) != shape:
                    raise ValueError(f"tensor {name} arrives as {part.dtype}{list(part.size)}, "
                                     f"expected {dtype}{list(shape)}")
                remaining, parts = max(part.chunks, 1), []
            parts.append(part)
            received += len(part.buffer)
            if received > limit:
                raise ValueError("it sent more bytes than the stage's state holds")
            self._received.value = received
            remaining -= 1
            if remaining == 0:
                tensor = deserialize_torch_tensor(combine_from_streaming(parts))
                if tuple(tensor.shape) != layout[index][1] or not torch.isfinite(tensor).all():
                    raise ValueError(f"tensor {layout[index][0]} is malformed or not finite")
                tensors.append(tensor)
        if metadata is None:
            raise ValueError("it does not share its state")
        if remaining or len(tensors) != len(layout):
            raise _BrokenOff(f"its state stopped after {len(tensors)} of {len(layout)} tensors")
        expect.check_digest(tensors[: len(expect.names)])
        return metadata, tensors


def _declare(dht: Any, keypair: Keypair, key: str, record: dict[str, Any] | None, expiration: float) -> None:
    """Store a donor's sealed record (in an executor thread of the averaging process: the DHT call blocks)."""
    try:
        if not store_sealed(dht, keypair, key, record, expiration):
            logger.warning("the DHT did not store this peer's donor declaration; joiners find it at the next one")
    except Exception as exc:  # the DHT process stopping, a timeout: the next declaration tries again
        logger.warning(f"could not declare this peer a donor: {exc!r}")


def _donor(owner: object, item: object, roster: Roster) -> tuple[PeerID, float] | None:
    """The (peer, priority) a donor record read under ``owner``'s subkey names, if the owner is on ``roster``
    and the record is well formed and within its lifetime; None otherwise (never tried)."""
    if not (isinstance(owner, str) and isinstance(item, ValueWithExpiration) and within_lifetime(item.expiration_time)
            and isinstance(item.value, dict)):
        return None
    try:
        if bytes.fromhex(owner) not in roster.members:
            return None
        peer, priority = PeerID.from_base58(item.value["peer_id"]), item.value["priority"]
    except Exception:  # a malformed record a member stored: not a donor
        return None
    if not isinstance(priority, int | float) or isinstance(priority, bool) or not math.isfinite(priority):
        return None
    return peer, float(priority)
