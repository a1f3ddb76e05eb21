"""Where a run's model comes from: a Hub repo at a revision, a local directory, or a ``config.json`` alone.

The run names its model on chain by ``source`` (a Hub repo id ``org/name``, or a local directory starting
with ``/``, ``./``, ``../`` or ``~``), ``source_revision`` and the sha256 of its ``config.json`` in canonical
form (``config_digest``), plus the sha256 of its ``tokenizer.json`` when it uses the model's own tokenizer.
Every client reads the config from the source and refuses one whose digest differs from the run's: a source
can change under a mutable revision, and a model with another shape would train garbage without an error.

Weights: when the source holds safetensors, a stage reads only its own tensors. With a sharded checkpoint
(``model.safetensors.index.json``) a worker downloads only the shards that hold them, one
``hf_hub_download`` per shard; with one ``model.safetensors`` the file is fetched whole but only the
stage's tensors are read. A source with no weights means a fresh initialisation from the run's seed,
identical on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from client.data import DatasetError, tokenizer_sha256
from client.models.spec import HFModelSpec

if TYPE_CHECKING:
    import torch

BYTE_MODEL = "psyswarm"  # the architecture name of the embedded byte-level model, which has no source
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")  # optional, for AutoTokenizer
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LOCAL_PREFIXES = ("/", "./", "../", "~")
ZERO_DIGEST = bytes(32)


class ModelSourceError(ValueError):
    """A model source is unreachable, malformed, or not the model the run names; the message says which."""


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


def config_digest(config_json: dict[str, Any]) -> bytes:
    """sha256 of ``config.json`` in canonical form (sorted keys, no spaces): the same model on every machine
    whatever the file's formatting."""
    return hashlib.sha256(json.dumps(config_json, sort_keys=True, separators=(",", ":")).encode()).digest()


def tokenizer_digest(directory: Path) -> bytes:
    """sha256 of the source's ``tokenizer.json``: the digest datasets name their tokenizer by
    (``client.data.tokenizer_sha256``), so a dataset and a model agree on what the same tokenizer is."""
    try:
        return tokenizer_sha256(directory)
    except (DatasetError, OSError) as exc:
        raise ModelSourceError(f"the model's tokenizer in {directory} cannot be read ({exc})") from None


def is_local(source: str) -> bool:
    return source.startswith(LOCAL_PREFIXES)


@dataclass(frozen=True)
class WeightSource:
    """Safetensors of a model: a local directory or a Hub repo at a revision (through ``endpoint``)."""

    location: str  # the run's ``source`` string: the same on every machine, so it can go in fingerprints
    revision: str | None = None
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False, compare=False)
    cache_dir: Path | None = None

    def identity(self) -> str:
        return self.location if is_local(self.location) else f"{self.location}@{self.revision or 'main'}"

    def fetch(self, filename: str) -> Path | None:
        """The local path of ``filename`` (downloaded if need be), or None where the source has no such file."""
        if is_local(self.location):
            path = Path(self.location).expanduser() / filename
            return path if path.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

        try:
            return Path(hf_hub_download(self.location, filename, revision=self.revision, endpoint=self.endpoint,
                                        token=self.token, cache_dir=self.cache_dir))
        except EntryNotFoundError:
            return None
        except (HfHubHTTPError, HFValidationError, OSError) as exc:
            raise ModelSourceError(f"could not download {filename} from {self.identity()}: {exc}") from None

    def has_weights(self) -> bool:
        if is_local(self.location):
            return self.fetch(INDEX_FILE) is not None or self.fetch(SINGLE_FILE) is not None
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError

        api = HfApi(endpoint=self.endpoint, token=self.token)
        try:
            return any(api.file_exists(self.location, name, revision=self.revision)
                       for name in (INDEX_FILE, SINGLE_FILE))
        except (HfHubHTTPError, HFValidationError, OSError) as exc:
            raise ModelSourceError(f"could not list the weights of {self.identity()}: {exc}") from None

    def weight_map(self) -> dict[str, str]:
        """Tensor name → the safetensors file holding it, from the index (sharded) or the single file's header."""
        index = self.fetch(INDEX_FILE)
        if index is not None:
            try:
                mapping = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ModelSourceError(f"{INDEX_FILE} of {self.identity()} is malformed ({exc})") from None
            if not isinstance(mapping, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
                raise ModelSourceError(f"{INDEX_FILE} of {self.identity()}: weight_map must map names to files")
            for filename in set(mapping.values()):
                check_shard_name(filename, self.identity())
            return mapping
        single = self.fetch(SINGLE_FILE)
        if single is None:
            raise ModelSourceError(f"{self.identity()} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILE)

    def stage_tensors(self, keys: list[str], tied: dict[str, str]) -> dict[str, torch.Tensor]:
        """The tensors named ``keys``, reading only the files that hold them. A key the checkpoint leaves out
        because it is tied (``lm_head.weight``) is read from the tensor it is tied to."""
        from safetensors import SafetensorError, safe_open

        mapping = self.weight_map()
        stored: dict[str, str] = {}
        for key in keys:
            name = key if key in mapping else tied.get(key, key)
            if name not in mapping:
                raise ModelSourceError(f"the weights of {self.identity()} lack the tensor {key}")
            stored[key] = name
        tensors: dict[str, torch.Tensor] = {}
        for filename in sorted({mapping[name] for name in stored.values()}):
            path = self.fetch(filename)
            if path is None:
                raise ModelSourceError(f"{self.identity()} names the shard {filename}, which it does not hold")
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for key, name in stored.items():
                        if mapping[name] == filename:
                            tensors[key] = handle.get_tensor(name)
            except (SafetensorError, OSError) as exc:
                raise ModelSourceError(f"shard {filename} of {self.identity()} is unreadable ({exc})") from None
        return tensors


def check_shard_name(filename: str, where: str) -> None:
    """A shard is a plain ``*.safetensors`` file name: an index cannot point outside its own repo or directory."""
    if Path(filename).name != filename or filename in ("", ".", "..") or not filename.endswith(".safetensors"):
        raise ModelSourceError(f"{INDEX_FILE} of {where} names {filename!r}, not a .safetensors file beside it")


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
    """The Hugging Face model a run's state describes, its config checked against the digest on chain."""
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
    weights = WeightSource(model.source, revision, endpoint, token, cache_dir)
    try:
        return HFModelSpec(config, num_stages=state.config.num_stages, seq_len=model.seq_len, seed=model.init_seed,
                           weights=weights if weights.has_weights() else None)
    except ValueError as exc:
        raise ModelSourceError(f"{where}: {exc}") from None
