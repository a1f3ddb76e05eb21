"""hivemind's all-reduce runner with this project's reduction and checks on both sides of each part.

In hivemind's butterfly all-reduce each peer reduces one shard of the vector and returns each of its parts to
every sender. ``RobustRunner`` changes three things:

- the reduction (``RobustReducer``): ``robust.robust_mean`` of the senders' parts, block by block
  (``audit.reduce_blocks``), instead of their mean;
- what a sender takes back: a part that is not finite, or above the bound the caller knows an honest average
  cannot exceed, fails that reducer alone (hivemind then keeps the reducer's shard at the local values and
  averages every other reducer's shard of the same tensors); so does a part whose signed statement does not
  hold (``audit``);
- signatures (``audit``): every part sent is signed by its sender, every part returned comes with the reducer's
  signed statement of the inputs it reduced, and both sides keep what an audit after the round needs;
- the codec (``values``): parts travel in the run's ``grad_values`` and only in it, and every value a statement or
  a signature names is a part as its receiver decodes it, a reducer's own input and result included.

Results travel as the averages themselves, where hivemind sends each sender its delta (average − its own part)
to add back: in floating point x + (a − x) is not always a, so peers adding deltas to different parts end a
round a few ulps apart, and Adam's normalisation turns ulps in small gradients into differences of 1e-5 within
steps. Taking the reducer's average as it is keeps same-stage replicas that average every step bit-identical,
which is what the checked results (activations by digest) and the replicas' state digests compare.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException, TensorPartReducer
from hivemind.compression import NoCompression
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import amap_in_executor
from solders.keypair import Keypair

from client.averaging.audit import (
    Entry,
    Place,
    Statement,
    forged,
    make_statement,
    part_digest,
    reduce_blocks,
    signed_entry,
    statement_refusal,
)
from client.averaging.values import GradValues, decode, round_trip, values_of


class _Parts:
    """Stands where ``TensorPartReducer`` keeps its running sum: collects (part, weight) and, where the
    reducer divides the sum by the total weight, returns the robust mean of what it collected, block by block
    (``audit.reduce_blocks``), keeping the signed inputs it reduced for the reducer's statement (``audit``)."""

    def __init__(self, reducer: RobustReducer) -> None:
        self.reducer = reducer
        self.parts: list[torch.Tensor] = []
        self.weights: list[float] = []
        self.signed: list[Entry | None] = []

    def add_(self, part: torch.Tensor, alpha: float = 1.0) -> _Parts:
        self.parts.append(part.clone())
        self.weights.append(float(alpha))
        self.signed.append(self.reducer.incoming.get(id(part)))
        return self

    def div_(self, _denominator: float) -> torch.Tensor:
        if self.signed and all(s is not None for s in self.signed):
            self.reducer.reduced[self.reducer.current_part_index] = (
                [s for s in self.signed if s is not None], self.parts)
        return reduce_blocks(self.parts, self.weights)


class RobustReducer(TensorPartReducer):
    """hivemind's reducer (its senders, bans and part order) with the robust mean in place of the mean, keeping
    for each part the signed inputs it reduced, in order, with their values (``reduced``)."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int) -> None:
        self.incoming: dict[int, Entry] = {}  # a part being accumulated (by its tensor's id): its signed entry
        self.reduced: dict[int, tuple[list[Entry], list[torch.Tensor]]] = {}
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Parts(self)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0, signed: Entry | None = None) -> torch.Tensor:
        """hivemind's, with the sender's signed entry for the part beside it."""
        if signed is not None:
            self.incoming[id(tensor_part)] = signed
        try:
            return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)
        finally:
            self.incoming.pop(id(tensor_part), None)


@dataclass
class Reductions:
    """What one all-reduce leaves for the audits after it (``audit``): this peer's statements as a reducer, each with
    the inputs it lists and its result, and the statements other reducers returned to this peer, with their results.
    Parts as values (float32), which is what the statements' digests cover."""

    senders: frozenset[PeerID]
    keys: dict[PeerID, bytes]  # every groupmate's key, by peer id
    values: GradValues  # the all-reduce's codec, in which its audits travel too (``auditor``)
    mine: dict[int, tuple[Statement, list[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    returned: dict[tuple[PeerID, int], tuple[Statement, torch.Tensor]] = field(default_factory=dict)
    forgeries: list[tuple[PeerID, Place, Statement]] = field(default_factory=list)  # statements signed
    # over inputs their senders did not sign: evidence by themselves
    oversized: set[tuple[PeerID, int]] = field(default_factory=set)  # returned parts, their statements holding,
    # that were refused for a norm no honest average of the part reaches: audited every time (``auditor``)


class _CheckedStub:
    """A reducer's stub whose answers are checked, part by part, before hivemind registers them."""

    def __init__(self, stub: Any, runner: RobustRunner, reducer: PeerID) -> None:
        self.stub, self.runner, self.reducer = stub, runner, reducer

    async def rpc_aggregate_part(self, inputs: Any) -> Any:
        stream = await self.stub.rpc_aggregate_part(inputs)
        return self.runner._checked_results(stream, self.reducer)


class RobustRunner(AllReduceRunner):
    """hivemind's all-reduce runner reducing its part with ``RobustReducer``, returning averages rather than
    deltas (module docstring), signing what it sends and checking each part another reducer returns: a part
    whose statement does not hold (``audit.statement_refusal``; a forged one is kept as evidence in ``reductions``),
    that is not finite, or that has an L2 norm above ``result_bound`` (what the caller knows an honest average of
    that part cannot exceed) fails that reducer, as if it had gone silent — hivemind then keeps the reducer's shard
    (this part and its later ones) at the local values and counts it in ``failed_size``, and every other reducer's
    shard of the same tensors is still averaged. A part equal to the local one (the filler for a failed reducer)
    is always taken. The runner yields each tensor's averaged values, not a delta to add.

    ``signer`` is this peer's key; ``keys`` every groupmate's (their admitted declarations'), by peer id."""

    reducer_class: type[RobustReducer] = RobustReducer

    def __init__(self, *, signer: Keypair, keys: Mapping[PeerID, bytes], result_bound: float = math.inf,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signer, self.keys = signer, dict(keys)
        self.tensor_part_reducer.finished.set()  # hivemind's own, never used: its finaliser would log every round
        # that it "received 0.0% of input tensors"
        self.tensor_part_reducer = self.reducer_class(tuple(part.shape for part in self.parts_for_local_averaging),
                                                      len(self.sender_peer_ids))
        container = self.tensor_part_container
        self.values = values_of(container.compression)
        self.reductions = Reductions(frozenset(self.sender_peer_ids), self.keys, self.values)
        self._sent: dict[tuple[PeerID, int], Entry] = {}  # this peer's signed input to each reducer's part
        self._answers: dict[int, tuple[Any, torch.Tensor, Statement]] = {}  # this reducer's, by part
        container.return_deltas = False  # a failed reducer's shard is filled with the local parts, not zeros
        own = self.ordered_peer_ids.index(self.peer_id)
        register = container.register_processed_part

        def register_checked(peer_index: int, part_index: int, part: torch.Tensor) -> None:
            # hivemind's container keeps each reducer's input parts until it finishes
            local = container._input_parts_by_peer[peer_index][part_index][0]
            if peer_index != own and not torch.equal(part, local):
                norm = float(torch.linalg.vector_norm(part, dtype=torch.float64))
                if not norm <= result_bound:  # also refuses NaN and infinity
                    self.reductions.oversized.add((self.ordered_peer_ids[peer_index], part_index))
                    raise AllreduceException(f"reducer {self.ordered_peer_ids[peer_index]} returned part "
                                             f"{part_index} of norm {norm:.3g}, above {result_bound:.3g}")
            register(peer_index, part_index, part)

        container.register_processed_part = register_checked  # type: ignore[method-assign]

    def place(self, reducer: PeerID, part_index: int) -> Place:
        return Place(self._prefix or "", self.group_id, reducer.to_bytes(), part_index)

    # ----- as a sender -----

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _CheckedStub(super()._get_peer_stub(peer), self, peer)

    async def _generate_input_for_peer(self, peer_index: int) -> Any:
        """hivemind's parts for one reducer, each signed (``audit``); hivemind's reducer reads no ``peer_id`` from
        a part, so the signature travels there."""
        reducer = self.ordered_peer_ids[peer_index]
        part_index = 0
        async for message in super()._generate_input_for_peer(peer_index):
            entry = signed_entry(self.signer, self.place(reducer, part_index),
                                 decode(message.tensor_part, self.values), message.weight)
            self._sent[reducer, part_index] = entry
            message.peer_id = entry.signature
            part_index += 1
            yield message

    async def _checked_results(self, stream: Any, reducer: PeerID) -> Any:
        """A reducer's answers, each taken only in the run's codec with a statement that holds (class docstring),
        handed on to hivemind as float32 (hivemind decodes no int8 of this project's: ``values``)."""
        part_index = 0
        async for message in stream:
            if message.code == averaging_pb2.AVERAGED_PART:
                try:
                    result = decode(message.tensor_part, self.values)
                except ValueError as exc:
                    raise AllreduceException(f"reducer {reducer} returned part {part_index}: {exc}") from None
                self._check_statement(reducer, part_index, message.peer_id, result)
                if self.values != GradValues.FLOAT32:
                    message.tensor_part.CopyFrom(NoCompression().compress(result, None))
                part_index += 1
            yield message

    def _check_statement(self, reducer: PeerID, part_index: int, data: bytes, result: torch.Tensor) -> None:
        place, key = self.place(reducer, part_index), self.keys.get(reducer)
        try:
            statement = Statement.from_bytes(data)
        except ValueError as exc:
            raise AllreduceException(f"reducer {reducer} returned part {part_index} with {exc}") from None
        own = self._sent.get((reducer, part_index))
        refusal = "was not a groupmate" if key is None or own is None else statement_refusal(
            statement, place, key, result, own, self.values)
        if not refusal and forged(statement, place):
            self.reductions.forgeries.append((reducer, place, statement))
            refusal = "its statement lists an input its sender did not sign"
        if refusal:
            raise AllreduceException(f"reducer {reducer} returned part {part_index}: {refusal}")
        self.reductions.returned[reducer, part_index] = (statement, result)

    # ----- as a reducer -----

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """This peer's own shard: reduced here, its own parts signed like any sender's, the average registered as
        it is (other reducers' shards: as hivemind receives them, registered by ``register_checked``)."""
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, own in enumerate(self.parts_for_local_averaging):
            tensor_part = round_trip(own, self.values)  # as any sender's part reaches its reducer
            signed = signed_entry(self.signer, self.place(peer_id, part_index), tensor_part, self.weight)
            averaged = await self.tensor_part_reducer.accumulate_part(sender_index, part_index, tensor_part,
                                                                      weight=self.weight, signed=signed)
            _, result, _ = self._answer(part_index, averaged)
            self.tensor_part_container.register_processed_part(peer_index, part_index, result)
        return None

    def _decoded(self, part: Any) -> torch.Tensor | None:
        """A sender's part as values, or None where it is not in the run's codec."""
        try:
            return decode(part, self.values)
        except ValueError:
            return None

    def _signed_input(self, sender: PeerID, part_index: int, message: Any, values: torch.Tensor) -> Entry | None:
        """A sender's part as its signed input to this reducer, or None if its signature does not hold."""
        key = self.keys.get(sender)
        entry = None if key is None else Entry(key, part_digest(values), float(message.weight), bytes(message.peer_id))
        return entry if entry is not None and entry.holds(self.place(self.peer_id, part_index)) else None

    def _answer(self, part_index: int, averaged: torch.Tensor) -> tuple[Any, torch.Tensor, Statement]:
        """This reducer's answer for part ``part_index``, the same for every sender it goes back to: the average in
        the run's codec, the values every sender decodes from it (which this reducer keeps as its own result) and
        its signed statement naming them."""
        answer = self._answers.get(part_index)
        if answer is None:
            wire = self.tensor_part_container.compression.compress(averaged, None)
            result = decode(wire, self.values)
            entries, inputs = self.tensor_part_reducer.reduced.get(part_index, ([], []))
            statement = make_statement(self.signer, self.place(self.peer_id, part_index), entries, result,
                                       self.values)
            answer = self._answers[part_index] = (wire, result, statement)
            self.reductions.mine[part_index] = (statement, inputs, result)
        return answer

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        """hivemind's reducer loop for one sender, refusing a part that is not in the run's codec or that its sender
        did not sign (the sender is banned, as for any refused part) and answering each part with the average
        itself and this reducer's statement."""
        part_index = 0
        sender = self.sender_peer_ids[sender_index]
        try:
            loop = asyncio.get_event_loop()
            async for message, tensor_part in amap_in_executor(
                    lambda msg: (msg, self._decoded(msg.tensor_part)),
                    stream, max_prefetch=self.tensor_part_container.prefetch):
                signed = None if tensor_part is None else self._signed_input(sender, part_index, message, tensor_part)
                if signed is None:
                    break  # not in the run's codec, or not signed by the sender's key: refused
                try:
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=message.weight, signed=signed)
                except BannedException:
                    break  # this sender was banned: nothing more of it is reduced
                wire, _, statement = await loop.run_in_executor(None, self._answer, part_index, averaged)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=wire,
                                                  peer_id=statement.to_bytes())
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(sender)
