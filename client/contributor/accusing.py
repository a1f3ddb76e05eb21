"""Checked data in a run: the head and tail workers accuse the trainers whose tokens they refused, and witnesses
convict the trainers the evidence proves (``client.pipeline.datacheck``, ``client.witness.data_accusations``).

- ``Accuser`` (a head or tail worker): publishes, each round, an ``DataAccusation`` holding the signed requests its
  worker refused for their tokens (``StageWorker.drain_accusations``);
- ``Convictions`` (any elected witness): checks every piece of evidence the round's accusations quote against the
  run's dataset, opened the first time there is one to check (a body worker, which trains on nothing, opens it
  then); each piece is checked once. A witness that cannot open the dataset convicts no one and says so: the
  trainer keeps whatever its other records earn it in that witness's proof.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from client.contributor.context import ClientContext
from client.contributor.errors import CannotContribute
from client.contributor.rounds import RoundKey
from client.contributor.run_model import building_the_model, model_config, run_dataset
from client.data import SampleDataset
from client.pipeline.datacheck import WrongData, proven
from client.witness.data_accusations import MAX_EVIDENCE, DataAccusation
from coordinator_program.spec import derived
from coordinator_program.spec.state import CoordinatorState, Role

log = logging.getLogger("psyswarm.client")

MAX_VERDICTS = 1 << 14
"""Pieces of evidence a witness remembers having checked (then it forgets them all and checks again)."""


class Accuser:
    """The evidence a head or tail worker publishes: every piece kept in the round, one record per round."""

    def __init__(self, context: ClientContext) -> None:
        self.context: ClientContext = context
        self.round: RoundKey | None = None
        self.pieces: list[WrongData] = []
        self.published = 0

    async def publish(self, round_: RoundKey, found: list[WrongData]) -> None:
        """Add ``found`` to ``round_``'s evidence (at most ``MAX_EVIDENCE`` pieces) and publish it if it grew."""
        if round_ != self.round:
            self.round, self.pieces, self.published = round_, [], 0
        self.pieces = (self.pieces + found)[:MAX_EVIDENCE]
        board = self.context.board
        if board is None or len(self.pieces) == self.published:
            return
        record = DataAccusation.create(self.context.keypair, run_id=board.run_id, epoch=round_.epoch,
                                       round=round_.height,
                                       evidence=tuple({"request": p.request, "signature": p.signature}
                                                      for p in self.pieces))
        if await asyncio.to_thread(board.publish, record, self.context.keypair):
            self.published = len(self.pieces)
            log.warning("round %s: accused %d trainer(s) of sending tokens that are not the run's dataset", round_,
                        len(self.pieces))


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
