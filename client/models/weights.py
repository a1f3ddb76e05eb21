"""Where a model's files are, and reading a stage's tensors from them without the rest.

A source is a Hub repo at a revision or a local directory. When it holds safetensors, a stage reads only its own
tensors: with a sharded checkpoint (``model.safetensors.index.json``) a worker downloads only the shards that hold
them, one ``hf_hub_download`` per shard; with one ``model.safetensors`` the file is fetched whole but only the
stage's tensors are read. An index cannot point outside its own repo or directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")  # optional, for AutoTokenizer
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LOCAL_PREFIXES = ("/", "./", "../", "~")


class ModelSourceError(ValueError):
    """A model source is unreachable, malformed, or not the model the run names; the message says which."""


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
