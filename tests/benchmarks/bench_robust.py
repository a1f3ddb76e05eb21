"""Benchmark: the robust reduction of one all-reduce part (``client/averaging/robust.py``) against hivemind's
weighted mean, side by side in one process on the same parts.

For k senders of a part of hivemind's default size (2^19 bytes: 131,072 float32), honest parts drawn as a
common signal plus per-worker noise (``--noise`` times the signal's scale, as two workers' gradients or SPARTA
slices differ), prints:

- time per part: the mean (hivemind's reducer) and ``robust_mean``, and their ratio;
- honest groups: the relative distance of ``robust_mean`` from the mean (0 when no part is clipped);
- one liar sending -60x the honest mean with 4x the weight: the cosine of the result with the honest mean and
  its relative error, for the mean and for ``robust_mean``.

Run::

    python tests/benchmarks/bench_robust.py [--senders 2 3 4 8] [--noise 1.0] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from client.averaging.robust import robust_mean

PART = 2**19 // 4


def weighted_mean(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = sum(weights)
    return sum(w * p for p, w in zip(parts, weights, strict=True)) / total


def timed(function, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    signal = torch.randn(PART, generator=generator)
    print(f"part of {PART} float32, noise {args.noise}x the signal, {args.repeats} repeats")
    print("senders | mean ms | robust ms | ratio | honest: robust vs mean | liar: cos mean | cos robust | "
          "err mean | err robust")
    for k in args.senders:
        honest = [signal + args.noise * torch.randn(PART, generator=generator) for _ in range(k - 1)]
        weights = [1.0] * (k - 1)
        truth = weighted_mean(honest, weights)
        everyone = [*honest, signal + args.noise * torch.randn(PART, generator=generator)]
        plain_ms = 1e3 * timed(lambda everyone=everyone, k=k: weighted_mean(everyone, [1.0] * k), args.repeats)
        robust_ms = 1e3 * timed(lambda everyone=everyone, k=k: robust_mean(everyone, [1.0] * k), args.repeats)
        honest_gap = relative(robust_mean(everyone, [1.0] * k), weighted_mean(everyone, [1.0] * k))
        attacked = [*honest, -60.0 * truth]
        attacked_weights = [*weights, 4.0]
        results = [weighted_mean(attacked, attacked_weights), robust_mean(attacked, attacked_weights)]
        cosines = [float(torch.nn.functional.cosine_similarity(r, truth, dim=0)) for r in results]
        errors = [relative(r, truth) for r in results]
        print(f"{k:7d} | {plain_ms:7.2f} | {robust_ms:9.2f} | {robust_ms / plain_ms:5.1f} | {honest_gap:22.2e} | "
              f"{cosines[0]:14.3f} | {cosines[1]:10.3f} | {errors[0]:8.2f} | {errors[1]:10.2f}")


if __name__ == "__main__":
    main()
