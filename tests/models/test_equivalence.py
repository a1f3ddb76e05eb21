"""A tiny Hugging Face model cut into 3 stages and trained through the real pipeline (gRPC StageWorkers, a
PipelineTrainer, a loopback hivemind DHT) gives the same losses and parameters, step after step, as the unsplit
``transformers`` model trained in one process with the same optimizer (``client.pipeline.optim``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from client.models import SUPPORTED_ARCHITECTURES, HFModelSpec
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.optim import OptimizerConfig, StageOptimizer
from client.pipeline.trainer import PipelineTrainer

from .conftest import SyntheticTokens, tiny_spec, wait_until, whole_model

ROUNDS, SAMPLES, MICROBATCH = 3, 10, 4
# Measured on CPU (2026-11-23, 5 steps, every supported family): losses and parameters bit-identical, as the
# stages run the same float32 operations and fp32 activations cross the wire unchanged. The tolerance leaves
# room for summation order on other hardware or thread counts, and no more.
LOSS_RTOL, PARAM_RTOL, PARAM_ATOL = 1e-6, 1e-6, 1e-7


class UnsplitReference:
    """The whole ``transformers`` model in one process, its parameters stepped by one StageOptimizer per stage
    over that stage's tensors: the clipping and AdamW every worker applies, without the transport."""

    def __init__(self, spec: HFModelSpec, stage_keys: dict[str, list[str]]) -> None:
        self.model = whole_model(spec)
        named = dict(self.model.named_parameters())
        self.optimizers = [StageOptimizer(_holder([named[k] for k in keys]), stage, spec.num_stages, OptimizerConfig())
                           for stage, keys in stage_keys.items()]
        self.samples = 0

    def train(self, tokens: torch.Tensor) -> float:
        logits = self.model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (loss * len(tokens)).backward()
        self.samples += len(tokens)
        return float(loss.detach())

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step(self.samples)
        self.samples = 0


def _holder(params: list[nn.Parameter]) -> nn.Module:
    holder = nn.Module()
    holder.params = nn.ParameterList(params)  # the same Parameter objects: stepping them steps the model
    return holder


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_pipeline_trains_a_hf_model_as_one_process_does(architecture, dht, run_id, start_worker) -> None:
    spec = tiny_spec(architecture)
    dataset = SyntheticTokens()
    workers = [start_worker(stage, config=spec) for stage in spec.stage_names()]
    directory = WorkerDirectory(dht, run_id, spec.fingerprint())
    for stage in spec.stage_names():
        wait_until(lambda s=stage: directory.workers(s), what=f"a worker of {stage}")
    # One microbatch at a time: workers then sum gradients in the reference's order, which these tolerances (and
    # AdamW, which scales tiny gradients up to full steps) need; tests/pipeline/test_inflight.py covers many at once.
    trainer = PipelineTrainer(spec, dataset, directory, run_id=run_id, refresh_period=0.5, stall_timeout=30.0,
                              max_inflight=1)
    reference = UnsplitReference(spec, {w.stage: list(w.compute.module.state_dict()) for w in workers})
    full = reference.model.state_dict()
    for worker in workers:  # built apart, from the run's seed alone
        assert all(torch.equal(v, full[k]) for k, v in worker.compute.module.state_dict().items())
    initial = {k: v.clone() for k, v in full.items()}
    try:
        for round_ in range(ROUNDS):
            indices = list(range(100 + SAMPLES * round_, 100 + SAMPLES * (round_ + 1)))
            result = trainer.train(indices, microbatch_size=MICROBATCH)
            expected = [reference.train(dataset.batch(indices[i:i + MICROBATCH]))
                        for i in range(0, SAMPLES, MICROBATCH)]
            assert result.losses == pytest.approx(expected, rel=LOSS_RTOL)
            for worker in workers:
                assert worker.step().samples == SAMPLES
            reference.step()
            full = reference.model.state_dict()
            for worker in workers:
                for key, value in worker.compute.module.state_dict().items():
                    torch.testing.assert_close(value, full[key], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=key)
    finally:
        trainer.close()
    assert all(not torch.equal(initial[k], full[k]) for k in full)  # every tensor trained


def test_token_ids_beyond_a_byte_travel_intact(dht, run_id, start_worker) -> None:
    """A vocabulary larger than 256: the trainer sends int64 ids (uint8 would wrap id 299 to 43)."""
    spec = tiny_spec("llama", vocab_size=300)
    dataset = SyntheticTokens(vocab=300)
    for stage in spec.stage_names():
        start_worker(stage, config=spec)
    directory = WorkerDirectory(dht, run_id, spec.fingerprint())
    for stage in spec.stage_names():
        wait_until(lambda s=stage: directory.workers(s), what=f"a worker of {stage}")
    trainer = PipelineTrainer(spec, dataset, directory, run_id=run_id, refresh_period=0.5, stall_timeout=30.0)
    indices = [i for i in range(200) if int(dataset.sample(i).max()) >= 256][:4]
    indices = list(range(indices[0], indices[0] + 4))  # a microbatch is a consecutive range
    assert int(dataset.batch(indices).max()) >= 256
    try:
        result = trainer.train(indices, microbatch_size=4)
    finally:
        trainer.close()
    expected = UnsplitReference(spec, {}).train(dataset.batch(indices))
    assert result.losses == pytest.approx([expected], rel=LOSS_RTOL)
