"""The coordinator's rules: every operation, and the tick that moves the run through its phases.

This module is the executable specification. It is deterministic and does no I/O: the backend passes the
time (its own clock: Solana's Clock sysvar, or the server's) and the entropy it mixes into the seed of any
round the call may start (``selection.next_seed``: random bits on the TCP server, 0 on chain).
Each operation checks everything first and only then changes the state, so a rejected operation raises a
``CoordinatorError`` and leaves the state exactly as it was; an accepted one bumps the nonce. The exception
is ``close_run``, which only validates: a run it lets close ceases to exist, so its state is discarded.

The order of the checks is part of the specification: the C program performs them in the same order, so
that both reject the same operation with the same error.

Phase changes happen only in ``tick``; operations record facts (a join, a witness proof, a health check)
that the next tick acts on. The on-chain program ticks right after a witness or a health check (but in RoundWitness)
and a checkpoint, as ``instructions.apply_then_tick`` does: never where the tick could start a round.

Witnesses are trusted only as a majority: a quorum is a strict majority of a round's witnesses
(``validate_config``), a round's training ends early only on a quorum of proofs (or when its healthy clients no
longer form a pipeline: a stage's last worker or the last trainer left), and a client is unhealthy only when a
quorum of proofs leaves it out. A minority of witnesses, each sending an empty or false filter or none at all,
can thus neither end a round nor get a client removed. A round nobody proved withdraws its clients.

Seeds are drawn so that no one foresees an election and no single party chooses one (``beacon``): a round's
witnesses commit to secrets while it trains (``reveals.commit_seed``), reveal them once a quorum of them has
committed or RoundTrain has ended (``reveals.reveal_seed``), and the next round's seed hashes the XOR of what was
revealed; a witness that committed and did not reveal leaves the epoch at the round's end. The tick that sets a
round's seed or clients elects its witnesses by rank of a per-key ticket (``selection.elect_witnesses``), kept in
``Round.witnesses``, so a client leaving before the round starts, once its seed is known, moves no one else's seat.
An epoch's warmup and round 0 would take seeds known before its joins close, so each joiner commits to a secret when
it joins and reveals it in the warmup, whose witnesses are elected once the secrets are in its seed
(``reveals.close_join_reveals``); and their elections rank first its veterans, the clients of the epoch before's
last round, whose keys predate those seeds (``derived.election``).

Points follow the same majority: at the end of each round a client earns presence when a quorum of the round's
proofs hold its participant key, and compute (the samples it worked) when a quorum hold its compute key. They go
into a ledger that outlives epochs (``points``).
A proof comes in parts of ``limits.PART_CLIENTS`` clients, each tallied as it arrives and the whole counted once;
the round's end credits a chunk of clients a tick: no instruction's cost grows with the clients times the witnesses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from coordinator_program.spec import limits
from coordinator_program.spec.beacon import NO_COMMITMENT
from coordinator_program.spec.bloom import compute_key, contains_raw, part_count, part_range, participant_key
from coordinator_program.spec.config import (
    Checkpoint,
    CheckpointKind,
    Config,
    Model,
    valid_run_id,
    validate_checkpoint,
    validate_config,
    validate_model,
)
from coordinator_program.spec.derived import (
    assign_stages,
    closing,
    election,
    left_out_counts,
    missed_by_quorum,
    pipeline_complete,
    pipeline_formed,
    quorum_reached,
    revealing,
    unproven,
)
from coordinator_program.spec.errors import (
    AlreadyJoined,
    AlreadyMarked,
    BadFilter,
    CheckpointTaken,
    ClientHealthy,
    DuplicateWitness,
    InvalidCheckpoint,
    InvalidConfig,
    InvalidJoin,
    InvalidRunId,
    JoinExpired,
    NoPreviousRound,
    NotAuthorized,
    NotAWorker,
    NotHalted,
    NotHealthy,
    NothingToTick,
    NotInitialized,
    NotJoined,
    RunFinished,
    RunFull,
    SlotTaken,
    StaleRound,
    UnknownClient,
    WrongPhase,
    WrongRunId,
)
from coordinator_program.spec.points import credit_chunk
from coordinator_program.spec.reveals import close_join_reveals, join_reveals_over, withholders_leave
from coordinator_program.spec.selection import next_seed
from coordinator_program.spec.signers import elected_position, healthy_client
from coordinator_program.spec.state import (
    CoordinatorState,
    Health,
    Pending,
    Phase,
    Role,
    Round,
    no_parts,
    no_votes,
    unelected,
)

NO_AUTHORITY = bytes(32)
"""A join authority of all zeros makes a run permissionless."""


# --- construction and administration ------------------------------------------------------------------

def init_coordinator(run_id: str, main_authority: bytes, join_authority: bytes, now: int) -> CoordinatorState:
    """A new, unconfigured run created at ``now`` (the backend's clock); ``update`` gives it a config and
    ``set_paused(False)`` starts it."""
    if not valid_run_id(run_id):
        raise InvalidRunId(f"run_id {run_id!r} must be 1-32 characters of [A-Za-z0-9._-]")
    return CoordinatorState(run_id=run_id, main_authority=main_authority, join_authority=join_authority,
                            created_at=now)


def update(state: CoordinatorState, signer: bytes, config: Config, model: Model, checkpoint: Checkpoint) -> None:
    """Set the run's config, model and starting checkpoint (the place of every stage); only the main authority, only
    while halted."""
    if signer != state.main_authority:
        raise NotAuthorized("only the run's main authority may update it")
    if state.phase not in (Phase.Uninitialized, Phase.Paused):
        raise NotHalted(f"pause the run before updating it (it is in {state.phase.name})")
    validate_config(config)
    validate_model(model, config)
    validate_checkpoint(checkpoint)
    if len(state.pending) > config.max_clients:
        raise InvalidConfig(f"max_clients: {len(state.pending)} joiners are already pending")
    if any(p.stage != limits.NO_STAGE and p.stage >= config.num_stages for p in state.pending):
        raise InvalidConfig("num_stages: a pending worker holds a stage beyond the new count")
    state.config, state.model = config, model
    state.checkpoints = [checkpoint] * config.num_stages + [Checkpoint()] * (limits.MAX_STAGES - config.num_stages)
    if state.phase == Phase.Uninitialized:
        state.phase = Phase.Paused
    state.nonce += 1


def set_paused(state: CoordinatorState, signer: bytes, paused: bool) -> None:
    """Ask the run to pause (it stops at the next WaitingForMembers or end of epoch) or to resume."""
    if signer != state.main_authority:
        raise NotAuthorized("only the run's main authority may pause or resume it")
    if state.phase == Phase.Uninitialized:
        raise NotInitialized("update the run with a config before resuming it")
    if state.phase == Phase.Finished:
        raise RunFinished("a finished run cannot be paused or resumed")
    state.pause_requested = paused
    state.nonce += 1


HALTED_FOR_CLOSING = (Phase.Uninitialized, Phase.Paused, Phase.Finished)
"""Phases in which nothing is in flight: no epoch holds clients, so closing strands no one's work."""


def close_run(state: CoordinatorState, signer: bytes) -> None:
    """Check that ``signer`` may close the run now; the state is not changed.

    Closing ends the run for good: on chain, both of its accounts give their rent back to the main
    authority and cease to exist, which is why this rule only validates and the caller discards the state
    (there is no "closed" phase to record). Checks, in order: the signer is the main authority
    (``NotAuthorized``), then the run is halted — Uninitialized, Paused or Finished (``NotHalted``).
    """
    if signer != state.main_authority:
        raise NotAuthorized("only the run's main authority may close it")
    if state.phase not in HALTED_FOR_CLOSING:
        raise NotHalted(f"pause the run and let it reach Paused, or let it finish, before closing it "
                        f"(it is in {state.phase.name})")


# --- clients ------------------------------------------------------------------------------------------

def _check_open(state: CoordinatorState) -> None:
    if state.phase == Phase.Uninitialized:
        raise NotInitialized("the run has no config yet")
    if state.phase == Phase.Finished:
        raise RunFinished("the run has finished")


def join(state: CoordinatorState, signer: bytes, run_id: str, role: Role, stage: int,
         authorizer: bytes, slot: int = limits.NO_SLOT, valid_until: int = limits.NO_DEADLINE,
         now: int = 0, commitment: bytes = NO_COMMITMENT) -> None:
    """Queue a joiner; it is admitted when the run next leaves WaitingForMembers, and reveals the secret its
    ``commitment`` holds in that epoch's warmup (``beacon``).

    ``authorizer`` is the co-signer of the join: the run's join authority, or for a permissionless run
    anyone (the joiner itself). The authority names the ``slot`` it grants and a deadline, ``valid_until``:
    one slot holds one live key at a time, and a countersignature kept unused past its deadline admits no
    one, so a slot the authority has ended (``release_slot``) cannot be filled again by an old one. Together
    they make the authority's cap per contributor a cap on the keys the coordinator admits.
    """
    if run_id != state.run_id:
        raise WrongRunId(f"this is run {state.run_id!r}, not {run_id!r}")
    _check_open(state)
    if state.join_authority != NO_AUTHORITY and authorizer != state.join_authority:
        raise NotAuthorized("this run needs its join authority to co-sign every join")
    if now > valid_until:
        raise JoinExpired(f"the join was valid until {valid_until}; it is now {now}: ask for a new countersignature")
    if role == Role.Worker:
        if stage != limits.NO_STAGE and stage >= state.config.num_stages:
            raise InvalidJoin(f"stage {stage} does not exist: the run has {state.config.num_stages} stages")
    elif stage != limits.NO_STAGE:
        raise InvalidJoin("a trainer holds no stage")
    if state.client_index(signer) is not None or state.pending_index(signer) is not None:
        raise AlreadyJoined("this identity has already joined the run")
    if slot != limits.NO_SLOT and slot_holder(state, slot) is not None:
        raise SlotTaken(f"slot {slot} is held by another key until its holder leaves")
    if len(state.clients) + len(state.pending) >= state.config.max_clients:
        raise RunFull(f"the run is full ({state.config.max_clients} clients)")
    state.pending.append(Pending(signer, role, stage, slot, commitment=commitment))
    state.nonce += 1


def slot_holder(state: CoordinatorState, slot: int) -> bytes | None:
    """The live key in ``slot``: a joiner, or a healthy client (an unhealthy or withdrawn one leaves at the
    round's end and acts no more)."""
    for joiner in state.pending:
        if joiner.slot == slot:
            return joiner.id
    for client in state.clients:
        if client.slot == slot and client.health == Health.Healthy:
            return client.id
    return None


def withdraw(state: CoordinatorState, key: bytes) -> None:
    """``key`` leaves the run: a pending joiner at once, a client at the end of the current round. Sent by the key
    itself, or by the join authority ending its slot (``release_slot``)."""
    index = state.pending_index(key)
    if index is not None:
        del state.pending[index]
        state.nonce += 1
        return
    index = state.client_index(key)
    if index is None:
        raise NotJoined("this identity is not in the run")
    if state.clients[index].health == Health.Withdrawn:
        raise NotHealthy("this client has already withdrawn")
    state.clients[index].health = Health.Withdrawn
    state.nonce += 1


def release_slot(state: CoordinatorState, signer: bytes, key: bytes) -> None:
    """The join authority ends the slot ``key`` holds: it withdraws as if it had asked (a joiner at once, a
    client at the round's end). The authority sends this for every slot that ends (its holder left, its lease
    lapsed), so a contributor that gives a slot up cannot keep the key it admitted."""
    if state.join_authority == NO_AUTHORITY or signer != state.join_authority:
        raise NotAuthorized("only the run's join authority may end a slot")
    withdraw(state, key)


def _record_part(state: CoordinatorState, signer: bytes, participant_bloom: bytes, batch_bloom: bytes,
                 part: int) -> None:
    """Record part ``part`` of an elected witness's proof; the proof counts (``Round.witnessed``) once all its parts
    are in: once however many transactions it takes, and never on a part."""
    index = state.client_index(signer)
    assert index is not None
    position = elected_position(state, index)
    if state.round.witnessed >> position & 1:
        raise DuplicateWitness("this witness already sent its proof for the round")
    parts = part_count(len(state.clients))
    if part >= parts:
        raise BadFilter(f"this round's proofs have parts 0-{parts - 1} (one per {limits.PART_CLIENTS} clients), "
                        f"not {part}")
    if state.round.parts[position] >> part & 1:
        raise DuplicateWitness(f"this witness already sent part {part} of its proof for the round")
    size = state.config.bloom_bytes
    if len(participant_bloom) != size or len(batch_bloom) != size:
        raise BadFilter(f"filters of this run are {size} bytes; got {len(participant_bloom)} and "
                        f"{len(batch_bloom)}")
    state.round.parts[position] |= 1 << part
    if state.round.parts[position] == (1 << parts) - 1:
        state.round.witnessed |= 1 << position
    state.nonce += 1


def _check_open_round(state: CoordinatorState) -> None:
    if state.phase not in (Phase.RoundTrain, Phase.RoundWitness):
        raise WrongPhase(f"witness proofs are taken in RoundTrain and RoundWitness, not {state.phase.name}")
    if closing(state):
        raise WrongPhase("the round is closing (its points are being credited): proofs are no longer taken")


def witness(state: CoordinatorState, signer: bytes, round_height: int, participant_bloom: bytes, batch_bloom: bytes,
            part: int = 0) -> None:
    """Record part ``part`` of an elected witness's proof for the current round (opportunistic during RoundTrain),
    and count whom its participant filter says were present and did counted work among the part's clients
    (``tally_part``)."""
    _check_open_round(state)
    healthy_client(state, signer)
    if round_height != state.round.height:
        raise StaleRound(f"the current round is {state.round.height}, not {round_height}")
    _record_part(state, signer, participant_bloom, batch_bloom, part)
    tally_part(state, part, participant_bloom)


def tally_part(state: CoordinatorState, part: int, participant_bloom: bytes) -> None:
    """Add one proof part's votes: for each client the part covers, whether the filter holds its participant key and
    its compute key; each instruction hashes one part's keys, and the round's end only reads the counts. Client
    indices do not move during a round, so a vote stays with its client until the round ends."""
    config = state.config
    for i in part_range(part, len(state.clients)):
        client = state.clients[i]
        for votes, key in ((state.presence_votes, participant_key(client.id)),
                           (state.compute_votes, compute_key(client.id))):
            if contains_raw(participant_bloom, key, config.bloom_slices, config.bloom_bits_per_slice):
                votes[i] += 1


def warmup_witness(state: CoordinatorState, signer: bytes, participant_bloom: bytes, batch_bloom: bytes,
                   part: int = 0) -> None:
    """Record part ``part`` of a warmup witness's proof of which clients have loaded the model."""
    if state.phase != Phase.Warmup:
        raise WrongPhase(f"warmup proofs are taken in Warmup, not {state.phase.name}")
    healthy_client(state, signer)
    _record_part(state, signer, participant_bloom, batch_bloom, part)


def health_check(state: CoordinatorState, signer: bytes, target: bytes) -> None:
    """Mark ``target`` for removal at the end of this round, if a quorum of the previous round's proofs left
    it out (``missed_by_quorum``)."""
    if state.phase not in (Phase.RoundTrain, Phase.RoundWitness):
        raise WrongPhase(f"health checks are taken in RoundTrain and RoundWitness, not {state.phase.name}")
    healthy_client(state, signer)
    if state.round.height == 0:
        raise NoPreviousRound("the epoch's first round has no previous round to judge by")
    index = state.client_index(target)
    if index is None:
        raise UnknownClient("the named client is not in the current epoch")
    if state.clients[index].health != Health.Healthy:
        raise AlreadyMarked("the named client is already leaving the epoch")
    if not missed_by_quorum(state, target):
        raise ClientHealthy("fewer than a quorum of the previous round's proofs left this client out")
    state.clients[index].health = Health.Unhealthy
    state.nonce += 1


def checkpoint(state: CoordinatorState, signer: bytes, kind: CheckpointKind, repo: str, revision: str) -> None:
    """A worker reports that its stage is saved at ``repo``@``revision``: where the stage's next joiners download it.

    A report sets the place of the reporter's own stage (the one the coordinator assigned it) and of no other, so
    no worker can erase or repoint another stage's checkpoint. Within a stage the first report of the epoch wins: a
    later one naming the same place confirms it, one naming another is refused (``CheckpointTaken``), so a stage's
    place never flaps between its workers. Once every stage is saved, Cooldown may end early."""
    if state.phase != Phase.Cooldown:
        raise WrongPhase(f"checkpoints are reported in Cooldown, not {state.phase.name}")
    index = healthy_client(state, signer)
    client = state.clients[index]
    if client.role != Role.Worker:
        raise NotAWorker("only a stage worker holds parameters to checkpoint")
    if kind not in (CheckpointKind.Hub, CheckpointKind.Local) or repo == "":
        raise InvalidCheckpoint("a checkpoint is a Hub repo or a Local directory, with a name")
    if not all(0x20 <= ord(ch) <= 0x7E for ch in repo + revision):
        raise InvalidCheckpoint("repo and revision must be printable ASCII")
    place, recorded = Checkpoint(kind, repo, revision), state.checkpoints[client.stage]
    if recorded.saved and recorded != place:  # Cooldown began with every stage's place P2P: saved means this epoch
        raise CheckpointTaken(f"stage {client.stage} of this epoch is already saved at {recorded.kind.name} "
                              f"{recorded.repo}@{recorded.revision}: a stage keeps the first place reported")
    state.checkpoints[client.stage] = place
    state.nonce += 1


# --- the tick -----------------------------------------------------------------------------------------

def tick(state: CoordinatorState, now: int, entropy: int) -> None:
    """Make every transition that is due at time ``now``; a round this tick starts takes the seed
    ``next_seed(seed of the round before, entropy, that round's reveals)``.

    Raises ``NothingToTick`` when nothing is due, so a ticker can tell a useful tick from a wasted one.
    """
    rule = _TICKS.get(state.phase)
    if rule is None:
        raise (NotInitialized if state.phase == Phase.Uninitialized else RunFinished)("nothing to tick")
    if not rule.due(state, now):
        raise NothingToTick(f"{state.phase.name}: no transition is due")
    rule.transition(state, now, entropy)
    state.nonce += 1


def tick_due(state: CoordinatorState, now: int) -> bool:
    """Whether ``tick(state, now, ...)`` would change anything (``False`` where it raises), judged without
    changing the state: a backend asks this before it copies the state to tick, so a request that leaves nothing
    due costs no copy nor assignment of the queue's stages."""
    rule = _TICKS.get(state.phase)
    return rule is not None and rule.due(state, now)


class PhaseTick(NamedTuple):
    """A phase's tick: when it is due, and what it does then (only ever called when due)."""

    due: Callable[[CoordinatorState, int], bool]
    transition: Callable[[CoordinatorState, int, int], None]


def _enter(state: CoordinatorState, phase: Phase, now: int) -> None:
    state.phase = phase
    state.phase_start = now


def _resume_due(state: CoordinatorState, now: int) -> bool:
    return not state.pause_requested


def _resume(state: CoordinatorState, now: int, entropy: int) -> None:
    _enter(state, Phase.WaitingForMembers, now)


def _admission_due(state: CoordinatorState, now: int) -> bool:
    """A pause was asked for, or the queue completes a pipeline (``assign_stages`` admits every joiner, so too
    short a queue cannot, and is not assigned)."""
    config = state.config
    return state.pause_requested or (len(state.pending) >= config.min_clients and pipeline_complete(
        assign_stages(state.pending, config.num_stages), config))


def _admit(state: CoordinatorState, now: int, entropy: int) -> None:
    if state.pause_requested:
        _enter(state, Phase.Paused, now)
        return
    seed = next_seed(state.round.seed, entropy, state.round.reveals)  # the epoch's last round's reveals
    state.clients = assign_stages(state.pending, state.config.num_stages)
    state.pending, state.left_out = [], no_votes()
    state.round = Round(0, seed, state.step * state.config.global_batch_size)
    joiners_committed = any(c.commitment != NO_COMMITMENT for c in state.clients)
    state.round.witnesses = unelected() if joiners_committed else election(state)  # elected once they reveal
    _enter(state, Phase.Warmup, now)


def _return_to_waiting(state: CoordinatorState, now: int) -> None:
    """Send the epoch's clients back to the front of the queue, keeping each worker's stage."""
    state.pending = [Pending(c.id, c.role, c.stage, c.slot, c.veteran, c.commitment)
                     for c in state.clients] + state.pending
    state.clients = []
    _enter(state, Phase.WaitingForMembers, now)


def _warmup_due(state: CoordinatorState, now: int) -> bool:
    return ((revealing(state) and join_reveals_over(state, now))
            or any(c.health != Health.Healthy for c in state.clients)
            or quorum_reached(state) or now >= state.phase_start + state.config.warmup_time)


def _warm_up(state: CoordinatorState, now: int, entropy: int) -> None:
    """Once the joiners' reveals close, the warmup's seed takes their secrets and the joiners that kept theirs are
    unhealthy (``reveals.close_join_reveals``). The unhealthy leave (a witness among them lets the next ticket in, and
    slots move: proofs start over, under the warmup's election of the clients left); the first round starts on a
    quorum of proofs or at the warmup's end, and the run waits again if no pipeline is left. One tick elects once, and
    none while the reveals are open."""
    closed = revealing(state) and join_reveals_over(state, now)
    if closed:
        close_join_reveals(state, entropy)
    dropped = any(c.health != Health.Healthy for c in state.clients)
    if dropped:
        state.clients = [c for c in state.clients if c.health == Health.Healthy]
        state.round.witnessed = 0
        state.round.parts = no_parts()
        if not pipeline_complete(state.clients, state.config):
            _return_to_waiting(state, now)
            return
    if quorum_reached(state) or now >= state.phase_start + state.config.warmup_time:
        _start_round(state, now, entropy, 0)
    elif closed or (dropped and not revealing(state)):
        state.round.witnesses = election(state)


def _start_round(state: CoordinatorState, now: int, entropy: int, height: int) -> None:
    seed = next_seed(state.round.seed, entropy, state.round.reveals)
    state.round = Round(height, seed, state.step * state.config.global_batch_size)
    state.round.witnesses = election(state)
    _enter(state, Phase.RoundTrain, now)


def _training_over(state: CoordinatorState, now: int) -> bool:
    """The round's training ends on a quorum of proofs, at its time limit, or as soon as its healthy clients no
    longer form a pipeline (a stage's last worker or the last trainer left): nothing more can be trained, so nobody
    waits. Fewer healthy clients than ``min_clients`` alone does not end it: the rest still train the round (a
    health-checked liar among them must not cost the honest their round), and the epoch ends when it does."""
    healthy = [c for c in state.clients if c.health == Health.Healthy]
    return (quorum_reached(state) or now >= state.phase_start + state.config.max_round_train_time
            or not pipeline_formed(healthy, state.config.num_stages))


def _end_training(state: CoordinatorState, now: int, entropy: int) -> None:
    _enter(state, Phase.RoundWitness, now)


def _close_round_votes(state: CoordinatorState) -> None:
    """Keep the ending round's ``left_out_counts`` of the clients that stay, in their new order; votes start over."""
    left = left_out_counts(state)
    if unproven(state.round):
        state.clients, left = [], []
    else:
        kept = [i for i, c in enumerate(state.clients) if c.health == Health.Healthy]
        state.clients, left = [state.clients[i] for i in kept], [left[i] for i in kept]
    state.left_out = left + [0] * (limits.MAX_CLIENTS - len(left))
    state.presence_votes, state.compute_votes = no_votes(), no_votes()


def _witnessing_over(state: CoordinatorState, now: int) -> bool:
    return now >= state.phase_start + state.config.round_witness_time


def _end_round(state: CoordinatorState, now: int, entropy: int) -> None:
    """Credit the next chunk of the round's clients; once every one is credited, the round ends: the step counts,
    the unhealthy and the withholders leave, and the next round starts unless the epoch is over."""
    credit_chunk(state)
    if state.round.credited < len(state.clients):
        return
    reached_quorum = quorum_reached(state)  # judged with the round's clients, before the unhealthy leave
    state.step += 1
    withholders_leave(state)
    _close_round_votes(state)
    if (state.round.height + 1 >= state.config.rounds_per_epoch
            or state.step >= state.config.total_steps
            or not reached_quorum
            or not pipeline_complete(state.clients, state.config)):
        _peers_hold_every_stage(state)
        _enter(state, Phase.Cooldown, now)
    else:
        _start_round(state, now, entropy, state.round.height + 1)


def _peers_hold_every_stage(state: CoordinatorState) -> None:
    """The epoch ends: each stage's joiners get it from their peers until one of its workers reports it saved. A
    stage's place keeps its last repo and revision, where a joiner may still find an older copy on its own disk."""
    stages = state.config.num_stages
    state.checkpoints[:stages] = [Checkpoint(CheckpointKind.P2P, cp.repo, cp.revision)
                                  for cp in state.checkpoints[:stages]]


def _cooldown_over(state: CoordinatorState, now: int) -> bool:
    return (all(cp.saved for cp in state.checkpoints[:state.config.num_stages])
            or now >= state.phase_start + state.config.cooldown_time)


def _end_epoch(state: CoordinatorState, now: int, entropy: int) -> None:
    state.epoch += 1
    staying = [c for c in state.clients if c.health == Health.Healthy]
    state.clients, state.left_out = [], no_votes()
    if state.step >= state.config.total_steps:
        _enter(state, Phase.Finished, now)
        return
    state.pending = [Pending(c.id, c.role, c.stage, c.slot, veteran=True) for c in staying] + state.pending
    _enter(state, Phase.Paused if state.pause_requested else Phase.WaitingForMembers, now)


_TICKS = {
    Phase.Paused: PhaseTick(_resume_due, _resume),
    Phase.WaitingForMembers: PhaseTick(_admission_due, _admit),
    Phase.Warmup: PhaseTick(_warmup_due, _warm_up),
    Phase.RoundTrain: PhaseTick(_training_over, _end_training),
    Phase.RoundWitness: PhaseTick(_witnessing_over, _end_round),
    Phase.Cooldown: PhaseTick(_cooldown_over, _end_epoch),
}
