"""Accusations a run's workers publish, and what witnesses make of them.

Checked data (``client.pipeline.datacheck``, ``client.witness.data_accusations``): the head and tail workers accuse
the trainers whose tokens they refused, and witnesses convict the trainers the evidence proves.
False declarations (``client.averaging.membership.falsehood``): a worker whose averager refused a groupmate's sealed
declaration as a lie no honest worker tells (a weight above what a worker can have, evidence of work forged or
copied) accuses that groupmate with the declaration itself, and witnesses convict the workers it proves.
False reductions (``client.averaging.audit``): a worker whose averager found a groupmate's signed statement of a
reduction false (forged inputs, or a result that is not the robust mean of its inputs) accuses it with the
statement, the inputs and the result, and witnesses convict the workers it proves the same way.

- ``Accuser`` (a worker): publishes, each round, one record holding the round's evidence of one kind: a
  ``DataAccusation`` with the signed requests its worker refused for their tokens (``StageWorker.drain_accusations``),
  or an ``Accusation`` with the declarations its averagers refused as lies (``StageReplica.drain_lies``);
- ``Convictions`` (any elected witness): checks every piece of evidence the round's data accusations quote against
  the run's dataset, opened the first time there is one to check (a body worker, which trains on nothing, opens it
  then); each piece is checked once. A witness that cannot open the dataset convicts no one and says so: the
  trainer keeps whatever its other records earn it in that witness's proof.
- ``false_declarers`` (any elected witness): the workers of the epoch that a round's accusations prove sealed a
  false declaration or signed a false reduction in their own stage's averaging; each is checked with the run's
  settings alone (``declaration_lie``, ``reduction_lie``), so an accusation against an honest worker proves nothing,
  whoever files it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from solders.keypair import Keypair

from client.averaging.audit import proven_liar
from client.averaging.gossip import PAIR_WEIGHT
from client.averaging.membership import falsehood
from client.averaging.sparta import averager_prefix
from client.averaging.work import WorkRule
from client.contributor.context import ClientContext
from client.contributor.errors import CannotContribute
from client.contributor.rounds import RoundKey
from client.contributor.run_model import building_the_model, model_config, run_dataset
from client.data import SampleDataset
from client.identity import is_hex
from client.join.stage_replica import REPLICA_WEIGHT
from client.pipeline.datacheck import WrongData, proven
from client.stages import stage_names
from client.witness.data_accusations import MAX_EVIDENCE, DataAccusation
from client.witness.judge import admitted_accusations
from client.witness.records import MAX_ACCUSATIONS, MAX_RECORD_BYTES, Accusation, SignedRecord, record_bytes
from coordinator_program.spec import derived
from coordinator_program.spec.state import CoordinatorState, Role

log = logging.getLogger("psyswarm.client")

FALSE_DECLARATION = ("signed an averaging declaration or reduction no honest worker makes (its own signature proves "
                     "it): not present, not credited")
MAX_VERDICTS = 1 << 14
"""Pieces of evidence a witness remembers having checked (then it forgets them all and checks again)."""


class Accuser:
    """A worker's evidence of one kind: every piece kept in the round (one per ``identity``, at most ``most``), in one
    record per round, published again whenever it grew."""

    def __init__(self, context: ClientContext, record: Callable[[Keypair, str, RoundKey, list[Any]], SignedRecord],
                 accused: str, identity: Callable[[Any], Hashable] = lambda piece: piece,
                 most: int = MAX_EVIDENCE) -> None:
        """``record`` makes the round's record from the keypair, the run id, the round and the pieces; ``accused``
        says, for the log, whom they accuse of what."""
        self.context: ClientContext = context
        self.record, self.accused, self.identity, self.most = record, accused, identity, most
        self.round: RoundKey | None = None
        self.pieces: dict[Hashable, Any] = {}
        self.published = 0

    async def publish(self, round_: RoundKey, found: list[Any]) -> None:
        """Add ``found`` to ``round_``'s evidence and publish it if it grew."""
        if round_ != self.round:
            self.round, self.pieces, self.published = round_, {}, 0
        for piece in found:
            if len(self.pieces) < self.most:
                self.pieces.setdefault(self.identity(piece), piece)
        board = self.context.board
        if board is None or len(self.pieces) == self.published:
            return
        pieces = list(self.pieces.values())
        record = self.record(self.context.keypair, board.run_id, round_, pieces)
        while record_bytes(record) > MAX_RECORD_BYTES and len(pieces) > 1:  # the first pieces, as many as a record
            pieces.pop()  # can carry
            record = self.record(self.context.keypair, board.run_id, round_, pieces)
        if record_bytes(record) > MAX_RECORD_BYTES:
            log.warning("round %s: evidence too large for a record, not published", round_)
            self.published = len(self.pieces)
        elif await asyncio.to_thread(board.publish, record, self.context.keypair):
            log.warning("round %s: accused %d %s", round_, len(pieces), self.accused)
            self.published = len(self.pieces)


def wrong_data_accuser(context: ClientContext) -> Accuser:
    """A head or tail worker's accuser of the trainers whose tokens it refused (``StageWorker.drain_accusations``)."""
    return Accuser(context, lambda keypair, run_id, round_, pieces: DataAccusation.create(
        keypair, run_id=run_id, epoch=round_.epoch, round=round_.height,
        evidence=tuple({"request": p.request, "signature": p.signature} for p in pieces)),
        "trainer(s) of sending tokens that are not the run's dataset")


def false_declaration_accuser(context: ClientContext) -> Accuser:
    """A worker's accuser of the groupmates whose declarations or reductions its averagers found to be lies
    (``StageReplica.drain_lies``): one piece per liar and round."""
    return Accuser(context, lambda keypair, run_id, round_, pieces: Accusation.create(
        keypair, run_id=run_id, epoch=round_.epoch, round=round_.height, accusations=tuple(pieces)),
        "groupmate(s) of signing an averaging declaration or reduction no honest worker makes",
        identity=_liar, most=MAX_ACCUSATIONS)


def _liar(piece: dict[str, Any]) -> str:
    """Whom a piece of an averager's evidence accuses (hex key): a declaration's member or a reduction's reducer."""
    return str(piece["reduction"]["key"] if "reduction" in piece else piece["declaration"].get("member"))


def _averaging_limits(state: CoordinatorState, member: bytes, prefix: object
                      ) -> tuple[float, WorkRule | None] | None:
    """The limits of the averaging ``prefix`` names if it is one of ``member``'s own stage this run (a worker's), as
    (most weight, work rule); None otherwise."""
    names = stage_names(state.config.num_stages)
    stage = next((names[c.stage] for c in state.clients if c.id == member and c.role == Role.Worker), None)
    if stage is None:
        return None
    batch, namespace = state.config.global_batch_size, derived.run_instance(state)  # the workers' run id
    if prefix == averager_prefix(namespace, stage, "grad"):
        return float(batch), WorkRule(namespace, stage, batch)
    if prefix == averager_prefix(namespace, stage, "sparta"):
        return REPLICA_WEIGHT, None
    if prefix == averager_prefix(namespace, stage, "gossip"):
        return PAIR_WEIGHT, None
    return None


def declaration_lie(item: object, state: CoordinatorState) -> bytes | None:
    """The worker that ``item`` (``{"prefix", "peer", "declaration"}``, as ``StageAverager.drain_lies`` keeps it)
    proves sealed a false declaration in its own stage's averaging this epoch, under this run's settings; None
    where it proves nothing."""
    if not (isinstance(item, dict) and set(item) == {"prefix", "peer", "declaration"}
            and isinstance(item["declaration"], dict) and isinstance(item["peer"], str) and len(item["peer"]) <= 256):
        return None
    declaration, prefix = item["declaration"], item["prefix"]
    try:
        peer = bytes.fromhex(item["peer"])  # a libp2p peer id: a multihash, of no fixed length
    except ValueError:
        return None
    if declaration.get("epoch") != state.epoch or not is_hex(declaration.get("member"), 32):
        return None
    member = bytes.fromhex(declaration["member"])
    limits = _averaging_limits(state, member, prefix)
    if limits is None:
        return None
    lie = falsehood(declaration, prefix, peer, *limits)
    return lie[0] if lie is not None and lie[0] == member else None


def reduction_lie(item: object, state: CoordinatorState) -> bytes | None:
    """The worker that ``item`` (``audit.evidence``) proves signed a false reduction in its own stage's averaging
    (``audit.proven_liar``); None where it proves nothing."""
    proven = proven_liar(item)
    if proven is None or _averaging_limits(state, proven[0], proven[1]) is None:
        return None
    return proven[0]


def false_declarers(state: CoordinatorState, accusations: Mapping[str, Accusation],
                    verdicts: dict[tuple[int, str, int], bytes | None] | None = None) -> set[bytes]:
    """The workers that an admitted accusation of this round proves sealed a false declaration (``declaration_lie``)
    or signed a false reduction (``reduction_lie``; other items, such as a trainer's wrong answers, are the judge's).
    ``verdicts``: a witness's memory of the items it checked, by epoch, record signature and place (the signature
    covers the item), so that each costs its check once however often it polls (cleared past ``MAX_VERDICTS``)."""
    verdicts = {} if verdicts is None else verdicts
    if len(verdicts) > MAX_VERDICTS:
        verdicts.clear()
    found: set[bytes] = set()
    for record in admitted_accusations(state, accusations):
        for place, item in enumerate(record.accusations):  # type: ignore[attr-defined]
            key = (state.epoch, record.signature, place)
            if key not in verdicts:
                verdicts[key] = declaration_lie(item, state) or reduction_lie(item, state)
            if verdicts[key] is not None:
                found.add(verdicts[key])  # type: ignore[arg-type]
    return found


class Convictions:
    """What a witness makes of a round's accusations: the trainers of the epoch they prove sent other data."""

    def __init__(self, context: ClientContext) -> None:
        self.context: ClientContext = context
        self.dataset: SampleDataset | None = None
        self.vocab = 0
        self.unopenable: str | None = None  # why the dataset could not be opened here, once tried
        self.verdicts: dict[tuple[str, str], bytes | None] = {}  # each piece checked once

    async def convicted(self, state: CoordinatorState, accusations: Mapping[str, DataAccusation]) -> set[bytes]:
        """The epoch's trainers that some piece of ``accusations`` proves sent tokens other than the dataset's."""
        trainers = {c.id for c in state.clients if c.role == Role.Trainer}
        pieces = {p for record in accusations.values() for p in record.pieces()}
        if not pieces or not await asyncio.to_thread(self._open, state):
            return set()
        if len(self.verdicts) > MAX_VERDICTS:
            self.verdicts.clear()
        found: set[bytes] = set()
        for piece in pieces:
            if piece not in self.verdicts:
                assert self.dataset is not None
                self.verdicts[piece] = await asyncio.to_thread(proven, WrongData(*piece), self.dataset, self.vocab,
                                                               derived.run_instance(state))
            if self.verdicts[piece] in trainers:
                found.add(self.verdicts[piece])  # type: ignore[arg-type]
        return found

    def _open(self, state: CoordinatorState) -> bool:
        """Open the run's dataset once; False (logged once) if this machine cannot."""
        if self.dataset is None and self.unopenable is None:
            options = self.context.options
            try:
                with building_the_model():
                    config = model_config(state, hf_endpoint=options.hf_endpoint, hf_token=options.hf_token)
                self.dataset, self.vocab = run_dataset(state, config, options), config.vocab
            except CannotContribute as exc:
                self.unopenable = str(exc)
                log.warning("accusations cannot be checked here, so they convict no one: %s", exc)
        return self.dataset is not None
