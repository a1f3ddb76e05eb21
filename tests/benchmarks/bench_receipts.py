"""Benchmark: what signing each Backward's receipt costs a worker, and verifying one costs a witness.

Run from the repository root: ``python -m tests.benchmarks.bench_receipts``.

In one process, a real ``StageCompute`` (the tiny test model's body1, a batch of 2 × 16 tokens: the cheapest
Backward the tests run) answers Backwards in turn with its receipt signed by the worker's key and with it unsigned,
interleaved so that both see the same machine load; then one receipt is signed and verified (through its JSON form,
as a witness reads it) many times. Prints the medians and the signature's share of the Backward.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from solders.keypair import Keypair

from client.pipeline.compute import StageCompute
from client.pipeline.optim import OptimizerConfig
from client.receipts import Receipt, ReceiptRound, SignedReceipt
from tests.pipeline.conftest import TINY, signed_request

ROUNDS = 200


def main() -> None:
    trainer, worker, round_ = Keypair(), Keypair(), ReceiptRound("psyswarm", 0, 0)
    compute = StageCompute(TINY, "body1", OptimizerConfig(), uid="body1.0.0", run_id="psyswarm", max_batch_size=4,
                           signer=worker)
    x, g = torch.randn(2, TINY.seq_len, TINY.d_model), torch.randn(2, TINY.seq_len, TINY.d_model)

    def unsigned(work: Receipt) -> SignedReceipt:
        return SignedReceipt(**dataclasses.asdict(work), **dataclasses.asdict(round_))

    def signed(work: Receipt) -> SignedReceipt:
        return SignedReceipt.sign(worker, work, round_)

    backward: dict[str, list[float]] = {"unsigned": [], "signed": []}
    work = None
    for i in range(2 * ROUNDS):
        name, sign = ("signed", signed) if i % 2 else ("unsigned", unsigned)
        request = compute.parse(signed_request(trainer, "body1", "Backward", {"input": x, "grad_output": g},
                                               microbatch=f"m{i}", worker=compute.key), backward=True)
        start = time.perf_counter()
        _, receipt = compute.backward(request, sign)
        backward[name].append(time.perf_counter() - start)
        work = receipt.work
    assert work is not None
    signing, verifying = [], []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        made = SignedReceipt.sign(worker, work, round_)
        signing.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert SignedReceipt(**made.to_value()).verifies()
        verifying.append(time.perf_counter() - start)
    plain, with_signature = statistics.median(backward["unsigned"]), statistics.median(backward["signed"])
    sign, verify = statistics.median(signing), statistics.median(verifying)
    print(f"Backward (tiny model body1, batch 2 x {TINY.seq_len}), median of {ROUNDS} each, interleaved: "
          f"{plain * 1e3:.2f} ms with an unsigned receipt, {with_signature * 1e3:.2f} ms with it signed")
    print(f"signing one receipt: {sign * 1e6:.0f} us ({sign / plain:.1%} of that Backward); "
          f"verifying one from its JSON form: {verify * 1e6:.0f} us")


if __name__ == "__main__":
    main()
