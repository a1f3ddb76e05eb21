"""Where a run's model comes from: a Hub repo at a revision, a local directory, or a ``config.json`` alone.

The run names its model on chain by ``source`` (a Hub repo id ``org/name``, or a local directory starting
with ``/``, ``./``, ``../`` or ``~``), ``source_revision`` and the sha256 of its ``config.json`` in canonical
form (``config_digest``), plus the sha256 of its ``tokenizer.json`` when it uses the model's own tokenizer.
Every client reads the config from the source and refuses one whose digest differs from the run's: a source
can change under a mutable revision, and a model with another shape would train garbage without an error.

Weights come from the source (``weights``); a source with no weights means a fresh initialisation from the
run's seed, identical on every machine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol, TypeVar

from client.data import DatasetError, tokenizer_sha256
from client.models.spec import HFModelSpec, config_digest
from client.models.weights import (
    CONFIG_FILE,
    TOKENIZER_EXTRAS,
    TOKENIZER_FILE,
    ModelSourceError,
    WeightSource,
    is_local,
)

BYTE_MODEL = "psyswarm"  # the architecture name of the embedded byte-level model, which has no source
ZERO_DIGEST = bytes(32)


class ModelDescription(Protocol):
    """The on-chain fields of a run's model this module reads (``coordinator_program.spec.config.Model``)."""

    architecture: str
    source: str
    source_revision: str
    config_sha256: bytes
    tokenizer: int  # 0: bytes, 1: the source's own tokenizer (coordinator_program.spec.config.Tokenizer)
    tokenizer_sha256: bytes
    seq_len: int
    init_seed: int


Described = TypeVar("Described", bound=ModelDescription)


def tokenizer_digest(directory: Path) -> bytes:
    """sha256 of the source's ``tokenizer.json``: the digest datasets name their tokenizer by
    (``client.data.tokenizer_sha256``), so a dataset and a model agree on what the same tokenizer is."""
    try:
        return tokenizer_sha256(directory)
    except (DatasetError, OSError) as exc:
        raise ModelSourceError(f"the model's tokenizer in {directory} cannot be read ({exc})") from None


def load_source(source: str, revision: str | None = None, *, endpoint: str | None = None,
                token: str | None = None, cache_dir: Path | None = None) -> Path:
    """A local directory holding the source's ``config.json`` (and its tokenizer files, where it has them)."""
    if not source:
        raise ModelSourceError("the model names no source")
    where = WeightSource(source, revision or None, endpoint, token, cache_dir)
    config = where.fetch(CONFIG_FILE)
    if config is None:
        raise ModelSourceError(f"{where.identity()} holds no {CONFIG_FILE}")
    if not is_local(source):
        for name in (TOKENIZER_FILE, *TOKENIZER_EXTRAS):
            where.fetch(name)
    return config.parent


def read_config(directory: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a source directory (a JSON object)."""
    path = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelSourceError(f"{path} is not a readable JSON file ({exc})") from None
    if not isinstance(config, dict):
        raise ModelSourceError(f"{path} must hold a JSON object")
    return config


def describe(model: ModelDescription) -> str:
    """``model source org/name@revision`` (or the directory), for error messages."""
    return f"model source {WeightSource(model.source, model.source_revision or None).identity()}"


def check_architecture(config: dict[str, Any], architecture: str, where: str) -> None:
    if config.get("model_type") != architecture:
        raise ModelSourceError(f"{where}: config.json's model_type is {config.get('model_type')!r}, the run's "
                               f"architecture is {architecture!r}")


def check_pinned(name: str, pinned: bytes, found: bytes, where: str) -> None:
    """A digest the run already names must be the source's; an all-zero one is not named yet."""
    if pinned != ZERO_DIGEST and pinned != found:
        raise ModelSourceError(f"{where}: its {name} has sha256 {found.hex()}, the run names {pinned.hex()}")


def resolve_model_digests(model: Described, *, endpoint: str | None = None,
                          token: str | None = None) -> Described:
    """The run's model with ``config_sha256`` (and ``tokenizer_sha256`` for the model's own tokenizer) filled
    from its source: the hook ``parse_run_spec`` applies for the CLI. Digests the config already names must
    match the source. The byte-level model has no source and is returned as it is."""
    architecture = model.architecture
    if architecture == BYTE_MODEL:
        return model
    where = describe(model)
    directory = load_source(model.source, model.source_revision or None, endpoint=endpoint, token=token)
    config = read_config(directory)
    check_architecture(config, architecture, where)
    digests = {"config_sha256": config_digest(config)}
    check_pinned(CONFIG_FILE, model.config_sha256, digests["config_sha256"], where)
    if int(model.tokenizer) != 0:  # Tokenizer.Model: the source's own tokenizer
        digests["tokenizer_sha256"] = tokenizer_digest(directory)
        check_pinned(TOKENIZER_FILE, model.tokenizer_sha256, digests["tokenizer_sha256"], where)
    return dataclasses.replace(model, **digests)


def model_spec_for(state: Any, *, endpoint: str | None = None, token: str | None = None,
                   cache_dir: Path | None = None) -> HFModelSpec:
    """The Hugging Face model a run's state describes, its config (and its own tokenizer, where the run uses it)
    checked against the digests on chain: what every worker, trainer and ``export`` builds the model from."""
    model = state.model
    revision = model.source_revision or None
    where = describe(model)
    directory = load_source(model.source, revision, endpoint=endpoint, token=token, cache_dir=cache_dir)
    config = read_config(directory)
    check_architecture(config, model.architecture, where)
    found = config_digest(config)
    if found != model.config_sha256:
        raise ModelSourceError(f"{where}: its {CONFIG_FILE} has sha256 {found.hex()}, the run names "
                               f"{model.config_sha256.hex()}; refusing to train another model")
    if int(model.tokenizer) != 0:  # the source's own tokenizer: the one a worker, trainer or export uses
        found = tokenizer_digest(directory)
        if found != model.tokenizer_sha256:
            raise ModelSourceError(f"{where}: its {TOKENIZER_FILE} has sha256 {found.hex()}, the run names "
                                   f"{model.tokenizer_sha256.hex()}; refusing to use another tokenizer")
    weights = WeightSource(model.source, revision, endpoint, token, cache_dir)
    try:
        return HFModelSpec(config, num_stages=state.config.num_stages, seq_len=model.seq_len, seed=model.init_seed,
                           weights=weights if weights.has_weights() else None)
    except ValueError as exc:
        raise ModelSourceError(f"{where}: {exc}") from None
