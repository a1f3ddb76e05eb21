"""A replica's Adam on the whole batch's estimated second moment (``client.pipeline.optim.BatchMoment``).

The optimizer is driven with synthetic gradients (a fixed signal plus per-sample noise, independent of the
parameters) so that what the correction does to Adam's steps can be measured against one optimizer on the whole
batch; and through a real ``StageCompute``, whose Backwards feed it."""

from __future__ import annotations

import dataclasses

import torch
from solders.keypair import Keypair
from torch import nn

from client.join.stage_replica import optimizer_config
from client.pipeline.compute import StageCompute
from client.pipeline.optim import OptimizerConfig, StageOptimizer
from client.receipts import ReceiptRound, SignedReceipt
from tests.join.test_stage_replica import run_state
from tests.pipeline.conftest import TINY, signed_request

DIM = 64
WHOLE = 16  # samples in the whole batch
MICRO = 2  # samples per microbatch
LR = 1e-3


def optimizer(whole_batch: int = 0) -> StageOptimizer:
    """One tensor of ``DIM`` parameters, as the tail of a one-stage model (its clip, 5, is never reached here)."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(DIM))
    return StageOptimizer(module, "tail", 1, OptimizerConfig(lr=LR, weight_decay=0.0, whole_batch=whole_batch))


def samples(generator: torch.Generator, count: int, noise: float) -> torch.Tensor:
    """Per-sample gradients: the signal 0.01 in every element plus ``noise`` × N(0, 1)."""
    return 0.01 + noise * torch.randn(count, DIM, generator=generator)


def step(opt: StageOptimizer, grads: torch.Tensor) -> None:
    """Accumulate ``grads`` (one row per sample) microbatch by microbatch, as Backwards do, then step."""
    param = opt.params[0]
    for start in range(0, len(grads), MICRO):
        contribution = grads[start:start + MICRO].sum(0)
        param.grad = contribution.clone() if param.grad is None else param.grad + contribution
        opt.observe([contribution], MICRO)
    opt.step(len(grads))


def progress(opt: StageOptimizer, before: torch.Tensor) -> float:
    """How far the parameters moved against the signal."""
    return float((before - opt.params[0].detach()).sum())


def test_a_half_batch_replica_steps_like_the_whole_batch_where_noise_dominates() -> None:
    """Where each sample's gradient is mostly noise, a replica stepping Adam on half the batch takes steps about
    1/√2 of the whole batch's (its second moment is about twice as large). Estimating the whole batch's second
    moment from the spread of its own microbatches brings them back to the whole batch's size."""
    whole, half, corrected = optimizer(), optimizer(), optimizer(whole_batch=WHOLE)
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        batch = samples(generator, WHOLE, noise=0.2)
        step(whole, batch)
        step(half, batch[: WHOLE // 2])
        step(corrected, batch[: WHOLE // 2])
    zero = torch.zeros(DIM)
    ratio_half = progress(half, zero) / progress(whole, zero)
    ratio_corrected = progress(corrected, zero) / progress(whole, zero)
    assert ratio_half < 0.8, "half the batch: smaller steps"
    assert abs(ratio_corrected - 1) < 0.15, f"the whole batch's steps, within 15%: {ratio_corrected:.3f}"
    assert abs(ratio_corrected - 1) < abs(ratio_half - 1) / 2


def test_adam_is_unchanged_on_the_whole_batch_or_without_noise() -> None:
    """A replica holding the whole batch has no noise to remove (its share is 1), and microbatches that agree
    show none: either way it steps exactly as Adam."""
    generator = torch.Generator().manual_seed(1)
    plain, whole = optimizer(), optimizer(whole_batch=WHOLE)
    for _ in range(20):
        batch = samples(generator, WHOLE, noise=0.2)
        step(plain, batch)
        step(whole, batch)
    assert torch.equal(plain.params[0], whole.params[0])

    plain, agreeing = optimizer(), optimizer(whole_batch=WHOLE)
    for _ in range(20):
        batch = samples(generator, 1, noise=0.2).expand(WHOLE // 2, DIM)  # every sample alike
        step(plain, batch)
        step(agreeing, batch)
    assert torch.allclose(plain.params[0], agreeing.params[0], rtol=0, atol=1e-9)


def test_the_correction_is_each_step_s_alone_and_adam_s_state_stays_its_own() -> None:
    """Adam's second moment after a corrected step is what Adam alone would hold: the state that checkpoints,
    digests and joiners see is the standard one."""
    generator = torch.Generator().manual_seed(2)
    plain, corrected = optimizer(), optimizer(whole_batch=WHOLE)
    for _ in range(30):
        batch = samples(generator, WHOLE // 2, noise=0.2)
        step(plain, batch)
        step(corrected, batch)
    moments = [o.optimizer.state[o.params[0]]["exp_avg_sq"] for o in (plain, corrected)]
    assert torch.allclose(*moments, rtol=1e-5, atol=0)
    assert not torch.allclose(plain.params[0], corrected.params[0], rtol=1e-3, atol=0)  # and yet its steps differ


def test_microbatches_that_disagree_on_purpose_enlarge_a_step_by_at_most_one_over_root_share() -> None:
    """A trainer sends a worker holding half the batch microbatches that disagree by a hundred times the signal, to
    inflate the measured noise: the worker takes out at most what half a batch can add, so each of its steps is at
    most √2 times Adam's own on the same gradients, and close to it."""
    generator = torch.Generator().manual_seed(4)
    plain, corrected = optimizer(), optimizer(whole_batch=WHOLE)
    ratios = []
    for _ in range(60):
        signs = torch.tensor([1.0, -1.0]).repeat(WHOLE // 4).unsqueeze(1)  # alternate microbatches pull apart
        batch = 0.01 + signs * torch.rand(WHOLE // 2, DIM, generator=generator)
        before = [o.params[0].detach().clone() for o in (plain, corrected)]
        step(plain, batch)
        step(corrected, batch)
        moved = [float((o.params[0] - b).norm()) for o, b in zip((plain, corrected), before, strict=True)]
        ratios.append(moved[1] / moved[0])
        corrected.params[0].data.copy_(plain.params[0])  # the same parameters each step: compare single steps
    assert max(ratios) <= 2 ** 0.5 * (1 + 1e-4)
    assert max(ratios) > 1.3, "the inflated noise did take the step up to its cap"


def test_a_worker_feeds_its_backwards_to_the_correction_as_the_run_asks() -> None:
    """A run's ``whole_batch_moment`` gives each worker the run's global batch as its whole batch; the worker's
    Backwards are the microbatches the correction measures, so from its second step (the first with a second
    moment) its steps are larger than a worker's without it, on the same Backwards."""
    state = run_state("run", 0)
    assert optimizer_config(state).whole_batch == 0
    moment = dataclasses.replace(state, model=dataclasses.replace(state.model, whole_batch_moment=True))
    assert optimizer_config(moment).whole_batch == state.config.global_batch_size

    trainer, worker = Keypair(), Keypair()
    computes = [StageCompute(TINY, "body1", OptimizerConfig(whole_batch=whole), uid="body1.0.0", run_id="run",
                             max_batch_size=2, signer=worker) for whole in (0, 8)]
    generator = torch.Generator().manual_seed(3)
    moved = []
    for _ in range(2):
        before = [[p.detach().clone() for p in c.parameters()] for c in computes]
        for start in (0, 2):  # two Backwards of two samples: a quarter of the whole batch of 8
            x = torch.randn(2, TINY.seq_len, TINY.d_model, generator=generator)
            g = torch.randn(2, TINY.seq_len, TINY.d_model, generator=generator)
            for compute in computes:
                request = compute.parse(signed_request(trainer, "body1", "Backward", {"input": x, "grad_output": g},
                                                       run_id="run", start=start, worker=bytes(worker.pubkey())),
                                        backward=True)
                compute.backward(request, lambda work: SignedReceipt.sign(worker, work, ReceiptRound("run", 0, 0)))
        assert computes[1].optimizer.moment is not None and computes[1].optimizer.moment.microbatches == 2
        for compute in computes:
            compute.step()
        moved.append([sum(float((p - b).norm()) for p, b in zip(c.parameters(), was, strict=True))
                      for c, was in zip(computes, before, strict=True)])
    assert moved[0][0] == moved[0][1], "no second moment yet: the first step is Adam's"
    assert moved[1][1] > moved[1][0], "then the noise of a quarter batch is taken out: larger steps"
