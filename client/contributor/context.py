"""What the contributor's roles share: the options it was started with, its identity, and its links to the run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from solders.keypair import Keypair

from client.backends.base import Backend
from client.contributor.tasks import TaskSet
from client.data import DEFAULT_MAX_DATASET_BYTES
from client.join.auth import AuthSession
from client.join.checkpoints import SNAPSHOT_EVERY
from client.witness.records import Board
from coordinator_program.spec import limits
from coordinator_program.spec.state import CoordinatorState, Role

if TYPE_CHECKING:
    import hivemind


@dataclasses.dataclass
class RunnerOptions:
    """How this client was started (``psyswarm join-run``'s options): its role, the run's DHT, where it listens,
    saves and computes."""

    role: Role
    initial_peers: list[str]
    stage: int = limits.NO_STAGE
    checkpoint_dir: Path = Path("checkpoints")
    host: str = "127.0.0.1"
    public_host: str | None = None  # where peers reach this client, if not at host (``pipeline.addresses``)
    hub_repo: str | None = None  # save checkpoints to this Hugging Face repo rather than checkpoint_dir
    hf_token: str | None = None
    hf_endpoint: str | None = None
    auth: AuthSession | None = None  # the slot granted by the run's auth service, if it has one
    snapshot_every: int = SNAPSHOT_EVERY  # steps between a worker's snapshots of its stage (0: none)
    port: int = 0  # the worker's gRPC port (0: any free one)
    dht_port: int = 0  # this client's DHT node's port (0: any free one)
    device: str = "cpu"  # where a worker's stage computes (``client.pipeline.device``)
    max_inflight: int | None = None  # a trainer's microbatches in flight (None: measured, ``pipeline.inflight``)
    max_dataset_bytes: int = DEFAULT_MAX_DATASET_BYTES  # the most a trainer downloads of the run's dataset
    check_rate: float = 0.05  # the share of a trainer's microbatches asked of a second replica (``pipeline.checks``)
    check_tolerance: float = 0.0  # how close two replicas' answers must be (0: identical digests)


@dataclasses.dataclass
class ClientContext:
    """The run as every role reaches it. The runner owns it: it replaces ``backend`` when it reconnects to the
    coordinator, and sets ``dht`` and ``board`` once its DHT node is up; roles read them when they act, never
    keep them."""

    backend: Backend
    keypair: Keypair
    options: RunnerOptions
    tasks: TaskSet
    dht: hivemind.DHT | None = None
    board: Board | None = None  # the run's signed records in the DHT
    me: bytes = dataclasses.field(init=False)  # this client's public key

    def __post_init__(self) -> None:
        self.me = bytes(self.keypair.pubkey())

    @property
    def state(self) -> CoordinatorState:
        """The coordinator's state as last seen."""
        return self.backend.state
