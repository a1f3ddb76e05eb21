"""A run's stage checkpoints assembled into a Hugging Face model directory that ``transformers`` loads.

Each stage's ``<stage>.safetensors`` holds its tensors under the whole model's names (``client.join.checkpoints``),
so the model is their union. Before writing anything, the export checks that union (from the files' headers)
against the model the run's ``config.json`` describes, built on PyTorch's meta device (no memory): every tensor
present exactly once, with its shape, in float32; each tensor is checked finite as it is read, and
``config.json`` is written last, so a refused export leaves no loadable model. A checkpoint that is not exactly
that model is refused, naming the stage and tensor at fault: a directory that loads but holds another function
would be worse than none.

The directory: ``config.json`` (the source's, untied if the tail's LM head diverged from the head's embeddings,
which a tied config would silently overwrite on load), the weights in ``model.safetensors`` or, past
``max_shard_bytes``, in numbered shards with ``model.safetensors.index.json`` as ``save_pretrained`` writes them,
the source's tokenizer files, and a ``README.md`` model card naming the run, epoch, step and stages. Tensors are
read one at a time from the stage files and written shard by shard, so memory holds one shard at most.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from client.models.weights import INDEX_FILE, SINGLE_FILE, TOKENIZER_EXTRAS, TOKENIZER_FILE

if TYPE_CHECKING:
    import torch

    from client.models.spec import HFModelSpec

DEFAULT_SHARD_BYTES = 4 * 2**30
"""Largest weights file written: what ``save_pretrained`` shards at by default, and a size every Hub tool handles."""
TOKENIZER_FILES = (TOKENIZER_FILE, *TOKENIZER_EXTRAS, "tokenizer.model", "vocab.json", "merges.txt",
                   "generation_config.json")
"""Files of the source copied beside the weights when it has them."""


class ExportError(ValueError):
    """The checkpoint cannot be exported as the run's model; the message names the stage or tensor at fault."""


@dataclass(frozen=True)
class ModelCard:
    """What the exported model's README says of where it comes from."""

    run_id: str
    epoch: int | None
    step: int | None
    checkpoint: str  # where the stage files were read from

    def render(self, spec: HFModelSpec, total_bytes: int) -> str:
        split = spec.layer_split()
        stages = "\n".join(f"| {name} | {_layers(split[name])} |" for name in spec.stage_names())
        unknown = "unknown"
        return f"""---
library_name: transformers
tags:
- psyswarm
---
# {self.run_id}

A `{spec.architecture}` causal language model trained by the psyswarm run `{self.run_id}`: {spec.num_stages}
pipeline stages on contributors' machines, assembled by `psyswarm export`.

- epoch: {unknown if self.epoch is None else self.epoch}
- step: {unknown if self.step is None else self.step}
- checkpoint: `{self.checkpoint}`
- parameters: {total_bytes // 4:,} (float32)

| stage | layers |
|---|---|
{stages}

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("path/to/this/directory")
```
"""


def _layers(layers: range) -> str:
    return f"{layers.start}-{layers.stop - 1}" if len(layers) > 1 else str(layers.start)


@dataclass(frozen=True)
class _Entry:
    name: str
    stage: str
    nbytes: int


def export_model(spec: HFModelSpec, stage_weights: Mapping[str, Path], source_dir: Path | None, output: Path,
                 card: ModelCard, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True) -> list[Path]:
    """Write the model directory into ``output`` (created; it must not hold a model already); returns its files.

    ``stage_weights`` maps each stage of ``spec`` to its ``.safetensors`` file; ``source_dir`` is the run's model
    source, whose tokenizer files are copied (None: no tokenizer). The config is ``spec``'s."""
    from transformers import AutoConfig

    from client.models.stages import build_skeleton, tied_sources

    missing = [name for name in spec.stage_names() if name not in stage_weights]
    if missing:
        raise ExportError(f"the checkpoint lacks stage(s) {', '.join(missing)}: every stage is needed")
    skeleton = build_skeleton(spec.hf_config())
    expected = skeleton.state_dict()
    entries = _plan(spec.stage_names(), stage_weights, expected)
    tied = tied_sources(skeleton)
    config = dict(spec.config)
    dropped = _tied_copies(tied, entries, stage_weights)
    if tied and not dropped:
        config["tie_word_embeddings"] = False  # the tail's LM head trained apart from the embeddings: keep both
    kept = [entry for entry in entries if entry.name not in dropped]
    if (output / "config.json").exists():
        raise ExportError(f"{output} already holds a model (config.json): choose an empty directory")
    output.mkdir(parents=True, exist_ok=True)
    files = _write_weights(kept, stage_weights, output, max_shard_bytes, progress)
    config_file = output / "config.json"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    AutoConfig.from_pretrained(output)  # the config transformers will read back is one it understands
    copied = [shutil.copyfile(source_dir / name, output / name) for name in TOKENIZER_FILES
              if source_dir is not None and (source_dir / name).is_file()]
    readme = output / "README.md"
    readme.write_text(card.render(spec, sum(entry.nbytes for entry in kept)))
    return [config_file, *files, *map(Path, copied), readme]


def _plan(stages: Sequence[str], stage_weights: Mapping[str, Path], expected: Mapping[str, torch.Tensor]
          ) -> list[_Entry]:
    """Every tensor of the model, in the order of the whole model's state dict, with the stage file holding it;
    refuses a duplicated, missing, unexpected, misshapen or non-fp32 tensor (read from the files' headers)."""
    from safetensors import SafetensorError, safe_open

    holder: dict[str, tuple[str, int]] = {}
    for stage in stages:
        path = stage_weights[stage]
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    sliced = handle.get_slice(name)
                    shape, dtype = sliced.get_shape(), sliced.get_dtype()
                    _check_entry(stage, name, shape, dtype, expected, holder)
                    holder[name] = (stage, 4 * _numel(shape))
        except (SafetensorError, OSError) as exc:
            raise ExportError(f"stage {stage}: {path} is not a readable safetensors file: {exc}") from None
    absent = [name for name in expected if name not in holder]
    if absent:
        raise ExportError(f"no stage holds {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}")
    return [_Entry(name, *holder[name]) for name in expected]


def _check_entry(stage: str, name: str, shape: list[int], dtype: str, expected: Mapping[str, torch.Tensor],
                 holder: Mapping[str, tuple[str, int]]) -> None:
    if name not in expected:
        raise ExportError(f"stage {stage} holds {name}, which the run's model does not have")
    if name in holder:
        raise ExportError(f"stages {holder[name][0]} and {stage} both hold {name}")
    if list(shape) != list(expected[name].shape) or dtype != "F32":
        raise ExportError(f"stage {stage}: {name} is {dtype} {list(shape)}, the model needs F32 "
                          f"{list(expected[name].shape)}")


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _read(stage_weights: Mapping[str, Path], entry: _Entry) -> torch.Tensor:
    """One tensor from its stage file, refused if not finite (headers were checked by ``_plan``)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(stage_weights[entry.stage]), framework="pt") as handle:
        tensor = handle.get_tensor(entry.name)
    if not bool(torch.isfinite(tensor).all()):
        raise ExportError(f"stage {entry.stage}: {entry.name} holds non-finite values")
    return tensor


def _tied_copies(tied: Mapping[str, str], entries: Sequence[_Entry], stage_weights: Mapping[str, Path]) -> set[str]:
    """The tied copies to leave out: an LM head still equal to the embeddings it is tied to (as
    ``save_pretrained`` leaves it out); none once it diverged, which the caller then writes untied."""
    import torch

    by_name = {entry.name: entry for entry in entries}
    if not tied:
        return set()
    equal = all(torch.equal(_read(stage_weights, by_name[copy]), _read(stage_weights, by_name[source]))
                for copy, source in tied.items())
    return set(tied) if equal else set()


def _write_weights(entries: Sequence[_Entry], stage_weights: Mapping[str, Path], output: Path, max_shard_bytes: int,
                   progress: bool) -> list[Path]:
    """``model.safetensors``, or numbered shards of at most ``max_shard_bytes`` (a larger tensor alone) with
    their index; each file written to a temporary name and renamed."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    shards: list[list[_Entry]] = [[]]
    filled = 0
    for entry in entries:
        if shards[-1] and filled + entry.nbytes > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += entry.nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(entry.nbytes for entry in entries)
    files = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not progress) as bar:
        for name, shard in zip(names, shards, strict=True):
            tensors = {}
            for entry in shard:
                tensors[entry.name] = _read(stage_weights, entry)
                bar.update(entry.nbytes)
            tmp = output / f"{name}.tmp"
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            files.append(tmp.replace(output / name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {entry.name: name for name, shard in zip(names, shards, strict=True) for entry in shard}}
        (output / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(output / INDEX_FILE)
    return files
