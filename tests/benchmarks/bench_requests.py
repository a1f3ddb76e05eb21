"""Benchmark: what naming the worker in a signed request costs (``admission.RequestHeader.worker``).

Run from the repository root: ``python -m tests.benchmarks.bench_requests``.

A trainer signs each Forward and Backward over its header, which names the worker it is sent to (that worker's
public key, 64 hex characters) since requests were bound to their worker. In one process, for a body1 Backward
of the default model at the default microbatch (8 samples), this prints the signed header's size and the
request's wire size with the worker field and with it left out (the header as it was signed before), and the
median time of the signature check a worker makes of each form (ed25519 over the canonical header), timed in
pairs so that both see the same machine load, and the median of the pairs' differences; beside it, the worker's
whole ``StageCompute.parse`` of the request (decoding, the tensors' digests, the checks), which the signature
check is part of.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch
from solders.keypair import Keypair

from client.identity import verify
from client.pipeline.admission import DOMAIN, RequestHeader, encode_request, now_ms
from client.pipeline.compute import StageCompute
from client.pipeline.messages import decode_message, encode_message, tensor_digest
from client.pipeline.model import ModelConfig
from client.pipeline.optim import OptimizerConfig
from coordinator_program.spec.config import Model

REPEATS = 20000


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def paired(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float, float]:
    """Medians of ``first``'s and ``second``'s times and of their difference, timed in pairs, taking turns at going
    first, so that both see the same load at the same moments."""
    a, b = [], []
    for i in range(REPEATS):
        if i % 2:
            a.append(seconds(first))
            b.append(seconds(second))
        else:
            b.append(seconds(second))
            a.append(seconds(first))
    return statistics.median(a), statistics.median(b), statistics.median(y - x for x, y in zip(a, b, strict=True))


def main() -> None:
    config, micro = ModelConfig(), Model().microbatch_size
    trainer, worker = Keypair(), Keypair()
    compute = StageCompute(config, "body1", OptimizerConfig(), uid="body1.0.0", run_id="bench", max_batch_size=micro,
                           signer=worker)
    tensors = {"input": torch.randn(micro, config.seq_len, config.d_model),
               "grad_output": torch.randn(micro, config.seq_len, config.d_model)}
    header = RequestHeader(run_id="bench", stage="body1", kind="backward", trainer=bytes(trainer.pubkey()).hex(),
                           worker=compute.key, microbatch_id="0123456789ab/17", sample_start=136, sample_end=144,
                           dtype="float32", issued_at=now_ms(),
                           digests={name: tensor_digest(t) for name, t in tensors.items()})
    request = encode_request(trainer, header, tensors)
    signed = header.message()
    fields = {"domain": DOMAIN, **dataclasses.asdict(header)}
    del fields["worker"]
    unbound = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()  # the header as signed before
    meta, decoded = decode_message(request, max_elements=1 << 30)
    old_meta = {k: v for k, v in meta.items() if k != "worker"}
    old_meta["signature"] = bytes(trainer.sign_message(unbound)).hex()
    old_request = encode_message(old_meta, decoded)  # type: ignore[arg-type]
    key, signatures = bytes(trainer.pubkey()), {m: bytes(trainer.sign_message(m)) for m in (signed, unbound)}
    assert verify(key, signed, signatures[signed]) and verify(key, unbound, signatures[unbound])
    a, b, more = paired(lambda: verify(key, unbound, signatures[unbound]),
                        lambda: verify(key, signed, signatures[signed]))
    parse = statistics.median(seconds(lambda: compute.parse(request, backward=True)) for _ in range(200))
    print(f"body1 Backward of {micro} samples (d_model {config.d_model}, seq_len {config.seq_len}): signed header "
          f"{len(unbound)} B without the worker, {len(signed)} B with it (+{len(signed) - len(unbound)} B); request "
          f"{len(old_request)} B without, {len(request)} B with (+{len(request) - len(old_request)} B)")
    print(f"signature check, medians of {REPEATS} in pairs: {a * 1e6:.1f} us without the worker, {b * 1e6:.1f} us "
          f"with it (paired difference {more * 1e6:+.1f} us); the worker's whole parse of the request: "
          f"{parse * 1e3:.2f} ms (median of 200)")


if __name__ == "__main__":
    main()
