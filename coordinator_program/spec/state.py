"""The coordinator's state and its account layout.

One dataclass tree holds everything the coordinator knows; ``ACCOUNT_LAYOUT`` fixes how it is laid out in
the Solana account (after Anchor's 8-byte account discriminator) and in the TCP server's broadcasts. Lists
of clients and pending joiners are Python lists here and fixed arrays with a count on the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib

from coordinator_program.spec import limits
from coordinator_program.spec.beacon import NO_COMMITMENT
from coordinator_program.spec.config import (
    CHECKPOINT_LAYOUT,
    CONFIG_LAYOUT,
    MODEL_LAYOUT,
    Checkpoint,
    Config,
    Model,
)
from coordinator_program.spec.layout import (
    BOOL,
    I64,
    PUBKEY,
    U8,
    U16,
    U32,
    U64,
    Array,
    Enum8,
    FixedBytes,
    FixedStr,
    LayoutError,
    Struct,
)
from coordinator_program.spec.layout import Field as F


class Phase(enum.IntEnum):
    """The coordinator's run state (the seed's phases, plus the states around a run's life)."""

    Uninitialized = 0
    WaitingForMembers = 1
    Warmup = 2
    RoundTrain = 3
    RoundWitness = 4
    Cooldown = 5
    Finished = 6
    Paused = 7


class Role(enum.IntEnum):
    """A worker holds one pipeline stage's parameters; a trainer routes data through the stages."""

    Worker = 0
    Trainer = 1


class Health(enum.IntEnum):
    """Unhealthy and withdrawn clients stay listed until the round ends, then leave the epoch."""

    Healthy = 0
    Unhealthy = 1
    Withdrawn = 2


HASH = FixedBytes(32)
"""A SHA-256 digest, or a secret of as many bytes."""


@dataclasses.dataclass
class Client:
    """An admitted member of the current epoch; a ``veteran`` was a client of the last round of the epoch before
    (``derived.election``); ``commitment`` is the one it joined with until it reveals its secret in the warmup
    (``beacon``), all zeros after."""

    id: bytes
    role: Role
    stage: int
    health: Health = Health.Healthy
    slot: int = limits.NO_SLOT
    veteran: bool = False
    commitment: bytes = NO_COMMITMENT


CLIENT_LAYOUT = Struct(Client, [
    F("id", PUBKEY), F("role", Enum8(Role)), F("stage", U8), F("slot", U16), F("veteran", BOOL),
    F("commitment", HASH), F("health", Enum8(Health)),
], doc="An admitted client; stage is 255 for trainers, slot 65535 for a joiner no join authority placed; a joiner's "
       "commitment to its secret until it reveals it in the warmup (zeros after, or for none).")


@dataclasses.dataclass
class Pending:
    """A joiner waiting for the next WaitingForMembers; stage 255 lets the coordinator choose. ``slot`` is the
    join authority's slot the joiner holds (``limits.NO_SLOT`` in a permissionless run); ``commitment`` is to the
    secret it reveals in its first warmup (``beacon.join_commitment``)."""

    id: bytes
    role: Role
    stage: int
    slot: int = limits.NO_SLOT
    veteran: bool = False  # a client of the last round of the epoch before, queued again at its end
    commitment: bytes = NO_COMMITMENT


PENDING_LAYOUT = Struct(Pending, [F("id", PUBKEY), F("role", Enum8(Role)), F("stage", U8), F("slot", U16),
                                  F("veteran", BOOL), F("commitment", HASH)],
                        doc="A joiner waiting for admission; stage 255 means 'any', slot 65535 'none'; its "
                            "commitment to the secret it reveals in the warmup (zeros for none). A client's "
                            "prefix: admission copies it.")


@dataclasses.dataclass
class LedgerEntry:
    """A contributor's points: rounds the witnesses saw it in, and samples of counted work it did."""

    id: bytes
    presence: int = 0
    compute: int = 0

    @property
    def total(self) -> int:
        return self.presence + self.compute


LEDGER_ENTRY_LAYOUT = Struct(LedgerEntry, [F("id", PUBKEY), F("presence", U32), F("compute", U32)],
                             doc="A contributor's points: presence (rounds seen) and compute (samples worked).")


def no_checkpoints() -> list[Checkpoint]:
    """Every stage fresh: a run before its first ``update``."""
    return [Checkpoint()] * limits.MAX_STAGES


def no_votes() -> list[int]:
    return [0] * limits.MAX_CLIENTS


def no_parts() -> list[int]:
    return [0] * limits.MAX_WITNESSES


def no_witnesses() -> list[int]:
    return [0] * limits.MAX_WITNESSES


def unelected() -> list[int]:
    """The seats of a warmup still waiting for its joiners' reveals (``reveals.revealing``)."""
    return [limits.UNELECTED] * limits.MAX_WITNESSES


def no_commitments() -> list[bytes]:
    return [bytes(32)] * limits.MAX_WITNESSES


@dataclasses.dataclass
class Round:
    """One round (or the epoch's warmup): its seed decides witnesses and data. A witness's proof comes in parts,
    one per ``limits.PART_CLIENTS`` clients: ``parts[i]`` has bit p set once the witness elected i-th sent part p,
    and ``witnessed`` has bit i set once it sent them all, so a partial proof never counts as a whole one.
    ``credited`` is how many of the round's clients its end has credited with points so far. ``witnesses`` holds the
    client indices of its elected witnesses in slot order (zeros past them), chosen once when the round's clients and
    seed are set (``selection.elect_witnesses``), so that no instruction ranks every client again.

    The seed of the next round (``beacon``): ``commitments[i]`` is what the witness elected i-th committed to, bit i of
    ``committed`` set once it did and of ``revealed`` once it opened it; ``reveals`` is the XOR of the secrets
    opened so far."""

    height: int = 0
    seed: int = 0
    data_index: int = 0
    witnessed: int = 0
    parts: list[int] = dataclasses.field(default_factory=no_parts)
    credited: int = 0
    commitments: list[bytes] = dataclasses.field(default_factory=no_commitments)
    committed: int = 0
    revealed: int = 0
    reveals: bytes = bytes(32)
    witnesses: list[int] = dataclasses.field(default_factory=no_witnesses)

    @property
    def witness_count(self) -> int:
        return self.witnessed.bit_count()

    def part_proofs(self, part: int) -> int:
        """How many witnesses sent part ``part`` of their proof."""
        return sum(mask >> part & 1 for mask in self.parts)


ROUND_LAYOUT = Struct(Round, [
    F("height", U32), F("seed", U64), F("data_index", U64), F("witnessed", U32),
    F("parts", Array(U32, limits.MAX_WITNESSES)), F("credited", U16),
    F("commitments", Array(HASH, limits.MAX_WITNESSES)), F("committed", U32), F("revealed", U32),
    F("reveals", HASH), F("witnesses", Array(U16, limits.MAX_WITNESSES)),
], doc="A round: height in the epoch, seed, first sample index, whole proofs, parts per witness, clients credited, "
       "the witnesses' commitments to the next seed, which of them committed and revealed, the XOR of the "
       "secrets revealed, and the elected witnesses' client indices in slot order.")


@dataclasses.dataclass
class CoordinatorState:
    """The whole coordinator: what the Solana account and the TCP server's broadcasts hold."""

    run_id: str
    main_authority: bytes
    join_authority: bytes
    created_at: int = 0
    nonce: int = 0
    phase: Phase = Phase.Uninitialized
    pause_requested: bool = True
    phase_start: int = 0
    epoch: int = 0
    step: int = 0
    round: Round = dataclasses.field(default_factory=Round)
    checkpoints: list[Checkpoint] = dataclasses.field(default_factory=no_checkpoints)
    config: Config = dataclasses.field(default_factory=lambda: CONFIG_LAYOUT.zero())
    model: Model = dataclasses.field(default_factory=lambda: MODEL_LAYOUT.zero())
    clients: list[Client] = dataclasses.field(default_factory=list)
    pending: list[Pending] = dataclasses.field(default_factory=list)
    presence_votes: list[int] = dataclasses.field(default_factory=no_votes)
    compute_votes: list[int] = dataclasses.field(default_factory=no_votes)
    left_out: list[int] = dataclasses.field(default_factory=no_votes)
    ledger: list[LedgerEntry] = dataclasses.field(default_factory=list)

    def client_index(self, client_id: bytes) -> int | None:
        for i, client in enumerate(self.clients):
            if client.id == client_id:
                return i
        return None

    def pending_index(self, client_id: bytes) -> int | None:
        for i, joiner in enumerate(self.pending):
            if joiner.id == client_id:
                return i
        return None

    def points(self, client_id: bytes) -> LedgerEntry | None:
        """The ledger entry of ``client_id``, if it has earned points the ledger still holds."""
        return next((entry for entry in self.ledger if entry.id == client_id), None)


ACCOUNT_NAME = "CoordinatorAccount"
ACCOUNT_DISCRIMINATOR = hashlib.sha256(f"account:{ACCOUNT_NAME}".encode()).digest()[:8]

ACCOUNT_LAYOUT = Struct(CoordinatorState, [
    F("nonce", U64, doc="bumped by every change"),
    F("run_id", FixedStr(limits.RUN_ID_BYTES)),
    F("main_authority", PUBKEY),
    F("join_authority", PUBKEY),
    F("created_at", I64, doc="the backend's clock when the run was created: with the run id and the main authority "
      "it names this run apart from any earlier run of the same id"),
    F("phase", Enum8(Phase)),
    F("pause_requested", BOOL),
    F("phase_start", I64),
    F("epoch", U32),
    F("step", U32),
    F("round", ROUND_LAYOUT, doc="the current round, or the epoch's warmup"),
    F("checkpoints", Array(CHECKPOINT_LAYOUT, limits.MAX_STAGES),
      doc="per stage: where its joiners get its parameters; only the stage's own workers report its place"),
    F("config", CONFIG_LAYOUT),
    F("model", MODEL_LAYOUT),
    F("num_clients", U16, count_of="clients"),
    F("clients", Array(CLIENT_LAYOUT, limits.MAX_CLIENTS)),
    F("num_pending", U16, count_of="pending"),
    F("pending", Array(PENDING_LAYOUT, limits.MAX_CLIENTS)),
    F("presence_votes", Array(U8, limits.MAX_CLIENTS),
      doc="per client index: the current round's proofs whose participant filter holds its participant key"),
    F("compute_votes", Array(U8, limits.MAX_CLIENTS),
      doc="per client index: the current round's proofs whose participant filter holds its compute key"),
    F("left_out", Array(U8, limits.MAX_CLIENTS),
      doc="per client index: the previous round's proofs of its part whose participant filter left it out"),
    F("num_ledger", U16, count_of="ledger"),
    F("ledger", Array(LEDGER_ENTRY_LAYOUT, limits.MAX_CLIENTS), doc="points earned, sorted by id"),
], doc="The coordinator of one run.")

ACCOUNT_SIZE = 8 + (ACCOUNT_LAYOUT.size or 0)
"""Bytes of the Solana account: Anchor's discriminator, then the fixed layout."""


def encode_state(state: CoordinatorState) -> bytes:
    """The account bytes of ``state``, discriminator included."""
    return ACCOUNT_DISCRIMINATOR + ACCOUNT_LAYOUT.pack(state)


def decode_state(data: bytes) -> CoordinatorState:
    """Parse account bytes; anything but a well-formed coordinator account raises ``LayoutError``."""
    if data[:8] != ACCOUNT_DISCRIMINATOR:
        raise LayoutError("not a coordinator account (wrong discriminator)")
    return ACCOUNT_LAYOUT.unpack(data[8:])
