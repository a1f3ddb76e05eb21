"""Facts every client and backend derives from the coordinator's state the same way: the run's instance name,
the round's witnesses and quorum, its data assignment, and how the pipeline's stages are filled.

Pure functions of the state, shared by the rules (``rules``), the points (``points``) and the clients that read
the state, so that all of them agree on who is elected, what counts as a quorum and which trainer trains what.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from coordinator_program.spec import limits
from coordinator_program.spec.bloom import part_count
from coordinator_program.spec.config import Config
from coordinator_program.spec.selection import Assignment, assign_data, effective_quorum, elect_witnesses
from coordinator_program.spec.state import Client, CoordinatorState, Health, Pending, Phase, Role, Round, no_witnesses


def run_instance(state: CoordinatorState) -> str:
    """The name of this run, apart from any other run of the same id: ``<run_id>.<16 hex digits>`` of
    sha256(run id ‖ main authority ‖ creation time). Everything a run's clients share off the coordinator (DHT
    records, averaging groups, state sharing) lives under it, so a later run with the same id never reads an
    earlier run's."""
    digest = hashlib.sha256(state.run_id.encode() + state.main_authority + state.created_at.to_bytes(8, "little",
                                                                                                     signed=True))
    return f"{state.run_id}.{digest.hexdigest()[:16]}"


ELECTING_PHASES = (Phase.Warmup, Phase.RoundTrain, Phase.RoundWitness)
"""The phases whose round has witnesses: its clients are those the election ranked."""


def election(state: CoordinatorState) -> list[int]:
    """``Round.witnesses`` for the current clients and seed: the elected client indices in slot order, then zeros.
    Set when a round's clients and seed are set (the warmup's start, a drop in warmup, each round's start); a
    round's clients do not change until it ends, so the election holds for the whole round.

    An epoch's first two elections (its warmup's and round 0's, both of height 0) rank its veterans first.
    Their seeds are known from the epoch before's last round on (the warmup's chains from that round's reveals,
    round 0's from the warmup's, which has none), before the epoch's joins close: a joiner could grind keypairs
    until one held a low ticket under them and join with it, and win every seat of both, then choose round 1's
    seed as round 0's only committers. A veteran, a client of that last round, held its key before those
    reveals were shown, so its tickets are as unforeseeable to it as to anyone; round 0's witnesses are
    veterans, and their commit-reveal makes round 1's seed unforeseeable when every client's key is already
    fixed. Joiners fill only the seats veterans cannot (an epoch with fewer veterans than seats, the run's first)."""
    veterans = [c.veteran for c in state.clients] if state.round.height == 0 else None
    elected = elect_witnesses(state.round.seed, [c.id for c in state.clients], state.config.witness_nodes,
                              veterans)
    return elected + no_witnesses()[len(elected):]


def elected(state: CoordinatorState) -> list[int]:
    """Client indices of the current round's witnesses, in slot order ([] between epochs, and in a warmup still
    waiting for its joiners' reveals)."""
    if state.phase not in ELECTING_PHASES or revealing(state):
        return []
    return state.round.witnesses[:min(state.config.witness_nodes, len(state.clients))]


def revealing(state: CoordinatorState) -> bool:
    """Whether the epoch's warmup still waits for its joiners to reveal the secrets they joined with (``beacon``): its
    witnesses are elected only once the secrets are in its seed."""
    return state.phase == Phase.Warmup and state.round.witnesses[0] == limits.UNELECTED


def closing(state: CoordinatorState) -> bool:
    """Whether the round's end has begun crediting (``points.credit_chunk``): it takes no more proofs nor reveals, so
    votes and the next seed stay put."""
    return state.phase == Phase.RoundWitness and state.round.credited > 0


def witnesses(state: CoordinatorState) -> list[bytes]:
    """Identities of the current round's witnesses, in election order."""
    return [state.clients[i].id for i in elected(state)]


def quorum(state: CoordinatorState) -> int:
    """Proofs the current round needs (the configured quorum, capped by how many could be elected)."""
    return effective_quorum(state.config.witness_quorum, min(state.config.witness_nodes, len(state.clients)))


def quorum_reached(state: CoordinatorState) -> bool:
    """Whether the current round holds a quorum of proofs: what ends Warmup or RoundTrain early, and what a
    round needs for the epoch to go on. Honest witnesses prove during RoundTrain only once they judge every
    batch in, so a quorum of early proofs is a majority of the witnesses saying the round is complete."""
    return state.round.witness_count >= quorum(state)


def data_assignment(state: CoordinatorState) -> list[Assignment]:
    """The current round's split of the global batch among its trainers."""
    trainers = [c.id for c in state.clients if c.role == Role.Trainer]
    return assign_data(state.round.seed, trainers, state.round.data_index, state.config.global_batch_size)


def stage_workers(clients: Iterable[Client | Pending], num_stages: int) -> list[int]:
    """How many workers each stage has (entries without a stage yet are not counted)."""
    counts = [0] * num_stages
    for c in clients:
        if c.role == Role.Worker and c.stage < num_stages:
            counts[c.stage] += 1
    return counts


def pipeline_formed(clients: list[Client], num_stages: int) -> bool:
    """A batch can be trained: a worker in every stage and at least one trainer."""
    return min(stage_workers(clients, num_stages)) >= 1 and any(c.role == Role.Trainer for c in clients)


def pipeline_complete(clients: list[Client], config: Config) -> bool:
    """An epoch needs enough clients as well as a formed pipeline."""
    return len(clients) >= config.min_clients and pipeline_formed(clients, config.num_stages)


def assign_stages(pending: list[Pending], num_stages: int) -> list[Client]:
    """Admit joiners in order: workers that asked for a stage keep it; the others go, one by one, to the
    least occupied stage (lowest index on ties), counting the stages that were asked for first."""
    counts = stage_workers(pending, num_stages)
    admitted = []
    for joiner in pending:
        stage = joiner.stage
        if joiner.role == Role.Worker and stage == limits.NO_STAGE:
            stage = counts.index(min(counts))
            counts[stage] += 1
        admitted.append(Client(joiner.id, joiner.role, stage, Health.Healthy, joiner.slot, joiner.veteran,
                               joiner.commitment))
    return admitted


def unproven(round_: Round) -> bool:
    """A round no witness sent a proof for. Nobody can then tell who is alive (every client may be dead), so
    all its clients leave at the round's end, as withdrawn, rather than stay Healthy and be queued again for
    the next epoch; the live ones simply join again. Psyche does the same."""
    return round_.witness_count == 0


def missed_by_quorum(state: CoordinatorState, client_id: bytes) -> bool:
    """The health rule: a client is unhealthy when a quorum of the previous round's proofs of its part leave it out
    (the epoch's first round has no previous round, and judges no one). A quorum being a strict majority of the
    witnesses, a client the honest majority saw is left out by too few: no single witness gets a client removed."""
    index = state.client_index(client_id)
    if state.round.height == 0 or index is None:
        return False
    return state.left_out[index] >= quorum(state)


def left_out_counts(state: CoordinatorState) -> list[int]:
    """Per client of the ending round: the proof parts covering it that leave it out (parts sent less its presence
    votes). A part never sent leaves no one out: a dead or silent witness counts against nobody."""
    n = len(state.clients)
    sent = [state.round.part_proofs(p) for p in range(part_count(n))]
    return [sent[i // limits.PART_CLIENTS] - state.presence_votes[i] for i in range(n)]
