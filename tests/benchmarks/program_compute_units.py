"""Compute units of every coordinator instruction at 1, 64, 256 and 1,024 clients, and the account's rent.

Run from the repository root: ``python -m tests.benchmarks.program_compute_units``. It drives the committed program
in LiteSVM through the conformance harness (so every measured call is also checked against the specification) and
prints, for each instruction, the units of its costliest path at each run size: the last join of a permissioned run
(scanning every member for its key and for the slot its countersignature names), a witness proof part (it tallies
its 128 clients' participant and compute keys; the quorum's last part ticks), a commitment to the next seed and its
reveal in RoundTrain (each reads its signer's place in the round's stored election; the reveal also checks that
every witness has committed), a health check (it reads one count), each tick that ends a round (crediting 128
clients' points a tick; one run crediting into a ledger full of strangers, each of a tick's 4 new entries displacing
one; the first round's last tick removes a witness that committed and withheld its reveal, and elects the next
round's witnesses, a sha256 of every client's key), the tick that admits every joiner (and elects the warmup's), the
checkpoint that ends cooldown and requeues every client. Every join commits to a secret, as the clients' do, so the
first warmup elects no one until its joiners reveal: each reveal, then the tick that closes the reveals once every
joiner still in has revealed (one withdrew meanwhile: it leaves) and elects the warmup's witnesses; the second
epoch's warmup, all veterans with nothing to reveal, elects as it admits. One client cannot train (a pipeline needs
a worker per stage and a trainer), so the training instructions have no figure at that size. Transactions ask for
compute units as the clients' do (``onchain.budget``): a tick asks for ``TICK_UNITS``, every other instruction for
none, so it must stay within the default 200,000. Every filter names every client present and working (the costliest
tally)."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections import defaultdict

from solders.keypair import Keypair

from coordinator_program.onchain.budget import DEFAULT_UNITS, TICK_UNITS
from coordinator_program.onchain.instance import INSTANCE_SIZE
from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.beacon import join_commitment, seed_commitment
from coordinator_program.spec.bloom import proof_parts
from coordinator_program.spec.config import Checkpoint, CheckpointKind, Config, Model, bloom_params, filter_capacity
from coordinator_program.spec.instructions import (
    CheckpointReport,
    CommitSeed,
    HealthCheck,
    Instruction,
    JoinRun,
    RevealSeed,
    SetPaused,
    Tick,
    Update,
    WarmupWitness,
    Withdraw,
    Witness,
)
from coordinator_program.spec.state import ACCOUNT_SIZE, Health, LedgerEntry, Phase, Role
from tests.program.coordinator_chain import ProgramChain, Replay, key
from tests.spec.test_properties import join_secret

SIZES = (1, 64, 256, limits.MAX_CLIENTS)


def config_for(clients: int) -> Config:
    witnesses = min(limits.MAX_WITNESSES, clients)
    slices, bits = bloom_params(filter_capacity(limits.MAX_CLIENTS), 0.0009)
    return Config(min_clients=max(5, witnesses), max_clients=limits.MAX_CLIENTS, witness_nodes=witnesses,
                  witness_quorum=max(1, witnesses * 2 // 3), num_stages=4, bloom_slices=slices,
                  bloom_bits_per_slice=bits, warmup_time=30, max_round_train_time=60, round_witness_time=5,
                  cooldown_time=30, rounds_per_epoch=2, total_steps=100, global_batch_size=1024)


class Bench:
    """Runs one size and records the units of each labelled call (the largest, when called repeatedly)."""

    def __init__(self, clients: int, table: dict[str, dict[int, int]]) -> None:
        self.clients, self.table = clients, table
        self.authority = Keypair()
        self.gate = Keypair()  # the join authority: each join names a slot, and the slot check scans every member
        chain = ProgramChain()
        chain.fund(self.gate)
        self.replay = Replay(chain, self.authority, f"bench-{clients}", join_authority=key(self.gate))
        self.record("init_coordinator")
        self.members: dict[bytes, Keypair] = {}

    def record(self, label: str) -> None:
        row = self.table[label]
        row[self.clients] = max(row.get(self.clients, 0), self.replay.units)

    def call(self, label: str | None, ix: Instruction, signer: Keypair, advance: int = 0) -> int | None:
        code = self.replay.apply(ix, signer, self.gate if isinstance(ix, JoinRun) else None, advance=advance)
        if code is None and label is not None:
            self.record(label)
        return code

    def of(self, identity: bytes) -> Keypair:
        return self.members[identity]

    @property
    def state(self) -> rules.CoordinatorState:
        return self.replay.state

    def prove(self, label: str | None, participants: list[bytes], witnesses: int = limits.MAX_WITNESSES) -> None:
        """The first ``witnesses`` healthy elected witnesses send every part of a proof naming ``participants``."""
        parts = proof_parts(self.state.config, [c.id for c in self.state.clients], participants, participants, {})
        warmup = self.state.phase == Phase.Warmup
        height = self.state.round.height
        ixs = [WarmupWitness(p, b, i) if warmup else Witness(height, p, b, i) for i, (p, b) in enumerate(parts)]
        healthy = {c.id for c in self.state.clients if c.health == Health.Healthy}
        for witness in [w for w in derived.witnesses(self.state) if w in healthy][:witnesses]:
            for ix in ixs:
                self.call(label, ix, self.of(witness))

    def commit_all(self) -> list[tuple[bytes, bytes]]:
        """A quorum of the elected witnesses commits to secrets for the next seed, which closes the commitments;
        returns (witness, secret) pairs."""
        committers = derived.witnesses(self.state)[:derived.quorum(self.state)]
        pairs = [(w, hashlib.sha256(b"secret" + w).digest()) for w in committers]
        seed, height = self.state.round.seed, self.state.round.height
        for witness, secret in pairs:
            commitment = seed_commitment(witness, seed, secret)
            label = "commit_seed (reads its slot twice, still open)"
            self.call(label, CommitSeed(height, commitment), self.of(witness))
        return pairs

    def join(self, slot: int, member: bytes) -> JoinRun:
        """A join countersigned for ``slot``, valid for a minute (a trainer every eighth slot), committing to the
        member's secret for its warmup as every client's join does."""
        role = Role.Trainer if slot % 8 == 7 else Role.Worker
        commitment = join_commitment(member, join_secret(member))
        return JoinRun(self.state.run_id, role, limits.NO_STAGE, slot, self.replay.now + 60, commitment)

    def end_round(self, label: str) -> None:
        """Tick through the end of a round: a tick for every 128 clients credited (more for a full ledger)."""
        config = self.state.config
        self.call(label, Tick(), self.authority, advance=config.round_witness_time)
        while self.state.phase == Phase.RoundWitness:
            self.call(label, Tick(), self.authority)

    def run(self) -> None:
        config, authority = config_for(self.clients), self.authority
        self.call("update", Update(config, Model(n_layers=4), Checkpoint()), authority)
        self.call("set_paused", SetPaused(False), authority)
        self.call("tick: Paused → WaitingForMembers", Tick(), authority)
        keypairs = [Keypair.from_seed(hashlib.sha256(b"bench %d" % i).digest()) for i in range(self.clients)]
        self.replay.chain.fund(*keypairs)
        self.members = {key(kp): kp for kp in keypairs}
        for slot, kp in enumerate(keypairs):
            self.call("join_run (the last joiner, naming its slot)", self.join(slot, key(kp)), kp)
        self.call("withdraw (the first joiner)", Withdraw(), keypairs[0])
        self.call(None, self.join(0, key(keypairs[0])), keypairs[0])
        if self.clients < config.min_clients:
            return
        self.call("tick: WaitingForMembers → Warmup (admits joiners)", Tick(), authority, advance=1)
        quitter = self.state.clients[-2].id  # a worker: the pipeline stays whole without it
        self.call(None, Withdraw(), self.of(quitter))
        for client in [c.id for c in self.state.clients if c.id != quitter]:
            label = "reveal_seed (a joiner's, in the warmup)"
            self.call(label, RevealSeed(0, join_secret(client)), self.of(client))
        self.call("tick: Warmup closes the reveals (one leaves; elects)", Tick(), authority)
        assert quitter not in [c.id for c in self.state.clients] and derived.witnesses(self.state)
        self.prove("warmup_witness (a part)", [c.id for c in self.state.clients])
        self.call("tick: Warmup → RoundTrain (quorum; elects)", Tick(), authority)
        lazy = [c.id for c in self.state.clients if c.id not in derived.witnesses(self.state)][:2]
        for witness, secret in self.commit_all()[:-1]:  # in RoundTrain, the commitments closed; the last withholds
            self.call("reveal_seed (reads its slot, opens the commitment)", RevealSeed(0, secret), self.of(witness))
        self.prove("witness (a part; the quorum's last ticks)", [c.id for c in self.state.clients if c.id not in lazy])
        strangers = [LedgerEntry(b"\xfe" + i.to_bytes(2, "big") + bytes(29), 10**6, 0)
                     for i in range(limits.MAX_CLIENTS)]
        self.replay.load(dataclasses.replace(self.state, ledger=strangers))  # the costliest crediting: evictions
        self.end_round("tick: RoundWitness ends (credits 128 clients a tick)")  # the last removes the withholder
        assert self.state.phase == Phase.RoundTrain
        checker = next(c.id for c in self.state.clients if c.id not in lazy)
        self.call("health_check (reads one count)", HealthCheck(lazy[0]), self.of(checker))
        self.call("withdraw (a client)", Withdraw(), self.of(lazy[1]))
        self.prove(None, [c.id for c in self.state.clients], witnesses=1)  # short of the quorum: the epoch ends
        self.call("tick: RoundTrain → RoundWitness", Tick(), authority, advance=config.max_round_train_time)
        self.end_round("tick: RoundWitness ends (credits 128 clients a tick)")
        assert self.state.phase == Phase.Cooldown
        savers = {c.stage: c.id for c in self.state.clients if c.role == Role.Worker}
        for stage in range(config.num_stages):
            report = CheckpointReport(CheckpointKind.Hub, "org/model", "step-2")
            self.call("checkpoint (the last ends Cooldown, requeues all)", report, self.of(savers[stage]))
        self.call("tick: WaitingForMembers → Warmup (admits veterans; elects)", Tick(), authority, advance=1)
        self.call(None, Withdraw(), self.of(self.state.clients[0].id))
        self.call("tick: Warmup drops a client", Tick(), authority)
        self.call("tick: Warmup → RoundTrain (time)", Tick(), authority, advance=config.warmup_time)
        self.call(None, Tick(), authority, advance=config.max_round_train_time)
        self.end_round("tick: RoundWitness ends (no proof: all leave)")
        assert self.state.clients == []



def print_largest(table: dict[str, dict[int, int]]) -> None:
    """The costliest tick against what a tick asks for, and the costliest other instruction against the default."""
    ticks = [units for label, row in table.items() if label.startswith("tick") for units in row.values()]
    others = [units for label, row in table.items() if not label.startswith("tick") for units in row.values()]
    print(f"largest tick: {max(ticks):,} CU (it asks for {TICK_UNITS:,}: onchain.budget)")
    print(f"largest other instruction: {max(others):,} CU (budget {DEFAULT_UNITS:,}, no compute-unit request)")


def main() -> int:
    table: dict[str, dict[int, int]] = defaultdict(dict)
    for clients in SIZES:
        Bench(clients, table).run()
    print(f"{'instruction (costliest path)':<60}" + "".join(f"{n:>12,} cl." for n in SIZES))
    for label, row in table.items():
        cells = "".join(f"{row[n]:>16,}" if n in row else f"{'n/a':>16}" for n in SIZES)
        print(f"{label:<60}{cells}")
    print()
    print_largest(table)
    chain = ProgramChain()
    for name, size in (("coordinator account", ACCOUNT_SIZE), ("instance account", INSTANCE_SIZE)):
        rent = chain.svm.minimum_balance_for_rent_exemption(size)
        print(f"{name}: {size:,} bytes, rent-exempt minimum {rent:,} lamports ({rent / 1e9:.4f} SOL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
