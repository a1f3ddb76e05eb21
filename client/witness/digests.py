"""Replicas agree on their state: each worker's signed digest of its stage after a step, and the stage's majority.

After each optimizer step an active worker publishes a ``StateDigest`` (``client.pipeline.digests``: sha256 over its
stage's ``state_dict``) under its own subkey of the run's DHT, signed with its key over the run's instance, the
epoch, the step and the stage (the record's kind is its domain tag: no other signed message reads as one).

The rule (``majority``): of the digests the stage's roster (the workers the coordinator lists for the stage)
published for a step, the one held by a strict majority of those that published, and by at least two, is the
stage's digest for that step. Only the roster counts: a stranger's record, or a worker's of another stage, is
never read, however many there are, so nobody outside the stage can make an honest worker look like the
minority; a roster member has one vote (one subkey). A stage whose replicas are not bit-identical (SPARTA alone,
``grad_averaging = off``) usually has no majority, and then nothing is enforced (see ``Verdict``).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

from solders.keypair import Keypair

from client.witness.records import Board, StateDigest

MIN_MAJORITY = 2
"""The fewest workers whose equal digests make a stage's digest: a lone worker's word vouches for nothing."""


def majority(digests: Mapping[str, str]) -> str | None:
    """The digest that a strict majority of ``digests`` (author → digest) holds, if at least ``MIN_MAJORITY`` hold
    it; None otherwise (a tie, a stage of one, or replicas that are not identical)."""
    counts = Counter(digests.values())
    if not counts:
        return None
    digest, count = counts.most_common(1)[0]
    return digest if count >= MIN_MAJORITY and 2 * count > len(digests) else None


class Verdict(enum.Enum):
    """A worker's digest against its stage's majority for the same step."""

    AGREES = "agrees"
    DEPARTS = "departs"
    UNKNOWN = "unknown"  # no majority (too few published, a tie, replicas that are not identical)


def verdict(own: str, stage_digest: str | None) -> Verdict:
    if stage_digest is None:
        return Verdict.UNKNOWN
    return Verdict.AGREES if own == stage_digest else Verdict.DEPARTS


class StageDigests:
    """One stage's digests on a run's board: publishing this worker's, and reading the roster's.

    ``roster`` gives the stage's workers (hex keys) as the coordinator lists them now; only their records count.
    A digest is read in the epoch given and the one before (a step's digest is filed in the epoch whose last round
    completed it, and a joiner asks in the next).
    """

    def __init__(self, board: Board, stage: int, roster: Callable[[], Collection[str]]) -> None:
        self.board, self.stage, self.roster = board, stage, roster

    def publish(self, keypair: Keypair, epoch: int, step: int, digest: str) -> bool:
        """Sign and store this worker's digest of its stage after ``step`` steps; whether the DHT took it."""
        record = StateDigest.create(keypair, run_id=self.board.run_id, epoch=epoch, instance=self.board.instance,
                                    step=step, stage=self.stage, digest=digest)
        return self.board.publish(record, keypair)

    def published(self, epoch: int, step: int) -> dict[str, str]:
        """The digests (author → digest) the stage's roster published for ``step``: records of other stages, of
        another instance of the run, or by anyone off the roster are left out."""
        members = set(self.roster())
        found: dict[str, str] = {}
        for e in (epoch, epoch - 1) if epoch > 0 else (epoch,):
            for author, record in self.board.fetch(StateDigest, e, step, members).items():
                assert isinstance(record, StateDigest)
                if record.stage == self.stage and record.instance == self.board.instance:
                    found.setdefault(author, record.digest)
        return found

    def majority(self, epoch: int, step: int) -> str | None:
        """The stage's digest for ``step`` (``majority`` of the roster's), None if it has none."""
        return majority(self.published(epoch, step))

    def vouched(self, epoch: int, steps: Iterable[int]) -> dict[int, str]:
        """The stage's digest of each of ``steps`` that has one: the states a joiner may load."""
        found = {step: self.majority(epoch, step) for step in steps}
        return {step: digest for step, digest in found.items() if digest is not None}

    def settle(self, epoch: int, step: int, own: str, *, timeout: float,
               poll: float = 0.25) -> tuple[Verdict, str | None]:
        """``own`` digest of ``step`` against the stage's, once every roster member published or ``timeout``
        seconds passed: the verdict and the stage's digest."""
        deadline = time.monotonic() + timeout
        while True:
            published = self.published(epoch, step)
            if len(published) >= len(self.roster()) or time.monotonic() >= deadline:
                stage_digest = majority(published)
                return verdict(own, stage_digest), stage_digest
            time.sleep(poll)
