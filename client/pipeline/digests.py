"""The digest of a stage's state: what its replicas publish after each step and a joiner checks a download by.

Same-stage replicas that average gradients every step hold bit-identical parameters on CPU, so one sha256 over
the stage's ``state_dict`` says whether two replicas agree. It covers each tensor's name, shape and dtype as well
as its bytes, in the order of the sorted names: two states with the same bytes under another layout differ, and
the order in which a module or a donor lists its tensors does not matter. Hashing reads every byte once
(hashlib's sha256 runs at about 1-2 GB/s on one core): ``tests/benchmarks/bench_digests.py`` measures it against
the step it follows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from client.identity import canonical


def state_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The sha256 (hex) of a state: for each tensor by sorted name, its header (name, shape, dtype) and its bytes
    as they lie in memory on the CPU, each prefixed by its length so no two states share a byte stream."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        header = canonical({"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype)})
        data = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(len(header).to_bytes(8, "little") + header + data.nbytes.to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()
