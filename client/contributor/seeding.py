"""This client's shares of the run's seeds (``coordinator_program.spec.beacon``): as an elected witness, a fresh secret
committed as the round opens, revealed as soon as the commitments have closed (a quorum of the witnesses committed, or
training ended); as a joiner, a fresh secret committed in its join and revealed as soon as its warmup opens.

The reveal is not optional: a witness that committed and did not reveal by the round's end leaves the epoch, so the
secret is revealed the moment the state allows it (the runner calls ``on_state`` on every state) and sent again at
the next poll if it did not get through. The secret lives in memory only: a witness that restarts between its commitment
and its reveal cannot reveal and leaves at the round's end, as a witness that died would, and joins again; a joiner
that restarts before its warmup leaves when the warmup ends, and joins again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from client.backends.base import BackendError
from client.contributor.context import ClientContext
from client.contributor.rounds import RoundKey
from coordinator_program.spec import derived, reveals
from coordinator_program.spec.beacon import NO_COMMITMENT, SECRET_BYTES, join_commitment, seed_commitment
from coordinator_program.spec.errors import AlreadyCommitted, AlreadyRevealed, CoordinatorError, NoCommitment
from coordinator_program.spec.state import CoordinatorState, Phase

log = logging.getLogger("psyswarm.client")


class Seeding:
    """What this client does, when elected, for the next round's seed."""

    def __init__(self, context: ClientContext) -> None:
        self.context: ClientContext = context
        self.secrets: dict[tuple[RoundKey, int], bytes] = {}  # (round, its seed) -> the secret committed to
        self.lock = asyncio.Lock()  # one commitment or reveal at a time: the state polled and pushed both call in
        self.sent: set[tuple[tuple[RoundKey, int], str]] = set()  # what the coordinator took, by round
        self.join_secret: bytes | None = None  # the secret of this client's join, until the coordinator takes it
        self.join_revealed: bytes | None = None  # the commitment whose reveal was sent
        self.join_lost: bytes | None = None  # the commitment this client could not open, once warned of

    def join_commitment(self) -> bytes:
        """What this client's join commits to: a fresh secret, kept for the retries of one join until it is revealed
        (a join the coordinator took though its reply was lost must be opened with the secret it carried)."""
        if self.join_secret is None or join_commitment(self.context.me, self.join_secret) == self.join_revealed:
            self.join_secret = secrets.token_bytes(SECRET_BYTES)  # a revealed secret is never committed to again
        return join_commitment(self.context.me, self.join_secret)

    async def act_current(self) -> None:
        """Commit or reveal for the current round if due (polled in the background)."""
        await self.act(self.context.state)

    async def on_state(self, state: CoordinatorState) -> None:
        """``act`` on a state just received; what fails here is tried again by the background poll."""
        with contextlib.suppress(BackendError, CoordinatorError, OSError):
            await self.act(state)

    async def act(self, state: CoordinatorState) -> None:
        """In a warmup that waits for its joiners, reveal this client's join secret; in RoundTrain, commit to a fresh
        secret, and once the commitments have closed, before the round does, reveal it."""
        if derived.revealing(state):
            async with self.lock:
                await self.reveal_join(state)
            return
        if state.phase not in (Phase.RoundTrain, Phase.RoundWitness) or derived.closing(state):
            return
        elected = derived.witnesses(state)
        if self.context.me not in elected:
            return
        bit = 1 << elected.index(self.context.me)
        round_key = (RoundKey.of(state), state.round.seed)
        async with self.lock:  # a state seen before the other caller's reply may still ask for what it sent
            if state.phase == Phase.RoundTrain and not state.round.committed & bit:
                if (round_key, "commit") not in self.sent and not reveals.commitments_closed(state):
                    await self.commit(state, round_key)
            elif state.round.committed & ~state.round.revealed & bit and reveals.commitments_closed(state):
                if (round_key, "reveal") not in self.sent:
                    await self.reveal(state, round_key)

    async def commit(self, state: CoordinatorState, round_key: tuple[RoundKey, int]) -> None:
        if round_key not in self.secrets:  # a commitment resent after a lost reply keeps its secret
            self.secrets = {k: v for k, v in self.secrets.items() if k[0].epoch >= round_key[0].epoch - 1}
            self.secrets[round_key] = secrets.token_bytes(SECRET_BYTES)
        commitment = seed_commitment(self.context.me, state.round.seed, self.secrets[round_key])
        try:
            await self.context.backend.commit_seed(state.round.height, commitment)
        except AlreadyCommitted:
            pass
        except CoordinatorError as exc:  # a quorum or the end of training came first: no secret of this witness
            log.debug("commitment to the next seed for %s refused: %s", round_key[0], exc.detail)
        self.sent.add((round_key, "commit"))

    async def reveal(self, state: CoordinatorState, round_key: tuple[RoundKey, int]) -> None:
        secret = self.secrets.get(round_key)
        if secret is None:
            log.warning("round %s: this witness committed to the next seed before it restarted and cannot reveal: "
                        "it leaves the epoch at the round's end and joins again", round_key[0])
            return
        try:
            await self.context.backend.reveal_seed(state.round.height, secret)
        except AlreadyRevealed:
            pass
        else:
            log.info("round %s: secret for the next seed revealed", round_key[0])
        self.sent.add((round_key, "reveal"))
        self.sent = {entry for entry in self.sent if entry[0][0].epoch >= round_key[0].epoch - 1}

    async def reveal_join(self, state: CoordinatorState) -> None:
        """Open the commitment this client joined with, if the warmup still holds it unopened. A state from before
        the reveal was taken may still show it: it is sent once for each commitment."""
        index = state.client_index(self.context.me)
        if index is None:
            return
        commitment = state.clients[index].commitment
        if commitment in (NO_COMMITMENT, self.join_revealed):
            return
        secret = self.join_secret
        if secret is None or join_commitment(self.context.me, secret) != commitment:
            if commitment != self.join_lost:
                self.join_lost = commitment
                log.warning("this client joined before it restarted and cannot open its join's commitment: it leaves "
                            "when the warmup ends and joins again")
            return
        try:
            await self.context.backend.reveal_seed(state.round.height, secret)
        except NoCommitment:
            pass  # taken, the reply lost
        else:
            log.info("epoch %d: join secret revealed for the warmup's seed", state.epoch)
        self.join_revealed = commitment
