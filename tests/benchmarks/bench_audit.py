"""Benchmark: what signed reductions and audits (``client/averaging/audit.py``) add to a gradient round, against the
round's own work measured in the same process.

For a stage of ``--params`` float32 parameters averaged by k peers in parts of ``stage_averager.PART_BYTES``, prints
per peer and round:

- CPU: the hashing, signing and checking each peer does as sender and as reducer (hash and sign its parts, check
  every input's signature to its shard, sign a statement per part, check the statement of every part it gets back),
  against the robust reduction of its shard (block by block), which the round does anyway;
- bytes: signatures and statements, and the expected audits at ``AUDIT_RATE`` (k inputs of one part per other
  reducer audited), against what the all-reduce itself moves (its k − 1 shares of the vector, out and back).

Run::

    python tests/benchmarks/bench_audit.py [--params 670000] [--senders 2 3 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from solders.keypair import Keypair

from client.averaging import audit
from client.averaging.auditor import AUDIT_RATE
from client.averaging.stage_averager import PART_BYTES
from client.averaging.values import GradValues


def one_round(params: int, k: int) -> tuple[float, float, int]:
    """Seconds of audit work and of robust reduction one peer does in a round of ``k``, and its audit bytes."""
    parts = max(1, params // k // (PART_BYTES // 4))  # the parts of this peer's shard
    size = PART_BYTES // 4
    keys = [Keypair() for _ in range(k)]
    generator = torch.Generator().manual_seed(k)
    inputs = [[torch.randn(size, generator=generator) for _ in range(parts)] for _ in range(k)]
    checking = reduce = 0.0
    statement_bytes = 0
    for index in range(parts):
        place = audit.Place("run.body1.grad", b"group", b"reducer", index)
        started = time.perf_counter()
        entries = [audit.signed_entry(keys[s], place, inputs[s][index], 4.0) for s in range(k)]  # as senders, k of them
        checking += time.perf_counter() - started  # over the loop: this peer's parts to each of the k reducers
        started = time.perf_counter()
        result = audit.reduce_blocks([inputs[s][index] for s in range(k)], [4.0] * k)
        reduce += time.perf_counter() - started
        started = time.perf_counter()
        assert all(audit.part_digest(inputs[s][index]) == e.digest and e.holds(place)  # the reducer checks every input
                   for s, e in enumerate(entries))
        statement = audit.make_statement(keys[0], place, entries, result, GradValues.FLOAT32)
        data = statement.to_bytes()
        checking += time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(k - 1):  # as a sender, this peer checks one part from each other reducer
            back = audit.Statement.from_bytes(data)
            assert audit.statement_refusal(back, place, bytes(keys[0].pubkey()), result, entries[1],
                                           GradValues.FLOAT32) == ""
            assert not audit.forged(back, place)
        checking += time.perf_counter() - started
        statement_bytes += len(data) * (k - 1) + 64 * (k - 1)  # statements back, signatures out
    audited = AUDIT_RATE * (k - 1) * k * PART_BYTES  # expected: k inputs of one part per audited reducer
    return checking, reduce, int(statement_bytes + audited)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=670_000)
    parser.add_argument("--senders", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.params:,} parameters, parts of {PART_BYTES // 4:,} float32, audit rate {AUDIT_RATE}")
    print("| k | audit CPU / round | robust reduction / round | ratio | audit bytes / round | all-reduce bytes "
          "/ round | ratio |")
    print("|---|---|---|---|---|---|---|")
    for k in args.senders:
        runs = [one_round(args.params, k) for _ in range(args.repeats)]
        checking, reduce, extra = min(runs)  # the least disturbed run on a shared machine
        moved = 2 * args.params * 4 * (k - 1) // k
        print(f"| {k} | {checking * 1e3:.1f} ms | {reduce * 1e3:.1f} ms | {checking / reduce:.2f} | {extra:,} B | "
              f"{moved:,} B | {extra / moved:.3f} |")


if __name__ == "__main__":
    main()
