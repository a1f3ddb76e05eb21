"""The model a run names, as this client builds it: the workers' stages and the trainers' data are cut for it,
and ``psyswarm status`` finds the run's workers by its fingerprint; and the run's dataset, which trainers train on
and the head and tail check their tokens against (``client.pipeline.datacheck``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from client.contributor.context import RunnerOptions
from client.contributor.errors import CannotContribute
from client.data import SampleDataset, TokenizerMismatch, open_dataset
from client.models import ModelSourceError
from client.models.sources import BYTE_MODEL, model_spec_for
from client.pipeline.model import ModelConfig, ModelSpec
from coordinator_program.spec.state import CoordinatorState


def model_config(state: CoordinatorState, *, hf_endpoint: str | None = None,
                 hf_token: str | None = None) -> ModelSpec:
    """The model a run's state describes, as the pipeline builds it: the embedded byte-level model, or a Hugging
    Face causal LM whose config.json is read from its source and checked against the run's digest."""
    m = state.model
    if m.architecture != BYTE_MODEL:
        return model_spec_for(state, endpoint=hf_endpoint, token=hf_token)
    return ModelConfig(n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads, seq_len=m.seq_len,
                       num_stages=state.config.num_stages, seed=m.init_seed)


@contextlib.contextmanager
def building_the_model() -> Iterator[None]:
    """Turn a model the run names but this client cannot build (its source gone, its config changed) into
    ``CannotContribute``: asking again would build the same nothing."""
    try:
        yield
    except ModelSourceError as exc:
        raise CannotContribute(f"cannot build the run's model: {exc}") from None


def run_dataset(state: CoordinatorState, config: ModelSpec, options: RunnerOptions) -> SampleDataset:
    """The run's dataset as pinned (``Model.dataset_sha256``), cut for ``config``; ``CannotContribute`` naming the
    problem when this machine cannot open it."""
    m = state.model
    try:
        return open_dataset(m.dataset, config.seq_len, tokenizer_sha256=m.tokenizer_sha256,
                            dataset_sha256=m.dataset_sha256, max_bytes=options.max_dataset_bytes,
                            hf_endpoint=options.hf_endpoint, hf_token=options.hf_token)
    except TokenizerMismatch as exc:
        raise CannotContribute(f"the run's dataset does not fit its model: {exc}") from None
    except ValueError as exc:
        raise CannotContribute(f"cannot open the run's dataset: {exc}; trainers and the head's and tail's workers "
                               "need the run's data at that path on this machine (or join as a worker of a body "
                               "stage, which needs none)") from None
