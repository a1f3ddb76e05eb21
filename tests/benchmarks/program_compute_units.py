"""Compute units of every coordinator instruction at 1, 64 and 256 clients, and the account's rent.

Run from the repository root: ``python -m tests.benchmarks.program_compute_units``. It drives the committed
program in LiteSVM through the conformance harness (so every measured call is also checked against the
specification) and prints, for each instruction, the units of its costliest path at each run size: the
last join (scanning every member), a witness proof that completes the quorum and ticks (it tallies every
client's participant and compute keys for the points), a health check reading 32 proofs, the tick that ends a
round and credits every client's points into the ledger, the tick that admits every joiner, the checkpoint that
ends cooldown and requeues every client. One client cannot train (a pipeline needs a worker per stage and a
trainer), so the training instructions have no figure at that size. The budget is 200,000 units per instruction
by default: at 256 clients a witness proof needs more, so that size's transactions ask for 1,400,000 with
ComputeBudget's SetComputeUnitLimit, whose own 150 units are included in its figures. Every filter names every
client present and working (the costliest tally).
"""

from __future__ import annotations

import hashlib
import sys
from collections import defaultdict

from solders.keypair import Keypair

from coordinator_program.onchain.instance import INSTANCE_SIZE
from coordinator_program.spec import limits, rules
from coordinator_program.spec.bloom import build_filter, compute_key, participant_key
from coordinator_program.spec.config import Checkpoint, CheckpointKind, Config, Model, bloom_params
from coordinator_program.spec.instructions import (
    CheckpointReport,
    HealthCheck,
    Instruction,
    JoinRun,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
)
from coordinator_program.spec.state import ACCOUNT_SIZE, Health, Phase, Role
from tests.program.coordinator_chain import ProgramChain, Replay, key

SIZES = (1, 64, 128, limits.MAX_CLIENTS)
INSTRUCTION_BUDGET = 200_000
COMPUTE_LIMIT_ABOVE = 128
"""Runs with more clients than this send every transaction with a compute-unit limit of 1,400,000."""


def config_for(clients: int) -> Config:
    witnesses = min(limits.MAX_WITNESSES, clients)
    slices, bits = bloom_params(limits.MAX_CLIENTS, 0.0009)
    return Config(min_clients=max(5, witnesses), max_clients=limits.MAX_CLIENTS, witness_nodes=witnesses,
                  witness_quorum=max(1, witnesses * 2 // 3), num_stages=4, bloom_slices=slices,
                  bloom_bits_per_slice=bits, warmup_time=30, max_round_train_time=60, round_witness_time=5,
                  cooldown_time=30, rounds_per_epoch=2, total_steps=100, global_batch_size=1024)


class Bench:
    """Runs one size and records the units of each labelled call (the largest, when called repeatedly)."""

    def __init__(self, clients: int, table: dict[str, dict[int, int]]) -> None:
        self.clients, self.table = clients, table
        self.authority = Keypair()
        chain = ProgramChain(compute_limit=1_400_000 if clients > COMPUTE_LIMIT_ABOVE else None)
        self.replay = Replay(chain, self.authority, f"bench-{clients}")
        self.record("init_coordinator")
        self.members: dict[bytes, Keypair] = {}

    def record(self, label: str) -> None:
        row = self.table[label]
        row[self.clients] = max(row.get(self.clients, 0), self.replay.units)

    def call(self, label: str | None, ix: Instruction, signer: Keypair, advance: int = 0) -> int | None:
        code = self.replay.apply(ix, signer, advance=advance)
        if code is None and label is not None:
            self.record(label)
        return code

    def of(self, identity: bytes) -> Keypair:
        return self.members[identity]

    @property
    def state(self) -> rules.CoordinatorState:
        return self.replay.state

    def prove(self, label: str | None, participants: list[bytes], witnesses: int = limits.MAX_WITNESSES) -> None:
        """The first ``witnesses`` healthy elected witnesses send a proof naming ``participants``."""
        config = self.state.config
        keys = [participant_key(p) for p in participants] + [compute_key(p) for p in participants]
        bloom = build_filter(config, keys)
        batches = build_filter(config, [])
        warmup = self.state.phase == Phase.Warmup
        ix = WarmupWitness(bloom, batches) if warmup else Witness(self.state.round.height, bloom, batches)
        healthy = {c.id for c in self.state.clients if c.health == Health.Healthy}
        for witness in [w for w in rules.witnesses(self.state) if w in healthy][:witnesses]:
            self.call(label, ix, self.of(witness))

    def run(self) -> None:
        config, authority = config_for(self.clients), self.authority
        self.call("update", Update(config, Model(n_layers=4), Checkpoint()), authority)
        self.call("set_paused", SetPaused(False), authority)
        self.call("tick: Paused → WaitingForMembers", Tick(), authority)
        keypairs = [Keypair.from_seed(hashlib.sha256(b"bench %d" % i).digest()) for i in range(self.clients)]
        self.replay.chain.fund(*keypairs)
        self.members = {key(kp): kp for kp in keypairs}
        for i, kp in enumerate(keypairs):
            self.call("join_run (the last joiner)", JoinRun(self.state.run_id, Role.Trainer if i % 8 == 7
                                                             else Role.Worker), kp)
        self.call("withdraw (the first joiner)", Withdraw(), keypairs[0])
        self.call(None, JoinRun(self.state.run_id, Role.Worker), keypairs[0])
        if self.clients < config.min_clients:
            return
        self.call("tick: WaitingForMembers → Warmup (admits all)", Tick(), authority, advance=1)
        self.prove("warmup_witness (the quorum's proof ticks)", [c.id for c in self.state.clients])
        lazy = [c.id for c in self.state.clients if c.id not in rules.witnesses(self.state)][:2]
        self.prove("witness (the quorum's proof ticks)", [c.id for c in self.state.clients if c.id not in lazy])
        self.call("tick: RoundWitness → RoundTrain (credits all)", Tick(), authority,
                  advance=config.round_witness_time)
        checker = next(c.id for c in self.state.clients if c.id not in lazy)
        self.call("health_check (reads every proof)", HealthCheck(lazy[0]), self.of(checker))
        self.call("withdraw (a client)", Withdraw(), self.of(lazy[1]))
        self.prove(None, [c.id for c in self.state.clients], witnesses=1)  # short of the quorum: the epoch ends
        self.call("tick: RoundTrain → RoundWitness", Tick(), authority, advance=config.max_round_train_time)
        self.call("tick: RoundWitness → Cooldown", Tick(), authority, advance=config.round_witness_time)
        savers = {c.stage: c.id for c in self.state.clients if c.role == Role.Worker}
        for stage in range(config.num_stages):
            report = CheckpointReport(CheckpointKind.Hub, "org/model", "step-2")
            self.call("checkpoint (the last ends Cooldown, requeues all)", report, self.of(savers[stage]))
        self.call("tick: WaitingForMembers → Warmup (admits all)", Tick(), authority, advance=1)
        self.call(None, Withdraw(), self.of(self.state.clients[0].id))
        self.call("tick: Warmup drops a client", Tick(), authority)
        self.call("tick: Warmup → RoundTrain (time)", Tick(), authority, advance=config.warmup_time)
        self.call(None, Tick(), authority, advance=config.max_round_train_time)
        self.call("tick: RoundWitness → Cooldown (no proof: all leave)", Tick(), authority,
                  advance=config.round_witness_time)
        assert self.state.clients == []


def main() -> int:
    table: dict[str, dict[int, int]] = defaultdict(dict)
    for clients in SIZES:
        Bench(clients, table).run()
    print(f"{'instruction (costliest path)':<52}" + "".join(f"{n:>12,} cl." for n in SIZES))
    for label, row in table.items():
        cells = "".join(f"{row[n]:>16,}" if n in row else f"{'n/a':>16}" for n in SIZES)
        print(f"{label:<52}{cells}")
    within = [units for row in table.values() for n, units in row.items() if n <= COMPUTE_LIMIT_ABOVE]
    print(f"\nlargest at up to {COMPUTE_LIMIT_ABOVE} clients: {max(within):,} CU (budget {INSTRUCTION_BUDGET:,})")
    worst = max(units for row in table.values() for units in row.values())
    worst_tick = max(units for label, row in table.items() if label.startswith("tick") for units in row.values())
    print(f"largest: {worst:,} CU (1,400,000 requested above {COMPUTE_LIMIT_ABOVE} clients); "
          f"largest tick: {worst_tick:,} CU "
          "(a round's end credits every client's points: about 400 CU each)")
    chain = ProgramChain()
    for name, size in (("coordinator account", ACCOUNT_SIZE), ("instance account", INSTANCE_SIZE)):
        rent = chain.svm.minimum_balance_for_rent_exemption(size)
        print(f"{name}: {size:,} bytes, rent-exempt minimum {rent:,} lamports ({rent / 1e9:.4f} SOL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
