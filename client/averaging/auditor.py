"""The averaging process's side of the audits (``client.averaging.audit``): it keeps what its own reductions signed,
serves their inputs to the groupmates that audit them, and audits its groupmates' reductions after each round.

A mixin of ``StageAverager`` (it runs in hivemind's averaging process, beside the all-reduces it audits): the
averager hands it each all-reduce's ``Reductions`` as the runner starts (``_remember``) and asks for the audits once
the round has returned its result (``_audit_later``), so no audit holds a round up. Whatever it proves is kept for
the host with the averager's other evidence (``_keep``).
"""

from __future__ import annotations

import asyncio
import collections
import math
import secrets
import typing
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from client.averaging.audit import Place, evidence, false_block
from client.averaging.runner import Reductions
from client.averaging.values import GradValues, codec, decode

logger = get_logger(__name__)

MAX_PART_BYTES = 1 << 20
"""The largest input an audit reads (parts here are ``stage_averager.PART_BYTES``, 64 KiB)."""

AUDIT_RATE = 0.25
"""The chance that this peer audits a given other reducer after a round (``audit``), unless the run sets another
(``Model.audit_permille``, which defaults to this): each audit costs one part's inputs, k parts
(``stage_averager.PART_BYTES``) in a group of k, against the whole vector's two ways each round."""
KEPT_REDUCTIONS = 32
"""All-reduces whose inputs a reducer keeps for its groupmates' audits (a round runs one to three)."""


class Auditor:
    """Audits for a ``StageAverager`` (module docstring); what it uses of the averager besides the attributes
    declared here: hivemind's ``get_stub`` and the averager's ``_keep``."""

    audit_rate: float  # how often this peer audits each other reducer of a round (a run's ``audit_rate``)

    prefix: str
    _p2p: Any
    next_chunk_timeout: float | None
    request_timeout: float

    def _start_audits(self) -> None:
        """Called by the averager's ``__init__`` (hivemind's ``__init__`` takes the cooperative chain's arguments)."""
        self._reductions: collections.OrderedDict[bytes, Reductions] = collections.OrderedDict()
        self._audits: set[asyncio.Task] = set()

    def _remember(self, group_id: bytes, reductions: Reductions) -> None:
        """Keep an all-reduce's reductions for the audits (the last ``KEPT_REDUCTIONS``)."""
        self._reductions[group_id] = reductions
        while len(self._reductions) > KEPT_REDUCTIONS:
            self._reductions.popitem(last=False)

    def _audit_later(self, ids: Sequence[bytes]) -> None:
        """Audit the all-reduces ``ids`` in the background: the round's result is not held up for it."""
        task = asyncio.create_task(self._audit(ids))
        self._audits.add(task)
        task.add_done_callback(self._audits.discard)

    async def _audit(self, ids: Sequence[bytes]) -> None:
        """Audit, each with probability ``audit_rate``, the other reducers of the all-reduces ``ids`` on one part
        each, chosen at random (``audit``), and every reducer that returned a part too large to be an honest
        average on that part: refusing it kept the part out of this round, and the audit turns the reducer's own
        statement into evidence, so a false reducer gains no escape by lying far enough to be refused. Keep every
        forgery and every false result found as evidence."""
        draw = secrets.SystemRandom()  # private: a reducer must not foresee which of its statements are audited
        for group_id in ids:
            reductions = self._reductions.get(group_id)
            if reductions is None:
                continue
            for reducer, place, statement in reductions.forgeries:
                self._keep(evidence(place, reductions.keys[reducer], statement))
            parts: dict[PeerID, list[int]] = {}
            for reducer, part in reductions.returned:
                parts.setdefault(reducer, []).append(part)
            for reducer, indices in parts.items():
                oversized = [part for part in indices if (reducer, part) in reductions.oversized]
                if oversized or draw.random() < self.audit_rate:
                    chosen = oversized[0] if oversized else draw.choice(indices)
                    await self._audit_part(group_id, reducer, chosen, reductions)

    async def _audit_part(self, group_id: bytes, reducer: PeerID, part: int, reductions: Reductions) -> None:
        """Ask ``reducer`` for the inputs of its part ``part`` and recompute it; a false result is kept as
        evidence. A reducer that does not answer, or answers with other inputs than it signed, proves nothing."""
        statement, result = reductions.returned[reducer, part]
        try:
            timeout = self.next_chunk_timeout or self.request_timeout
            inputs = await asyncio.wait_for(
                self._inputs(group_id, reducer, part, len(statement.entries), reductions.values),
                timeout * (len(statement.entries) + 1))
            block = await asyncio.get_running_loop().run_in_executor(None, false_block, statement, inputs, result)
        except Exception as exc:  # noqa: BLE001 - a groupmate's answer: any failure proves nothing against it
            logger.info(f"audit of {reducer}'s part {part}: no conclusion ({type(exc).__name__}: {exc})")
            return
        if block is not None:
            logger.warning(f"audit of {reducer}'s part {part}: block {block} is not the robust mean of its inputs; "
                           "kept as evidence")
            place = Place(self.prefix, group_id, reducer.to_bytes(), part)
            self._keep(evidence(place, reductions.keys[reducer], statement, inputs, result, block))

    async def _inputs(self, group_id: bytes, reducer: PeerID, part: int, count: int,
                      values: GradValues) -> list[torch.Tensor]:
        """The first ``count`` inputs ``reducer`` serves for its part ``part``, in the all-reduce's codec ``values``
        (``rpc_audit_part``), none larger than a part."""
        stub = self.get_stub(self._p2p, reducer, namespace=self.prefix)
        stream = await stub.rpc_audit_part(averaging_pb2.AveragingData(group_id=group_id, weight=float(part)))
        inputs: list[torch.Tensor] = []
        async for message in stream:
            if message.tensor_part.ByteSize() > MAX_PART_BYTES:
                raise ValueError("an input larger than any part")
            inputs.append(decode(message.tensor_part, values))
            if len(inputs) == count:
                break  # all it listed: more would be no input of its statement
        return inputs

    async def rpc_audit_part(self, request: averaging_pb2.AveragingData,
                             context: P2PContext) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        """The inputs this reducer listed in its statement of one part (group id and part index in the request:
        the index travels as its ``weight``), in order, for a sender of that all-reduce to audit. They travel in the
        all-reduce's codec, as they came: each input is a part as decoded from it, which the codec encodes back to
        the very same values (an input that did not would fail its digest at the auditor, and prove nothing), so an
        audit of an int8 round costs a quarter of float32's bytes."""
        reductions = self._reductions.get(request.group_id)
        part = int(request.weight) if math.isfinite(request.weight) else -1
        if reductions is None or context.remote_id not in reductions.senders or part not in reductions.mine:
            return
        for values in reductions.mine[part][1]:
            yield averaging_pb2.AveragingData(tensor_part=codec(reductions.values).compress(values, None))
