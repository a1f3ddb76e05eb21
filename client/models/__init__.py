"""What a run can train: Hugging Face causal LMs cut into pipeline stages.

``HFModelSpec`` describes a ``transformers`` decoder-only causal LM (its ``config.json``, the cut into stages,
the run's seed and where its weights come from) and builds one stage of it on its own: the stage allocates
only the tensors it holds, names them as the whole model does, and computes positions and the causal mask
itself so that only hidden states cross the network. ``sources`` finds a model's ``config.json`` and tokenizer
(a Hub repo at a revision, a local directory, or a config alone for a fresh initialisation) and checks them
against the digests the run names on chain; ``weights`` reads a stage's tensors from the source's safetensors.

Layered bottom up, with no import running back: ``init`` and ``weights``; ``spec``; ``stages``; ``sources``
and ``export``.

Heavy libraries (transformers, huggingface_hub, safetensors) are imported where they are used, so that
importing this package stays cheap for the byte-level model that does not need them.

May import: client.stages, client.data.
"""

from client.models.init import parameter_stream, split_layers
from client.models.sources import (
    load_source,
    model_spec_for,
    read_config,
    resolve_model_digests,
    tokenizer_digest,
)
from client.models.spec import SUPPORTED_ARCHITECTURES, HFModelSpec, config_digest
from client.models.weights import ModelSourceError, WeightSource

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "HFModelSpec",
    "ModelSourceError",
    "WeightSource",
    "config_digest",
    "load_source",
    "model_spec_for",
    "parameter_stream",
    "read_config",
    "resolve_model_digests",
    "split_layers",
    "tokenizer_digest",
]
