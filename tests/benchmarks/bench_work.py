"""Benchmark: what proving a gradient round's weight with signed Backward headers costs (``client.averaging.work``).

Run from the repository root: ``python -m tests.benchmarks.bench_work``.

At the run's default settings (a global batch of 32 samples in microbatches of 8: 4 Backwards per stage and
round) a worker's declaration carries the trainer-signed headers of the Backwards it accumulated. In one
process this prints, for a worker that did 2 of the round's 4 Backwards (a stage of two or three workers) and
for the largest evidence a round admits (32 one-sample Backwards): the declaration's size as hivemind gathers
it (msgpack), with the evidence and without, and the median time of a groupmate's whole check of it
(``membership.check``: roster, seal, and the evidence's signatures), with and without the work rule,
interleaved so that both see the same machine load. A group's peer checks each groupmate's declaration once
(its leader twice: when the groupmate joins and when the group forms).
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable

from hivemind.utils.serializer import MSGPackSerializer
from solders.keypair import Keypair

from client.averaging.membership import Membership, Roster, check, seal
from client.averaging.work import WorkRule, evidence
from client.pipeline.admission import RequestHeader, now_ms
from coordinator_program.spec.config import Config, Model

REPEATS = 300


def backwards(trainer: Keypair, worker: Keypair, run_id: str, stage: str, count: int,
              size: int) -> list[tuple[RequestHeader, str]]:
    """``count`` Backwards of ``size`` samples each, as a trainer signs them for ``worker`` (its microbatch ids,
    two digests)."""
    session = uuid.uuid4().hex[:12]
    work = []
    for i in range(count):
        header = RequestHeader(run_id=run_id, stage=stage, kind="backward", trainer=bytes(trainer.pubkey()).hex(),
                               worker=bytes(worker.pubkey()).hex(), microbatch_id=f"{session}/{i}",
                               sample_start=i * size, sample_end=(i + 1) * size, dtype="float32", issued_at=now_ms(),
                               digests={"input": uuid.uuid4().hex * 2, "grad_output": uuid.uuid4().hex * 2})
        work.append((header, bytes(trainer.sign_message(header.message())).hex()))
    return work


def median_seconds(run: Callable[..., object], *args: object) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    batch, micro = Config().global_batch_size, Model().microbatch_size
    run_id, stage, prefix, peer = "psyswarm-bench", "body1", "psyswarm-bench_body1_grad", b"\x01" * 38
    trainer, worker = Keypair(), Keypair()
    roster = Roster(0, frozenset({bytes(worker.pubkey())}), frozenset({bytes(trainer.pubkey())}))
    membership = Membership(worker, lambda: roster)
    rule = WorkRule(run_id, stage, batch)
    print(f"default settings: global batch {batch}, microbatch {micro} ({batch // micro} Backwards per stage and "
          f"round); median of {REPEATS} checks each")
    for label, count, size in [(f"{batch // micro // 2} Backwards of {micro}", batch // micro // 2, micro),
                               (f"the bound, {batch} Backwards of 1", batch, 1)]:
        work = backwards(trainer, worker, run_id, stage, count, size)
        plain = {"round": 0, "weight": float(count * size), "norm": 1.0, "q": "", "work": []}
        proved = {**plain, "work": evidence(work)}
        sealed_plain, sealed_proved = (seal(membership, prefix, peer, 0, body) for body in (plain, proved))
        sizes = [len(MSGPackSerializer.dumps(d)) for d in (sealed_plain, sealed_proved)]
        assert check(sealed_proved, prefix, peer, roster, 0, batch, rule).weight == count * size
        without, with_work = [], []
        for _ in range(3):  # interleaved
            without.append(median_seconds(check, sealed_plain, prefix, peer, roster, 0, batch))
            with_work.append(median_seconds(check, sealed_proved, prefix, peer, roster, 0, batch, rule))
        a, b = statistics.median(without), statistics.median(with_work)
        print(f"{label}: declaration {sizes[0]} B without evidence, {sizes[1]} B with (+{sizes[1] - sizes[0]} B, "
              f"{(sizes[1] - sizes[0]) / count:.0f} B per Backward); check {a * 1e3:.3f} ms without the work rule, "
              f"{b * 1e3:.3f} ms with ({b / a:.1f}x, +{(b - a) * 1e3:.3f} ms per groupmate and round)")


if __name__ == "__main__":
    main()
