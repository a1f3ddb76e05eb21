"""The beacon's operations (``beacon``): the witnesses' commitments to the next round's seed and their reveals, and
the joiners' reveals that seed an epoch's warmup.

Both kinds of reveal go through one instruction, ``reveal_seed``: in RoundTrain and RoundWitness it opens an elected
witness's commitment to the next seed, in the warmup a joiner's commitment from its join. Each closes the same way:
whoever committed and did not reveal in time leaves the epoch, so a secret kept back to steer a seed costs its holder
its place.
"""

from __future__ import annotations

from coordinator_program.spec.beacon import NO_COMMITMENT, join_commitment, mix_reveal, seed_commitment, withholders
from coordinator_program.spec.derived import closing, elected, quorum, revealing
from coordinator_program.spec.errors import (
    AlreadyCommitted,
    AlreadyRevealed,
    BadReveal,
    NoCommitment,
    StaleRound,
    WrongPhase,
)
from coordinator_program.spec.selection import NO_REVEALS, next_seed
from coordinator_program.spec.signers import elected_position, healthy_client
from coordinator_program.spec.state import CoordinatorState, Health, Phase


def commit_seed(state: CoordinatorState, signer: bytes, round_height: int, commitment: bytes) -> None:
    """An elected witness of the training round commits to its share of the next round's seed. Taken only in
    RoundTrain, so every commitment is in before the first secret can be shown."""
    if state.phase != Phase.RoundTrain:
        raise WrongPhase(f"commitments to the next seed are taken in RoundTrain, not {state.phase.name}")
    index = healthy_client(state, signer)
    if round_height != state.round.height:
        raise StaleRound(f"the current round is {state.round.height}, not {round_height}")
    position = elected_position(state, index)
    if state.round.committed >> position & 1:
        raise AlreadyCommitted("this witness already committed to the next round's seed: a commitment is final")
    if commitments_closed(state):
        raise WrongPhase("the commitments to the next seed have closed (a quorum of the witnesses committed): "
                         "secrets may be shown now, so no commitment is taken")
    state.round.commitments[position] = commitment
    state.round.committed |= 1 << position
    state.nonce += 1


def commitments_closed(state: CoordinatorState) -> bool:
    """Whether no commitment to the next seed is taken any more, so secrets may be shown: RoundTrain has ended, a
    quorum of the round's witnesses has committed, or every elected witness has committed or is leaving (a client
    marked unhealthy or withdrawn never acts again in the round). A quorum being a strict majority of the witnesses,
    one of its commitments is an honest witness's while the honest hold the majority the coordinator relies on.
    Honest witnesses commit as the round opens, so their reveals have the rest of the round, not only RoundWitness,
    which a whole-second clock may cut to a moment, and a dead witness holds no one's reveal back."""
    if state.phase != Phase.RoundTrain:
        return state.phase == Phase.RoundWitness
    if state.round.committed.bit_count() >= quorum(state):
        return True
    return all(state.round.committed >> position & 1 or state.clients[index].health != Health.Healthy
               for position, index in enumerate(elected(state)))


def reveal_seed(state: CoordinatorState, signer: bytes, round_height: int, secret: bytes) -> None:
    """Open a commitment: in the warmup a joiner's (``reveal_join``); otherwise a committed witness's, once the
    commitments have closed (``commitments_closed``) and before the round's end begins. The secret is XORed into the
    round's reveals, from which the next seed is drawn."""
    if state.phase == Phase.Warmup:
        reveal_join(state, signer, round_height, secret)
        return
    if state.phase not in (Phase.RoundTrain, Phase.RoundWitness) or closing(state):
        raise WrongPhase(f"secrets are revealed in Warmup (a joiner's), and in RoundTrain and RoundWitness before the "
                         f"round closes (a witness's), not {state.phase.name}")
    index = healthy_client(state, signer)
    if round_height != state.round.height:
        raise StaleRound(f"the current round is {state.round.height}, not {round_height}")
    position = elected_position(state, index)
    if not commitments_closed(state):
        raise WrongPhase("secrets are revealed once a quorum of the witnesses (or every one) has committed, or "
                         "RoundTrain has ended")
    if not state.round.committed >> position & 1:
        raise NoCommitment("this witness did not commit to the next seed during RoundTrain: nothing to reveal")
    if state.round.revealed >> position & 1:
        raise AlreadyRevealed("this witness already revealed its secret for the round")
    if seed_commitment(signer, state.round.seed, secret) != state.round.commitments[position]:
        raise BadReveal("the secret does not open this witness's commitment: only the committed secret is taken")
    state.round.reveals = mix_reveal(state.round.reveals, secret)
    state.round.revealed |= 1 << position
    state.nonce += 1


def reveal_join(state: CoordinatorState, signer: bytes, round_height: int, secret: bytes) -> None:
    """An admitted joiner opens the commitment it joined with, while the warmup waits for reveals (``revealing``):
    its secret goes into the warmup's seed, and its commitment is spent."""
    index = healthy_client(state, signer)
    if round_height != state.round.height:
        raise StaleRound(f"the warmup is round {state.round.height}, not {round_height}")
    if not revealing(state):
        raise WrongPhase("the joiners' reveals have closed and the warmup's witnesses are elected: no secret is "
                         "taken until the warmup's first round")
    client = state.clients[index]
    if client.commitment == NO_COMMITMENT:
        raise NoCommitment("this client joined without a commitment, or has revealed it: nothing to reveal")
    if join_commitment(signer, secret) != client.commitment:
        raise BadReveal("the secret does not open the commitment this client joined with")
    state.round.reveals = mix_reveal(state.round.reveals, secret)
    client.commitment = NO_COMMITMENT
    state.nonce += 1


def join_reveals_over(state: CoordinatorState, now: int) -> bool:
    """Whether the warmup's joiners' reveals close: every joiner still healthy has revealed, or the warmup has ended.
    Honest joiners reveal as the warmup opens, so the reveals close at once; one that does not holds back only the
    warmup's election, whose proofs can end the warmup early, and the warmup's end starts round 0 regardless. A
    shorter deadline would cut honest reveals short in a warmup of a second or two (the clock counts whole seconds)."""
    every_one = all(c.commitment == NO_COMMITMENT or c.health != Health.Healthy for c in state.clients)
    return every_one or now >= state.phase_start + state.config.warmup_time


def close_join_reveals(state: CoordinatorState, entropy: int) -> None:
    """The joiners that did not reveal become unhealthy, to leave with the tick's drop, and the warmup's seed takes
    the secrets revealed: ``next_seed(seed, entropy, reveals)``, which elects the warmup's witnesses."""
    for client in state.clients:
        if client.commitment != NO_COMMITMENT:
            client.commitment = NO_COMMITMENT
            if client.health == Health.Healthy:
                client.health = Health.Unhealthy
    state.round.seed = next_seed(state.round.seed, entropy, state.round.reveals)
    state.round.reveals = NO_REVEALS


def withholders_leave(state: CoordinatorState) -> None:
    """A witness that committed to the next seed and never revealed leaves at the round's end, as unhealthy."""
    slots = elected(state)
    for position in withholders(state.round.committed, state.round.revealed):
        client = state.clients[slots[position]]
        if client.health == Health.Healthy:
            client.health = Health.Unhealthy
