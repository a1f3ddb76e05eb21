"""A run of 1,024 clients on both backends: what it costs on chain, on the wire and in a witness's judgement.

Run from the repository root: ``python -m tests.benchmarks.bench_scale [--skip-program] [--followers 1024]``.

It prints, each from a real component:
- the compute units of every coordinator instruction at 64, 256 and 1,024 clients: the committed program in
  LiteSVM driven through a whole epoch by the conformance harness (``program_compute_units``: every call is also
  checked byte for byte against the specification), the witnesses sending real proofs part by part;
- the transactions and bytes of one witness's proof at each size, and the account's size and rent;
- the TCP server's broadcast to 1,024 followers (``bench_broadcast``: ``psyswarm serve`` in a subprocess, each
  follower a real authenticated connection applying the state patches, in two processes apart from the meter):
  p50/p99 from a join to every follower holding the new state, the server's CPU per change, and bytes per follower
  per change;
- a witness's judgement of a round of 1,024 clients (768 workers, 256 trainers committing signed records with their
  receipts, every worker reporting signed): the seconds ``judge_round`` and the proof's parts take, against the
  round's witness time;
- the bloom filters' false-positive rate at a full part's capacity, measured over 400,000 probes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict

from hivemind.utils.serializer import MSGPackSerializer
from solders.keypair import Keypair

from client.witness.judge import judge_round
from client.witness.records import Board, Commitment, Report
from coordinator_program.facts import config_facts
from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.bloom import build_filter, contains_raw, part_count, participant_key
from coordinator_program.spec.config import Config, bloom_params, filter_capacity, predicted_false_positive_rate
from coordinator_program.spec.state import ACCOUNT_SIZE, CoordinatorState, Phase, Role
from tests.benchmarks import bench_broadcast, program_compute_units
from tests.program.coordinator_chain import ProgramChain
from tests.spec.scenario import new_run
from tests.witness.rounds import MICROBATCH, STAGES, hash_of, receipt, uid_of

SIZES = (64, 256, limits.MAX_CLIENTS)
WITNESS_TIME = 30
"""Seconds of RoundWitness the judged run allows (psyswarm's default run spec uses ``round_witness_time`` 30 on
real networks); a witness's judgement must fit well within it."""


def program_figures() -> None:
    table: dict[str, dict[int, int]] = defaultdict(dict)
    for clients in SIZES:
        started = time.perf_counter()
        program_compute_units.Bench(clients, table).run()
        print(f"  (the epoch of {clients:,} clients replayed in {time.perf_counter() - started:.0f} s)", flush=True)
    print(f"{'instruction (costliest path)':<56}" + "".join(f"{n:>10,} cl." for n in SIZES))
    for label, row in table.items():
        print(f"{label:<56}" + "".join(f"{row[n]:>14,}" if n in row else f"{'n/a':>14}" for n in SIZES))
    program_compute_units.print_largest(table)


def proof_and_account_figures() -> None:
    for clients in SIZES:
        facts = config_facts(program_compute_units.config_for(clients))
        parts = part_count(clients)
        print(f"witness proof at {clients:,} clients: {parts} transaction(s) of {facts.witness_transaction_bytes} "
              f"bytes ({parts * facts.witness_transaction_bytes:,} bytes; limit {limits.SOLANA_TX_LIMIT} each)")
    rent = ProgramChain().svm.minimum_balance_for_rent_exemption(ACCOUNT_SIZE)
    print(f"coordinator account: {ACCOUNT_SIZE:,} bytes, rent-exempt minimum {rent:,} lamports ({rent / 1e9:.4f} SOL)")


def judged_round(workers_per_stage: int, trainers: int) -> tuple[CoordinatorState, dict, dict]:
    """A run in RoundTrain with real keys, and the signed records of an honest round: each trainer commits its share
    with one receipt per microbatch and stage, issued by the stage's workers in turn; every worker reports."""
    config = Config(min_clients=32, max_clients=limits.MAX_CLIENTS, witness_nodes=32, witness_quorum=22,
                    num_stages=len(STAGES), global_batch_size=4 * trainers, round_witness_time=WITNESS_TIME,
                    **dict(zip(("bloom_slices", "bloom_bits_per_slice"),
                               bloom_params(filter_capacity(limits.MAX_CLIENTS), 0.0009), strict=True)))
    state = new_run(config)
    keys: dict[bytes, Keypair] = {}
    for stage in range(len(STAGES)):
        for _ in range(workers_per_stage):
            key = Keypair()
            keys[bytes(key.pubkey())] = key
            rules.join(state, bytes(key.pubkey()), state.run_id, Role.Worker, stage, bytes(key.pubkey()))
    for _ in range(trainers):
        key = Keypair()
        keys[bytes(key.pubkey())] = key
        rules.join(state, bytes(key.pubkey()), state.run_id, Role.Trainer, limits.NO_STAGE, bytes(key.pubkey()))
    rules.tick(state, 0, 5)
    rules.tick(state, config.warmup_time, 6)
    assert state.phase == Phase.RoundTrain and len(state.clients) == len(keys)
    by_stage = [[c.id for c in state.clients if c.role == Role.Worker and c.stage == s] for s in range(len(STAGES))]
    uid = {w: uid_of(w, s) for s, ws in enumerate(by_stage) for w in ws}
    issued: dict[bytes, list[str]] = {w: [] for ws in by_stage for w in ws}
    commitments = {}
    for t, share in enumerate(s for s in derived.data_assignment(state) if s.size):
        receipts = []
        for start in range(share.start, share.end, MICROBATCH):
            for stage_workers in by_stage:
                worker = stage_workers[t % len(stage_workers)]
                r = receipt(state, keys, share.client, worker, start, min(start + MICROBATCH, share.end))
                receipts.append(r)
                issued[worker].append(hash_of(r))
        commitments[share.client.hex()] = Commitment.create(
            keys[share.client], run_id=state.run_id, epoch=state.epoch, round=state.round.height, start=share.start,
            end=share.end, loss=4.2, tokens=share.size * state.model.seq_len, receipts=tuple(receipts))
    stage_of = {w: s for s, ws in enumerate(by_stage) for w in ws}
    reports = {w.hex(): Report.create(keys[w], run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                                      stage=stage_of[w], uid=uid[w], receipts=tuple(hashes))
               for w, hashes in issued.items()}
    return state, commitments, reports


def judge_figures() -> None:
    trainers = limits.MAX_CLIENTS // 4
    state, commitments, reports = judged_round((limits.MAX_CLIENTS - trainers) // len(STAGES), trainers)
    started = time.perf_counter()
    evidence = judge_round(state, commitments, reports)
    judged = time.perf_counter()
    parts = evidence.filters(state)
    done = time.perf_counter()
    assert evidence.complete and len(evidence.participants) == len(state.clients), evidence.why_missing
    print(f"judge: a round of {len(state.clients):,} clients ({len(commitments)} signed commitments, "
          f"{len(reports)} signed reports): judge_round {judged - started:.2f} s + {len(parts)} proof parts "
          f"{done - judged:.2f} s = {done - started:.2f} s of the round's {WITNESS_TIME} s witness time")
    # Where the DHT traffic goes: each kind of a round's records spreads over one key per proof part
    # (``Board``), one sealed subkey per author under the key its own key names; the peers nearest each key store
    # its authors' records and serve them to each of the round's witnesses.
    board = Board(None, state)
    witnesses = state.config.witness_nodes
    total = 0
    for kind, records in (("Commitment", commitments), ("Report", reports)):
        per_key: dict[int, int] = defaultdict(int)
        for author, record in records.items():
            per_key[board.shard_of(author)] += len(MSGPackSerializer.dumps(record.to_value()))
        total += sum(per_key.values())
        print(f"DHT per round: {len(records)} {kind} records, {sum(per_key.values()):,} bytes over "
              f"{len(per_key)} keys, {max(per_key.values()):,} bytes under the fullest")
    print(f"  {witnesses} witnesses each read every key: {witnesses * total / 1e6:.1f} MB a round, "
          f"{board.shards} keys of each kind fetched at once")


def false_positive_figures(filters: int = 10, probes: int = 40_000) -> None:
    capacity = filter_capacity(limits.MAX_CLIENTS)
    slices, bits = bloom_params(capacity, 0.0009)
    config = Config(max_clients=limits.MAX_CLIENTS, bloom_slices=slices, bloom_bits_per_slice=bits)
    rng = random.Random(22)
    hits = 0
    for _ in range(filters):
        raw = build_filter(config, [participant_key(rng.randbytes(32)) for _ in range(capacity)])
        hits += sum(contains_raw(raw, participant_key(rng.randbytes(32)), slices, bits) for _ in range(probes))
    print(f"bloom false positives at a full part ({capacity} keys, {slices} slices x {bits} bits): measured "
          f"{hits / (filters * probes):.4%} over {filters * probes:,} probes, predicted "
          f"{predicted_false_positive_rate(config, capacity):.4%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-program", action="store_true", help="leave out the program's epochs (minutes)")
    parser.add_argument("--followers", type=int, default=limits.MAX_CLIENTS)
    args = parser.parse_args()
    false_positive_figures()
    proof_and_account_figures()
    judge_figures()
    bench_broadcast.run(args.followers)
    if not args.skip_program:
        program_figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
