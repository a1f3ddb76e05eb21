"""Points: what each client of an ending round earns, and the ledger that keeps them across epochs.

Points follow the witnesses' majority: a client earns presence when a quorum of the round's proofs hold its
participant key, and compute (the samples it worked) when a quorum hold its compute key, so no minority of
witnesses can award points or withhold them. The round's end credits ``limits.CREDIT_CLIENTS`` clients a tick
(``credit_chunk``), so no instruction's cost grows with the run.
"""

from __future__ import annotations

from coordinator_program.spec import limits
from coordinator_program.spec.derived import data_assignment, quorum, stage_workers
from coordinator_program.spec.state import CoordinatorState, LedgerEntry, Role

POINTS_MAX = 2**32 - 1
"""Points are u32 on chain: they stop growing there rather than wrap."""


def present_by_quorum(state: CoordinatorState, index: int) -> bool:
    """Presence: a quorum of the round's proofs hold the client's participant key, so no minority of witnesses
    can award it (or withhold it from a client the honest majority saw)."""
    return state.presence_votes[index] >= quorum(state)


def computed_by_quorum(state: CoordinatorState, index: int) -> bool:
    """Counted work: a quorum of the round's proofs hold the client's compute key."""
    return state.compute_votes[index] >= quorum(state)


def trainer_samples(state: CoordinatorState) -> dict[bytes, int]:
    """What a trainer's counted work is worth: the samples the round's seed assigned it."""
    return {share.client: share.size for share in data_assignment(state)}


def worker_samples(state: CoordinatorState, counted: list[bool]) -> list[int]:
    """What each counted worker's work is worth: its stage ran the whole global batch, shared equally among the
    stage's counted workers, the remainder going to the first of them in client order (0 for everyone else)."""
    batch = state.config.global_batch_size
    sharers = stage_workers((c for c, ok in zip(state.clients, counted, strict=True) if ok), state.config.num_stages)
    samples = [0] * len(state.clients)
    first_seen: set[int] = set()
    for i, client in enumerate(state.clients):
        if client.role != Role.Worker or not counted[i]:
            continue
        samples[i] = batch // sharers[client.stage]
        if client.stage not in first_seen:
            first_seen.add(client.stage)
            samples[i] += batch % sharers[client.stage]
    return samples


def round_points(state: CoordinatorState) -> list[tuple[int, int]]:
    """(presence, compute) each client of the ending round earns, in client order."""
    counted = [computed_by_quorum(state, i) for i in range(len(state.clients))]
    workers = worker_samples(state, counted)
    trainers = trainer_samples(state)
    points = []
    for i, client in enumerate(state.clients):
        presence = 1 if present_by_quorum(state, i) else 0
        if not counted[i]:
            compute = 0
        elif client.role == Role.Worker:
            compute = workers[i]
        else:
            compute = trainers.get(client.id, 0)
        points.append((presence, compute))
    return points


def fewest_points(ledger: list[LedgerEntry]) -> int:
    """Index of the entry a new earner replaces in a full ledger: the fewest total points, the first on ties."""
    return min(range(len(ledger)), key=lambda i: (ledger[i].total, i))


def award(ledger: list[LedgerEntry], client_id: bytes, presence: int, compute: int) -> bool:
    """Add points to ``client_id``'s entry, making one if it has none: the ledger stays sorted by id, and a new
    earner in a full ledger takes the place of the entry with the fewest points. Whether it evicted one."""
    position = next((i for i, entry in enumerate(ledger) if entry.id >= client_id), len(ledger))
    if position < len(ledger) and ledger[position].id == client_id:
        entry = ledger[position]
        entry.presence = min(POINTS_MAX, entry.presence + presence)
        entry.compute = min(POINTS_MAX, entry.compute + compute)
        return False
    evicts = len(ledger) == limits.MAX_CLIENTS
    if evicts:
        evicted = fewest_points(ledger)
        del ledger[evicted]
        position -= 1 if evicted < position else 0
    ledger.insert(position, LedgerEntry(client_id, presence, compute))
    return evicts


def credit_chunk(state: CoordinatorState) -> None:
    """At a round's end, credit the next clients from ``Round.credited`` on: at most ``limits.CREDIT_CLIENTS``,
    stopping once ``limits.CREDIT_EVICTIONS`` new entries have each displaced one from a full ledger (a tick's cost)."""
    points = round_points(state)
    end = min(len(state.clients), state.round.credited + limits.CREDIT_CLIENTS)
    i, evictions = state.round.credited, 0
    while i < end and evictions < limits.CREDIT_EVICTIONS:
        presence, compute = points[i]
        if presence or compute:
            evictions += award(state.ledger, state.clients[i].id, presence, compute)
        i += 1
    state.round.credited = i
