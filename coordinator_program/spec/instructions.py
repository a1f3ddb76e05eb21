"""The coordinator's instructions: their data layout (Anchor conventions) and how each applies.

An instruction's data is sha256("global:<snake_name>")[:8] followed by its Borsh-encoded arguments. The
Solana program receives exactly these bytes; the TCP backend carries the same bytes, signed by the
client, so one codec serves both backends and anchorpy can build any of them from the IDL.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import ClassVar

from coordinator_program.spec import limits, reveals, rules
from coordinator_program.spec.beacon import NO_COMMITMENT
from coordinator_program.spec.config import (
    CHECKPOINT_LAYOUT,
    CONFIG_LAYOUT,
    MODEL_LAYOUT,
    Checkpoint,
    CheckpointKind,
    Config,
    Model,
)
from coordinator_program.spec.errors import MalformedInstruction, NothingToTick
from coordinator_program.spec.layout import (
    BOOL,
    I64,
    PUBKEY,
    U8,
    U16,
    U32,
    Enum8,
    Field,
    FixedStr,
    LayoutError,
    Struct,
    VarBytes,
)
from coordinator_program.spec.state import HASH, CoordinatorState, Phase, Role


@dataclasses.dataclass(frozen=True)
class AccountMeta:
    """An account an instruction takes on chain, in order (the IDL's accounts list)."""

    name: str
    mut: bool
    signer: bool
    doc: str = ""


_SIGNER = AccountMeta("signer", mut=False, signer=True, doc="the client, authority or ticker acting")
_COORDINATOR = AccountMeta("coordinatorAccount", mut=True, signer=False, doc="the run's coordinator account")
_INSTANCE = AccountMeta("coordinatorInstance", mut=False, signer=False,
                        doc="PDA [\"coordinator\", run_id] naming the authorities' account")


class Instruction:
    """Base of every instruction: subclasses are dataclasses with a layout and the accounts they take."""

    NAME: ClassVar[str]
    LAYOUT: ClassVar[Struct]
    ACCOUNTS: ClassVar[tuple[AccountMeta, ...]] = (_SIGNER, _COORDINATOR)

    @classmethod
    def discriminator(cls) -> bytes:
        return hashlib.sha256(f"global:{cls.NAME}".encode()).digest()[:8]

    def encode(self) -> bytes:
        return self.discriminator() + self.LAYOUT.pack(self)


@dataclasses.dataclass(frozen=True)
class InitCoordinator(Instruction):
    run_id: str
    main_authority: bytes
    join_authority: bytes
    NAME = "init_coordinator"
    ACCOUNTS = (
        AccountMeta("payer", mut=True, signer=True, doc="pays for the instance PDA"),
        AccountMeta("coordinatorInstance", mut=True, signer=False, doc="PDA [\"coordinator\", run_id]"),
        AccountMeta("coordinatorAccount", mut=True, signer=False,
                    doc="pre-created, zeroed, owned by the program"),
        AccountMeta("systemProgram", mut=False, signer=False),
    )


@dataclasses.dataclass(frozen=True)
class Update(Instruction):
    config: Config
    model: Model
    checkpoint: Checkpoint
    NAME = "update"
    ACCOUNTS = (_SIGNER, _INSTANCE, _COORDINATOR)


@dataclasses.dataclass(frozen=True)
class SetPaused(Instruction):
    paused: bool
    NAME = "set_paused"
    ACCOUNTS = (_SIGNER, _INSTANCE, _COORDINATOR)


@dataclasses.dataclass(frozen=True)
class CloseRun(Instruction):
    """Close a halted run: both of its accounts give their rent back to the main authority and vanish."""

    NAME = "close_run"
    ACCOUNTS = (
        AccountMeta("signer", mut=True, signer=True, doc="the run's main authority; receives both accounts' rent"),
        AccountMeta("coordinatorInstance", mut=True, signer=False, doc="PDA [\"coordinator\", run_id], closed"),
        AccountMeta("coordinatorAccount", mut=True, signer=False, doc="the run's coordinator account, closed"),
    )


@dataclasses.dataclass(frozen=True)
class JoinRun(Instruction):
    """Join a run. On a permissioned run the join authority's countersignature covers ``slot`` (the slot it
    granted) and ``valid_until`` (the coordinator's clock after which the join admits no one). ``commitment`` is to
    the secret the joiner reveals in its first warmup (``beacon.join_commitment``; zeros for none)."""

    run_id: str
    role: Role
    stage: int = limits.NO_STAGE
    slot: int = limits.NO_SLOT
    valid_until: int = limits.NO_DEADLINE
    commitment: bytes = NO_COMMITMENT
    NAME = "join_run"
    ACCOUNTS = (
        _SIGNER,
        AccountMeta("authorizer", mut=False, signer=True,
                    doc="the join authority, or the joiner again for a permissionless run"),
        _INSTANCE,
        _COORDINATOR,
    )


@dataclasses.dataclass(frozen=True)
class ReleaseSlot(Instruction):
    """The join authority ends the slot ``key`` holds: ``key`` withdraws (``rules.release_slot``)."""

    key: bytes
    NAME = "release_slot"
    ACCOUNTS = (AccountMeta("signer", mut=False, signer=True, doc="the run's join authority"), _COORDINATOR)


@dataclasses.dataclass(frozen=True)
class Tick(Instruction):
    NAME = "tick"


@dataclasses.dataclass(frozen=True)
class Witness(Instruction):
    """One part of an elected witness's proof: the filters of the clients part ``part`` covers (part 0, the only one,
    for a run of at most ``limits.PART_CLIENTS`` clients)."""

    round_height: int
    participant_bloom: bytes
    batch_bloom: bytes
    part: int = 0
    NAME = "witness"


@dataclasses.dataclass(frozen=True)
class WarmupWitness(Instruction):
    participant_bloom: bytes
    batch_bloom: bytes
    part: int = 0
    NAME = "warmup_witness"


@dataclasses.dataclass(frozen=True)
class CommitSeed(Instruction):
    """An elected witness commits, during RoundTrain, to its share of the next round's seed (``beacon``)."""

    round_height: int
    commitment: bytes
    NAME = "commit_seed"


@dataclasses.dataclass(frozen=True)
class RevealSeed(Instruction):
    """A committed witness reveals the secret its commitment holds, once the commitments have closed; in the warmup,
    an admitted joiner reveals the secret it joined with (``reveals.reveal_seed``)."""

    round_height: int
    secret: bytes
    NAME = "reveal_seed"


@dataclasses.dataclass(frozen=True)
class HealthCheck(Instruction):
    target: bytes
    NAME = "health_check"


@dataclasses.dataclass(frozen=True)
class CheckpointReport(Instruction):
    kind: CheckpointKind
    repo: str
    revision: str
    NAME = "checkpoint"


@dataclasses.dataclass(frozen=True)
class Withdraw(Instruction):
    NAME = "withdraw"


_BLOOM = VarBytes(limits.MAX_BLOOM_BYTES)
InitCoordinator.LAYOUT = Struct(InitCoordinator, [
    Field("run_id", FixedStr(limits.RUN_ID_BYTES)), Field("main_authority", PUBKEY),
    Field("join_authority", PUBKEY)])
Update.LAYOUT = Struct(Update, [
    Field("config", CONFIG_LAYOUT), Field("model", MODEL_LAYOUT), Field("checkpoint", CHECKPOINT_LAYOUT)])
SetPaused.LAYOUT = Struct(SetPaused, [Field("paused", BOOL)])
CloseRun.LAYOUT = Struct(CloseRun, [])
JoinRun.LAYOUT = Struct(JoinRun, [
    Field("run_id", FixedStr(limits.RUN_ID_BYTES)), Field("role", Enum8(Role)), Field("stage", U8),
    Field("slot", U16), Field("valid_until", I64), Field("commitment", HASH)])
ReleaseSlot.LAYOUT = Struct(ReleaseSlot, [Field("key", PUBKEY)])
Tick.LAYOUT = Struct(Tick, [])
Witness.LAYOUT = Struct(Witness, [
    Field("round_height", U32), Field("part", U8), Field("participant_bloom", _BLOOM), Field("batch_bloom", _BLOOM)])
WarmupWitness.LAYOUT = Struct(WarmupWitness, [
    Field("part", U8), Field("participant_bloom", _BLOOM), Field("batch_bloom", _BLOOM)])
CommitSeed.LAYOUT = Struct(CommitSeed, [Field("round_height", U32), Field("commitment", HASH)])
RevealSeed.LAYOUT = Struct(RevealSeed, [Field("round_height", U32), Field("secret", HASH)])
HealthCheck.LAYOUT = Struct(HealthCheck, [Field("target", PUBKEY)])
CheckpointReport.LAYOUT = Struct(CheckpointReport, [
    Field("kind", Enum8(CheckpointKind)), Field("repo", FixedStr(limits.REPO_BYTES)),
    Field("revision", FixedStr(limits.REVISION_BYTES))])
Withdraw.LAYOUT = Struct(Withdraw, [])

INSTRUCTIONS: tuple[type[Instruction], ...] = (
    InitCoordinator, Update, SetPaused, JoinRun, Tick, Witness, WarmupWitness, HealthCheck,
    CheckpointReport, Withdraw, CloseRun, ReleaseSlot, CommitSeed, RevealSeed,
)
_BY_DISCRIMINATOR = {cls.discriminator(): cls for cls in INSTRUCTIONS}


def decode_instruction(data: bytes) -> Instruction:
    """Parse instruction data; anything malformed raises ``MalformedInstruction`` naming the problem."""
    cls = _BY_DISCRIMINATOR.get(bytes(data[:8]))
    if cls is None:
        raise MalformedInstruction("unknown instruction discriminator")
    try:
        return cls.LAYOUT.unpack(bytes(data[8:]))
    except LayoutError as exc:
        raise MalformedInstruction(f"{cls.NAME}: {exc}") from None


def apply(state: CoordinatorState, ix: Instruction, signer: bytes, now: int, entropy: int,
          authorizer: bytes | None = None) -> None:
    """Apply one instruction from ``signer`` (already authenticated by the backend).

    ``authorizer`` is the co-signer of a join (the joiner itself when omitted). Initialisation creates a
    state and closing ends one rather than changing it, so they go through ``rules.init_coordinator`` and
    ``rules.close_run`` instead, and are refused here.
    """
    match ix:
        case Update(config, model, checkpoint):
            rules.update(state, signer, config, model, checkpoint)
        case SetPaused(paused):
            rules.set_paused(state, signer, paused)
        case JoinRun(run_id, role, stage, slot, valid_until, commitment):
            rules.join(state, signer, run_id, role, stage, signer if authorizer is None else authorizer, slot,
                       valid_until, now, commitment)
        case ReleaseSlot(key):
            rules.release_slot(state, signer, key)
        case Tick():
            rules.tick(state, now, entropy)
        case Witness(round_height, participant_bloom, batch_bloom, part):
            rules.witness(state, signer, round_height, participant_bloom, batch_bloom, part)
        case WarmupWitness(participant_bloom, batch_bloom, part):
            rules.warmup_witness(state, signer, participant_bloom, batch_bloom, part)
        case CommitSeed(round_height, commitment):
            reveals.commit_seed(state, signer, round_height, commitment)
        case RevealSeed(round_height, secret):
            reveals.reveal_seed(state, signer, round_height, secret)
        case HealthCheck(target):
            rules.health_check(state, signer, target)
        case CheckpointReport(kind, repo, revision):
            rules.checkpoint(state, signer, kind, repo, revision)
        case Withdraw():
            rules.withdraw(state, signer)
        case _:  # init_coordinator and close_run
            raise MalformedInstruction(f"{ix.NAME} creates or closes a run: it is not applied to a run's state")


TICKS_AFTER = (Witness, HealthCheck, CheckpointReport)
"""Instructions after which the program ticks, as Psyche's do: a proof that completes a quorum moves the
run on in the same transaction."""


def ticks_after(ix: Instruction, phase_before: Phase) -> bool:
    """Whether the program ticks after ``ix``, applied in ``phase_before``: never where the tick could start a round,
    since a round's start elects its witnesses (a sha256 of every client's key, ``derived.election``), a tick's own
    work, sent with a compute-unit request (``onchain.budget``). So a witness proof part or a health check taken in
    RoundWitness does not tick (the round's end, with its crediting and the next election, is due then), nor does a
    warmup proof (its quorum starts the first round on the next tick): one instruction holding both would overrun
    the default budget, and only a tick then ever needs a request, so no client has to foresee which of its proof
    parts will complete a quorum (a part's transaction, 1,157 of 1,232 bytes at 1,024 clients, would have room)."""
    if isinstance(ix, Witness | HealthCheck) and phase_before == Phase.RoundWitness:
        return False
    return isinstance(ix, TICKS_AFTER)


def apply_then_tick(state: CoordinatorState, ix: Instruction, signer: bytes, now: int, entropy: int,
                    authorizer: bytes | None = None) -> None:
    """What the on-chain program does: apply, then tick if the instruction is one that ticks after."""
    phase_before = state.phase
    apply(state, ix, signer, now, entropy, authorizer)
    if ticks_after(ix, phase_before):
        try:
            rules.tick(state, now, entropy)
        except NothingToTick:
            pass
