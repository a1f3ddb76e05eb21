"""The model a run names, as this client builds it: the workers' stages and the trainers' data are cut for it,
and ``psyswarm status`` finds the run's workers by its fingerprint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from client.contributor.errors import CannotContribute
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
