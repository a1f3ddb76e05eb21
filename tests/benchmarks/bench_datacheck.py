"""Benchmark: what checking a trainer's tokens against the run's dataset costs the head, per microbatch.

A head serves each microbatch twice, a Forward and a Backward, and checks the tokens of both
(``client.pipeline.datacheck``): it reads the dataset at the request's samples and compares. This measures, in one
process and interleaved (so both see the same background load), the head's work per microbatch — parsing and
authenticating both signed requests, the forward, the backward with its recomputation — without and with the
check, and prints the ratio checked / unchecked of the medians, and the check's own time (best of 5 × 50 runs)
as a share of an unchecked microbatch: on a shared machine the ratio carries the load's noise, the share does not.
Run::

    python tests/benchmarks/bench_datacheck.py [--microbatch 8] [--microbatches 40]

The model is the default byte-level one (6 layers, d_model 128, seq_len 128, cut in 3 stages) on the stdlib
dataset, the demo's; the check's own cost does not depend on the model, so a larger model makes the ratio smaller.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import torch
from solders.keypair import Keypair

from client.data import open_byte_dataset
from client.pipeline.admission import RequestHeader, encode_request, now_ms
from client.pipeline.compute import StageCompute
from client.pipeline.datacheck import DataCheck
from client.pipeline.messages import tensor_digest
from client.pipeline.model import ModelConfig
from client.pipeline.optim import OptimizerConfig
from client.receipts import ReceiptRound, SignedReceipt

RUN = "bench-datacheck"


def request(keypair: Keypair, kind: str, tensors: dict[str, torch.Tensor], start: int, worker: str) -> bytes:
    header = RequestHeader(run_id=RUN, stage="head", kind=kind, trainer=bytes(keypair.pubkey()).hex(), worker=worker,
                           microbatch_id=uuid.uuid4().hex[:12], sample_start=start,
                           sample_end=start + int(tensors["input"].shape[0]), dtype="float32", issued_at=now_ms(),
                           digests={name: tensor_digest(t) for name, t in tensors.items()})
    return encode_request(keypair, header, tensors)


def head_microbatch(compute: StageCompute, check: DataCheck | None, keypair: Keypair, dataset, start: int,
                    size: int) -> float:
    """Seconds the head spends on one microbatch: its Forward and its Backward, each parsed (and checked)."""
    tokens = dataset.batch(list(range(start, start + size)))[:, :-1].to(torch.uint8)
    grad = torch.randn(size, compute.config.seq_len, compute.config.d_model)
    forward = request(keypair, "forward", {"input": tokens}, start, compute.key)
    backward = request(keypair, "backward", {"input": tokens, "grad_output": grad}, start, compute.key)
    began = time.perf_counter()
    parsed = compute.parse(forward, backward=False)
    if check is not None:
        check.check(parsed)
    compute.forward(parsed)
    parsed = compute.parse(backward, backward=True)
    if check is not None:
        check.check(parsed)
    compute.backward(parsed, lambda work: SignedReceipt.sign(compute.signer, work, ReceiptRound(RUN, 0, 0)))
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatch", type=int, default=8, help="samples per microbatch (the run's default: 8)")
    parser.add_argument("--microbatches", type=int, default=40, help="microbatches measured each way")
    args = parser.parse_args()
    config = ModelConfig()
    dataset = open_byte_dataset(["stdlib"], config.seq_len)
    compute = StageCompute(config, "head", OptimizerConfig(), uid="head.0", run_id=RUN, max_batch_size=32,
                           signer=Keypair())
    check = DataCheck(dataset, config.vocab, "head")
    keypair = Keypair()
    head_microbatch(compute, check, keypair, dataset, 0, args.microbatch)  # warm up
    times: dict[bool, list[float]] = {False: [], True: []}
    start = args.microbatch
    for _ in range(args.microbatches):
        for checked in (False, True):  # interleaved microbatch by microbatch: both see the same load
            times[checked].append(head_microbatch(compute, check if checked else None, keypair, dataset, start,
                                                  args.microbatch))
            start += args.microbatch
        compute.optimizer.optimizer.zero_grad(set_to_none=True)
        compute.samples_accumulated = 0
    best = {checked: statistics.median(found) for checked, found in times.items()}
    check_alone = min(_time_check(check, compute, keypair, dataset, args.microbatch) for _ in range(5))
    print(f"head, microbatch of {args.microbatch} x {config.seq_len} tokens (torch threads {torch.get_num_threads()})")
    print(f"  unchecked: {best[False] * 1e3:8.2f} ms per microbatch (Forward + Backward, median)")
    print(f"  checked:   {best[True] * 1e3:8.2f} ms per microbatch (median)")
    print(f"  ratio checked / unchecked: {best[True] / best[False]:.4f}")
    share = check_alone / best[False]
    print(f"  the two checks alone: {check_alone * 1e3:.3f} ms, {share:.2%} of an unchecked microbatch")


def _time_check(check: DataCheck, compute: StageCompute, keypair: Keypair, dataset, size: int) -> float:
    """Seconds of the check alone for one microbatch's two requests (the mean of 50)."""
    tokens = dataset.batch(list(range(size)))[:, :-1].to(torch.uint8)
    parsed = compute.parse(request(keypair, "forward", {"input": tokens}, 0, compute.key), backward=False)
    began = time.perf_counter()
    for _ in range(50):
        check.check(parsed)
        check.check(parsed)
    return (time.perf_counter() - began) / 50


if __name__ == "__main__":
    main()
