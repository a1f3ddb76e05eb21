"""Figures of the coordinator specification at full capacity (1,024 clients, 32 witnesses).

Run: python tests/benchmarks/spec_figures.py
Prints the account size (against Psyche's 119,160 bytes), the witness proof part's instruction and transaction
sizes, the largest max_clients whose part filters (a participant and a compute key per client of a part) fit a
witness transaction at the default error rate, the bloom false-positive rate at a full part (predicted, and
measured over 100,000 random non-members), and the time the specification takes per tick and per round. The run
state holds 1,024 clients (the account's capacity).
"""

from __future__ import annotations

import random
import time

from coordinator_program.facts import config_facts
from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.bloom import build_filter, compute_key, contains_raw, participant_key, proof_parts
from coordinator_program.spec.config import (
    DEFAULT_BLOOM_ERROR_RATE,
    Checkpoint,
    Config,
    Model,
    bloom_params,
    filter_capacity,
    largest_max_clients,
    predicted_false_positive_rate,
)
from coordinator_program.spec.state import ACCOUNT_SIZE, Phase, Role, encode_state

PSYCHE_ACCOUNT_BYTES = 119_160
AUTHORITY = b"\xaa" * 32


def full_config() -> Config:
    slices, bits = bloom_params(filter_capacity(limits.MAX_CLIENTS), DEFAULT_BLOOM_ERROR_RATE)
    return Config(min_clients=limits.MAX_WITNESSES, max_clients=limits.MAX_CLIENTS, witness_nodes=limits.MAX_WITNESSES,
                  witness_quorum=22, num_stages=4, bloom_slices=slices, bloom_bits_per_slice=bits,
                  rounds_per_epoch=10_000, total_steps=100_000, global_batch_size=1024)


def full_run(config: Config) -> rules.CoordinatorState:
    state = rules.init_coordinator("bench", AUTHORITY, bytes(32), now=0)
    rules.update(state, AUTHORITY, config, Model(n_layers=4), Checkpoint())
    rules.set_paused(state, AUTHORITY, False)
    rules.tick(state, 0, 1)
    rng = random.Random(0)
    for i in range(limits.MAX_CLIENTS):
        who = rng.randbytes(32)
        rules.join(state, who, "bench", Role.Worker if i % 2 else Role.Trainer, limits.NO_STAGE, who)
    rules.tick(state, 0, 2)
    rules.tick(state, config.warmup_time, 3)
    assert state.phase == Phase.RoundTrain and len(state.clients) == limits.MAX_CLIENTS
    return state


def per_call(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    config = full_config()
    facts = config_facts(config)
    print(f"account size at {limits.MAX_CLIENTS} clients: {ACCOUNT_SIZE:,} bytes "
          f"({ACCOUNT_SIZE / PSYCHE_ACCOUNT_BYTES:.1%} of Psyche's {PSYCHE_ACCOUNT_BYTES:,})")
    print(f"witness filter: {config.bloom_slices} slices x {config.bloom_bits_per_slice} bits = "
          f"{facts.bloom_bytes} bytes")
    print(f"witness proof: {facts.witness_parts} parts; a part's instruction data: {facts.witness_data_bytes} bytes; "
          f"as a signed transaction: {facts.witness_transaction_bytes} of {limits.SOLANA_TX_LIMIT} bytes")

    largest = largest_max_clients(DEFAULT_BLOOM_ERROR_RATE)
    print(f"largest max_clients whose part filters fit at error rate {DEFAULT_BLOOM_ERROR_RATE}: {largest} "
          f"({filter_capacity(largest)} keys a part)")
    rng = random.Random(42)
    ids = [rng.randbytes(32) for _ in range(filter_capacity(largest) // 2)]
    raw = build_filter(config, [participant_key(i) for i in ids] + [compute_key(i) for i in ids])
    probes = 100_000
    hits = sum(contains_raw(raw, participant_key(rng.randbytes(32)), config.bloom_slices,
                            config.bloom_bits_per_slice) for _ in range(probes))
    predicted = predicted_false_positive_rate(config, filter_capacity(largest))
    print(f"bloom false-positive rate at capacity: predicted {predicted:.4%}, "
          f"measured {hits / probes:.4%} over {probes:,} non-members")

    state = full_run(config)
    everyone = [c.id for c in state.clients]
    parts = proof_parts(config, everyone, everyone, everyone, {})
    witnesses = derived.witnesses(state)

    def witness_round() -> None:
        for w in witnesses:
            for part, (participants, batches) in enumerate(parts):
                rules.witness(state, w, state.round.height, participants, batches, part)
        rules.tick(state, state.phase_start, 5)  # quorum: RoundTrain -> RoundWitness
        while state.phase == Phase.RoundWitness:  # a tick for every 128 clients credited -> next RoundTrain
            rules.tick(state, state.phase_start + config.round_witness_time, 6)

    rounds = 5
    start = time.perf_counter()
    for _ in range(rounds):
        witness_round()
        witnesses[:] = derived.witnesses(state)
    elapsed = (time.perf_counter() - start) / rounds
    tick_time = per_call(lambda: _noop_tick(state), 200)
    print(f"spec at {limits.MAX_CLIENTS} clients: a full round (32 proofs of {len(parts)} parts, 9 ticks, points "
          "credited) "
          f"{elapsed * 1e3:.2f} ms; "
          f"a tick with nothing due {tick_time * 1e6:.1f} us; encoding the account "
          f"{per_call(lambda: encode_state(state), 50) * 1e3:.2f} ms")


def _noop_tick(state: rules.CoordinatorState) -> None:
    try:
        rules.tick(state, state.phase_start, 7)
    except rules.NothingToTick:
        pass


if __name__ == "__main__":
    main()
