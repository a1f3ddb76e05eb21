"""Stage checkpoints: safetensors weights, the optimizer's moments and the step, written atomically and uploaded
to a Hub branch per epoch; periodic snapshots, the newest kept per stage; and loading one, which refuses any
file that does not fit the stage and never runs code from it."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import safetensors.torch
import torch
from huggingface_hub import hf_hub_download

from client.join.checkpoints import (
    SNAPSHOTS_KEPT,
    CheckpointError,
    FileLimits,
    named_optimizer_state,
    read_optimizer_state,
    revision_for,
    save_snapshot,
    save_stage,
    snapshot_dirs,
    snapshot_root,
    stage_files,
    upload_stage,
)
from client.join.state_download import StateDownloadError, download_from_hub, load_local, load_stage_state
from client.pipeline.model import ModelConfig, build_stage
from client.pipeline.optim import OptimizerConfig, StageOptimizer
from tests.fake_hub import FakeHub

TINY = ModelConfig(n_layers=3, d_model=16, n_heads=2, seq_len=8, num_stages=3, seed=3)
RUN_LR = OptimizerConfig(lr=1e-2)


class Stage:
    """A body1 stage with its optimizer, as a worker holds them."""

    def __init__(self) -> None:
        self.module = build_stage(TINY, "body1")
        self.optimizer = StageOptimizer(self.module, "body1", TINY.num_stages, RUN_LR)

    def train_step(self, seed: int) -> None:
        x = torch.randn(2, TINY.seq_len, TINY.d_model, generator=torch.Generator().manual_seed(seed))
        self.module(x).square().sum().backward()
        self.optimizer.step(2)

    def save(self, directory: Path, step: int) -> list[Path]:
        return save_stage(directory, "body1", self.module.state_dict(), step,
                          named_optimizer_state(self.module, self.optimizer.optimizer))

    def load(self, directory: Path) -> None:
        found = load_local(directory, "body1", FileLimits.of(self.module))
        assert found is not None
        load_stage_state(self.module, found, threading.Lock(), self.optimizer.optimizer)

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.module.state_dict().items()}


class Payload:
    """Unpickling this runs ``os.system``: what a hostile pickle does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_save_writes_fp32_safetensors_the_optimizer_and_the_step_atomically(tmp_path: Path) -> None:
    stage = Stage()
    stage.train_step(0)
    files = stage.save(tmp_path / "epoch-2", step=17)
    assert [f.name for f in files] == list(stage_files("body1"))
    weights = safetensors.torch.load_file(files[0])
    assert weights.keys() == stage.module.state_dict().keys()
    assert all(torch.equal(weights[k], v) and v.dtype == torch.float32 for k, v in stage.module.state_dict().items())
    assert torch.load(files[1], weights_only=True).keys() == dict(stage.module.named_parameters()).keys()
    assert json.loads(files[2].read_text()) == {"step": 17}
    assert not list(tmp_path.rglob("*.tmp")), "no temporary file is left behind"


def test_a_stage_resumed_from_its_checkpoint_trains_on_exactly_as_if_never_stopped(tmp_path: Path) -> None:
    original, resumed = Stage(), Stage()
    for seed in range(3):
        original.train_step(seed)
    original.save(tmp_path, step=3)
    resumed.load(tmp_path)
    original.train_step(9)
    resumed.train_step(9)  # with fresh AdamW moments this step would differ
    assert all(torch.equal(v, original.params()[k]) for k, v in resumed.params().items())
    assert all(group["lr"] == RUN_LR.lr for group in resumed.optimizer.optimizer.param_groups)


def test_a_pickle_posing_as_weights_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    weights, *_ = stage_files("body1")
    (tmp_path / weights).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(StateDownloadError, match=r"body1\.safetensors is not a readable safetensors file"):
        load_local(tmp_path, "body1", FileLimits.of(build_stage(TINY, "body1")))
    assert not marker.exists()


def test_a_hostile_optimizer_file_is_ignored_and_the_weights_still_load(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    trained = Stage()
    trained.train_step(0)
    trained.save(tmp_path, step=1)
    optim_file = tmp_path / stage_files("body1")[1]
    good = torch.load(optim_file, weights_only=True)
    name = next(iter(good))
    shape = good[name]["exp_avg"].shape
    hostile = [
        pickle.dumps(Payload(marker)),  # code
        {**good, name: {**good[name], "exp_avg": torch.zeros(*shape, 2)}},  # a moment of another shape
        {**good, name: {**good[name], "exp_avg_sq": -torch.ones(shape)}},  # a negative second moment
        {**good, name: {**good[name], "exp_avg": torch.full(shape, float("inf"))}},  # non-finite
        {**good, "param_groups": [{"lr": 1e6}]},  # the run's hyper-parameters are not a file's to set
        {**good, name: {**good[name], "lr": torch.tensor(1e6)}},
    ]
    for content in hostile:
        if isinstance(content, bytes):
            optim_file.write_bytes(content)
        else:
            torch.save(content, optim_file)
        fresh = Stage()
        fresh.load(tmp_path)
        assert all(torch.equal(v, trained.params()[k]) for k, v in fresh.params().items()), "weights loaded"
        assert not fresh.optimizer.optimizer.state, "the optimizer state was not taken"
        assert all(group["lr"] == RUN_LR.lr for group in fresh.optimizer.optimizer.param_groups)
    assert not marker.exists()


def test_weights_of_another_stage_shape_or_dtype_are_refused_and_change_nothing(tmp_path: Path) -> None:
    stage = Stage()
    before = stage.params()
    other = build_stage(ModelConfig(n_layers=3, d_model=32, n_heads=2, seq_len=8, num_stages=3), "body1")
    cases = [({k: v + 1 for k, v in other.state_dict().items()}, "this stage needs torch.float32"),
             ({k: v.half() for k, v in before.items()}, "is torch.float16"),
             ({**before, "layers.9.fc.weight": torch.zeros(2)}, r"unexpected \['layers.9.fc.weight'\]"),
             ({k: v for k, v in before.items() if k != "layers.1.fc.bias"}, r"missing \['layers.1.fc.bias'\]")]
    for tensors, message in cases:
        safetensors.torch.save_file(tensors, tmp_path / stage_files("body1")[0])
        with pytest.raises(StateDownloadError, match=message):
            stage.load(tmp_path)
        assert all(torch.equal(v, before[k]) for k, v in stage.params().items())


def test_upload_puts_each_stage_on_the_epoch_branch(tmp_path: Path) -> None:
    hub = FakeHub().start()
    try:
        for stage in ("head", "tail"):
            moments = {"w": {"step": torch.tensor(8.0), "exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}}
            files = save_stage(tmp_path / stage, stage, {"w": torch.full((2,), float(len(stage)))}, step=8,
                               optimizer=moments)
            upload_stage(files, "org/model", revision_for(3), token="t", endpoint=hub.url)
        assert hub.branches == {("org/model", "epoch-3")}
        for stage in ("head", "tail"):
            path = hf_hub_download("org/model", f"{stage}.safetensors", revision="epoch-3", endpoint=hub.url,
                                   cache_dir=tmp_path / "cache", token="t")
            assert torch.equal(safetensors.torch.load_file(path)["w"], torch.full((2,), float(len(stage))))
        assert json.loads(hub.files[("org/model", "epoch-3", "tail.json")]) == {"step": 8}
        limits = FileLimits(weights=2**16, optimizer=2**16)  # the two-element stage's files are far smaller
        state = download_from_hub("org/model", "tail", limits=limits, revision="epoch-3", endpoint=hub.url,
                                  token="t", cache_dir=tmp_path / "cache")
        assert state.step == 8 and torch.equal(state.optimizer["w"]["exp_avg"], torch.ones(2))
    finally:
        hub.shutdown()


def test_snapshots_keep_each_stages_newest_and_leave_other_stages_alone(tmp_path: Path) -> None:
    root = snapshot_root(tmp_path, "run")
    for step in (2, 4, 6):
        save_snapshot(root, "body1", {"w": torch.full((2,), float(step))}, step, {"w": {}})
    save_snapshot(root, "head", {"w": torch.zeros(2)}, 2)
    assert [step for step, _ in snapshot_dirs(root, "body1")] == [6, 4][:SNAPSHOTS_KEPT]
    assert [step for step, _ in snapshot_dirs(root, "head")] == [2], "pruning body1 kept head's step-2 snapshot"
    assert not (root / "step-2" / "body1.optim.pt").exists(), "a pruned snapshot loses all its files"
    newest = snapshot_dirs(root, "body1")[0][1]
    assert json.loads((newest / "body1.json").read_text()) == {"step": 6}
    assert torch.equal(safetensors.torch.load_file(newest / "body1.safetensors")["w"], torch.full((2,), 6.0))
    (root / "step-9").mkdir()
    (root / "notes").mkdir()
    assert [step for step, _ in snapshot_dirs(root, "body1")] == [6, 4], "only step-N directories holding the stage"


BOMB_ELEMENTS = 24 * 2**20  # a 96 MiB moment, DEFLATEd into about 100 KB: less than the stage's bound

LOAD_AND_MEASURE = """
import json, resource, sys
from pathlib import Path
from client.join.checkpoints import FileLimits
from client.join.state_download import load_local
from client.pipeline.model import ModelConfig, build_stage

module = build_stage(ModelConfig(n_layers=3, d_model=16, n_heads=2, seq_len=8, num_stages=3, seed=3), "body1")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
state = load_local(Path(sys.argv[1]), "body1", FileLimits.of(module))
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_mib": grew / 1024, "optimizer": state.optimizer is not None, "weights": len(state.tensors)}))
"""


def deflated(source: Path, target: Path) -> None:
    """``source``'s torch archive with every record DEFLATE-compressed, streamed record by record."""
    with zipfile.ZipFile(source) as plain, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as packed:
        for record in plain.infolist():
            with plain.open(record) as src, packed.open(record.filename, "w", force_zip64=True) as dst:
                shutil.copyfileobj(src, dst, 2**20)


def test_a_compressed_optimizer_file_is_refused_before_it_inflates(tmp_path: Path) -> None:
    """A peer or a repository hands the joiner an ``optim.pt`` of ~100 KB whose DEFLATEd record holds a 96 MiB
    moment: the joiner refuses it from the archive's directory, before ``torch.load`` inflates anything, and
    still loads the weights (measured as the peak memory of a fresh process that loads the stage)."""
    trained = Stage()
    trained.train_step(0)
    trained.save(tmp_path, step=1)
    optim_file = tmp_path / stage_files("body1")[1]
    name = next(iter(torch.load(optim_file, weights_only=True)))
    plain = tmp_path / "plain.pt"
    torch.save({name: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(BOMB_ELEMENTS),
                       "exp_avg_sq": torch.zeros(1)}}, plain)
    deflated(plain, optim_file)
    plain.unlink()
    assert optim_file.stat().st_size < FileLimits.of(trained.module).optimizer  # small enough to pass by size
    measured = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(tmp_path)], capture_output=True,
                              text=True, timeout=120, check=True)
    outcome = json.loads(measured.stdout.strip().splitlines()[-1])
    assert outcome["weights"] > 0 and not outcome["optimizer"]
    assert outcome["grew_mib"] < 32, outcome  # the bomb would take 96 MiB
    with pytest.raises(CheckpointError, match="compressed records"):
        read_optimizer_state(optim_file, "optim.pt", FileLimits.of(trained.module).optimizer)
