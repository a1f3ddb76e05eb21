"""SPARTA masks and schedule: disjoint, balanced, cycling, and the same on every peer whatever its RNG state."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from client.averaging import sparta
from client.averaging.sparta import SpartaMasks, SpartaSettings, averager_prefix, averaging_index, element_ranks

SHAPES = [("layers.1.qkv.weight", 3 * 32 * 32), ("layers.1.qkv.bias", 96), ("norm.weight", 7), ("tiny", 1)]


def test_partitions_are_disjoint_balanced_and_cover_every_element() -> None:
    partitions = 20
    masks = SpartaMasks(SHAPES, partitions, seed=3)
    for t, (_, numel) in enumerate(SHAPES):
        slices = [masks.indices(k)[t] for k in range(partitions)]
        everything = torch.cat(slices)
        assert sorted(everything.tolist()) == list(range(numel))  # every element once: disjoint and covering
        sizes = [len(s) for s in slices]
        assert max(sizes) - min(sizes) <= 1
        assert max(sizes) == masks.slice_sizes[t]
        assert all(torch.equal(s, s.sort().values) for s in slices)  # packed in the same order on every peer


def test_masks_are_pinned_and_independent_of_rng_state() -> None:
    """The algorithm is part of the protocol: a change would make peers of two versions average garbage."""
    torch.manual_seed(123)
    np.random.seed(456)
    masks = SpartaMasks([("w", 10), ("b", 3)], 3, seed=0)
    assert [[i.tolist() for i in masks.indices(k)] for k in range(3)] == [
        [[1, 2, 3, 6], [0]], [[0, 7, 8], [1]], [[4, 5, 9], [2]]]
    digest = hashlib.sha256(element_ranks(0, "layers.4.qkv.weight", 1000).tobytes()).hexdigest()
    assert digest == "bbe2380d44c9680ebcf1855967b595cdf1255c3af8a455350ad76436ef374e6b"


def test_another_process_with_other_seeds_derives_the_same_masks() -> None:
    code = (
        "import hashlib, torch, numpy as np; torch.manual_seed(999); np.random.seed(7);"
        "from client.averaging.sparta import SpartaMasks;"
        f"m = SpartaMasks({SHAPES!r}, 5, seed=11);"
        "print(hashlib.sha256(b''.join(t.numpy().tobytes() for k in range(5) for t in m.indices(k))).hexdigest())"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "42", "PATH": ""}, timeout=120).stdout.strip()
    masks = SpartaMasks(SHAPES, 5, seed=11)
    here = hashlib.sha256(b"".join(t.numpy().tobytes() for k in range(5) for t in masks.indices(k))).hexdigest()
    assert there == here


def test_the_partition_is_drawn_on_first_use_once_and_is_the_same_drawn_late(monkeypatch) -> None:
    ranked: list[str] = []  # the tensors whose elements were ranked (SHA-256), in order
    monkeypatch.setattr(sparta, "element_ranks", lambda seed, name, numel: ranked.append(name) or
                        element_ranks(seed, name, numel))
    shapes = [("a.weight", 3000), ("a.bias", 40)]
    late, early = SpartaMasks(shapes, 7, 5), SpartaMasks(shapes, 7, 5)
    assert ranked == [] and late.slice_sizes == early.slice_sizes
    early.draw()
    assert ranked == ["a.weight", "a.bias"]
    for partition in range(7):
        assert all(torch.equal(x, y) for x, y in zip(late.indices(partition), early.indices(partition), strict=True))
    assert ranked == ["a.weight", "a.bias"] * 2  # the late one drew once, for all seven partitions


def test_masks_depend_on_run_seed_and_parameter_name() -> None:
    base = element_ranks(0, "a", 500)
    assert not np.array_equal(base, element_ranks(1, "a", 500))
    assert not np.array_equal(base, element_ranks(0, "b", 500))
    assert np.array_equal(np.sort(base), np.arange(500))


def test_schedule_cycles_through_every_partition() -> None:
    every, partitions = 20, 20
    due = [(step, averaging_index(step, every)) for step in range(0, 20 * every * 2 + 1)]
    rounds = [index for _, index in due if index is not None]
    assert [step for step, index in due if index is not None][:3] == [20, 40, 60]
    assert averaging_index(0, every) is None and averaging_index(19, every) is None
    assert sorted(r % partitions for r in rounds[:partitions]) == list(range(partitions))
    with pytest.raises(ValueError):
        averaging_index(5, 0)


def test_settings_and_prefix_are_checked() -> None:
    with pytest.raises(ValueError, match="request_timeout"):
        SpartaSettings(min_matchmaking_time=1.0, request_timeout=1.0)
    with pytest.raises(ValueError, match="min_group_size"):
        SpartaSettings(min_group_size=1)
    with pytest.raises(ValueError, match="partitions"):
        SpartaMasks(SHAPES, 0, seed=0)
    prefixes = {averager_prefix(run, stage) for run in ("a.b", "a_b") for stage in ("head", "tail")}
    assert len(prefixes) == 4 and not any("." in p for p in prefixes)
