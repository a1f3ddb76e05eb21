"""A worker's state against its stage's majority after each step: publish its digest, compare, and act on a departure.

Same-stage replicas that average gradients every step (``grad_averaging = full | powersgd | demo``) hold bit-identical
parameters on CPU, so each step's digests (``client.witness.digests``) must agree. One departs when a round a loaded
machine cut short left its shard local, or when the worker lies. What follows a departure:

- it stops serving its state to joiners at once (``StageReplica.agree``), and serves again once it agrees;
- it resynchronises: it downloads a state the stage's majority vouched for, from a donor that serves one (the join
  path's state download, which refuses any other), parameters and optimizer moments both (``replica_tensors``:
  a cut-short round leaves the worker's own gradient in its Adam moments too, and parameters alone would depart
  again at the next step), and goes on from it, bit-identical to the stage and taking the stage's steps;
- if it departs again before agreeing once more, it withdraws from the run: after a resynchronisation an honest
  replica agrees unless another round is cut short for it at once, a liar does not. Where this worker knows the
  round before the check was cut short for it (``doubt``), it resynchronises again instead, up to ``MAX_RESYNCS``
  times in a row: on a loaded machine two rounds in a row can miss a part, and an honest worker withdrawn so leaves
  a run that needs it (a liar's departures come whether or not its rounds complete, and it still withdraws, or
  is removed, once the cap is reached). It withdraws too if no donor
  serves a vouched state, having agreed before; a joiner that never agreed then only stops donating, since
  withdrawing every honest joiner of a stage without a vouched donor would empty it. Withdrawing is clean: it
  leaves through the coordinator and may join again, afresh.

A worker that knows its gradient round was cut short serves no batch from its step until that step's check
(``doubt``): its answers may then honestly differ from its stage's, and a checked one would accuse it of lying.

Where replicas are not identical (``grad_averaging = off``: SPARTA alone) digests are still published, and a stage
rarely has a majority; nothing is enforced (no resync, no withdrawal) and a departure only stops donating, so an
honest run of that kind is not disrupted. A joiner there loads a peer's state as before, as stale (sync phases).
Only active workers publish or are checked: a syncing worker's state is not the stage's.
"""

from __future__ import annotations

import enum
import logging

from solders.keypair import Keypair

from client.join.stage_replica import StageReplica
from client.join.state_download import StateDownloadError
from client.witness.digests import StageDigests, Verdict

log = logging.getLogger("psyswarm.agreement")

MAX_RESYNCS = 3  # resynchronisations in a row, each after a round cut short for this worker, before it withdraws


class Outcome(enum.Enum):
    """What a step's check did."""

    SKIPPED = "skipped"  # a syncing worker: it neither publishes nor is checked
    UNKNOWN = "unknown"  # the stage has no majority for the step
    AGREED = "agreed"
    DEPARTED = "departed"  # not enforced, or a joiner with no vouched donor: it only stops donating
    RESYNCED = "resynced"
    WITHDRAW = "withdraw"  # the caller withdraws the worker from the run


class Agreement:
    """One worker's digests against its stage's: ``check`` after each optimizer step."""

    def __init__(self, replica: StageReplica, digests: StageDigests, keypair: Keypair, *, enforced: bool,
                 wait: float) -> None:
        """``enforced``: the run's replicas are bit-identical (gradients averaged every step); ``wait``: the
        seconds a check waits for the stage's other workers to publish theirs."""
        self.replica, self.digests, self.keypair = replica, digests, keypair
        self.enforced, self.wait = enforced, wait
        self.agreed = False  # whether its digest ever agreed with the stage's
        self.resynced = 0  # resynchronisations since it last agreed
        self.cut_short: set[int] = set()  # the steps after which its gradient round did not bring every part back

    def doubt(self, step: int) -> None:
        """After the optimizer step of round ``step``: if its gradient round did not bring every part back, this
        worker's state may honestly differ from its stage's, and a checked answer of it would accuse it of lying.
        It serves no batch (``StageWorker.unsure``) until the step's ``check``, which ends the doubt whatever it
        finds (a state its stage has no majority for is not known to differ)."""
        gradients = self.replica.gradients
        result = gradients.last if gradients is not None else None
        if result is not None and not result.shared:
            self.replica.worker.unsure = (f"its gradient round of step {step} did not complete "
                                          f"({result.reason or 'no group'})")
            self.cut_short.add(step + 1)

    def check(self, epoch: int, step: int) -> Outcome:
        """Publish this worker's digest of its state after ``step`` swarm steps, compare it with the stage's
        majority and act on the verdict (blocking: run it in a thread)."""
        try:
            return self._check(epoch, step)
        finally:
            self.replica.worker.unsure = None

    def _check(self, epoch: int, step: int) -> Outcome:
        replica = self.replica
        cut_short = step in self.cut_short
        self.cut_short = {later for later in self.cut_short if later > step}
        if not replica.tracker.shares_state:
            return Outcome.SKIPPED
        own = replica.digest()
        if not self.digests.publish(self.keypair, epoch, step, own):
            log.warning("stage %s: the DHT did not store this worker's digest of step %d", replica.stage, step)
        found, stage_digest = self.digests.settle(epoch, step, own, timeout=self.wait)
        if found == Verdict.UNKNOWN:
            replica.agree(True)
            return Outcome.UNKNOWN
        if found == Verdict.AGREES:
            if not self.agreed:
                log.info("stage %s: its state agrees with its stage's majority at step %d", replica.stage, step)
            replica.agree(True)
            self.agreed, self.resynced = True, 0
            return Outcome.AGREED
        assert stage_digest is not None
        replica.agree(False)
        if not self.enforced:
            log.info("stage %s: its state departs from the stage's at step %d; it serves no joiner", replica.stage,
                     step)
            return Outcome.DEPARTED
        if self.resynced and not (cut_short and self.resynced < MAX_RESYNCS):
            log.error("stage %s: its state departs from the stage's again at step %d, after resynchronising",
                      replica.stage, step)
            return Outcome.WITHDRAW
        vouched = {**self.digests.vouched(epoch, (step + 1,)), step: stage_digest}
        try:
            loaded = replica.resync(vouched)
        except StateDownloadError as exc:
            log.error("stage %s: its state departs from the stage's at step %d and it cannot resynchronise: %s",
                      replica.stage, step, exc)
            return Outcome.WITHDRAW if self.agreed else Outcome.DEPARTED
        log.warning("stage %s: its state departed from the stage's at step %d; resynchronised to step %d",
                    replica.stage, step, loaded)
        self.resynced += 1
        replica.agree(True)
        return Outcome.RESYNCED
