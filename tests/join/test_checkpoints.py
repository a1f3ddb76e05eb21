"""Stage checkpoints: written atomically with their step, and uploaded to a Hub branch per epoch; periodic
snapshots, the newest kept per stage."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from client.join.checkpoints import (
    SNAPSHOTS_KEPT,
    revision_for,
    save_snapshot,
    save_stage,
    snapshot_dirs,
    snapshot_root,
    upload_stage,
)
from tests.fake_hub import FakeHub


def test_save_writes_weights_and_step_atomically(tmp_path: Path) -> None:
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    weights, meta = save_stage(tmp_path / "epoch-2", "body1", tensors, step=17)
    assert torch.equal(torch.load(weights, weights_only=True)["w"], tensors["w"])
    assert json.loads(meta.read_text()) == {"step": 17}
    assert not list(tmp_path.rglob("*.tmp")), "no temporary file is left behind"


def test_upload_puts_each_stage_on_the_epoch_branch(tmp_path: Path) -> None:
    hub = FakeHub().start()
    try:
        for stage in ("head", "tail"):
            files = save_stage(tmp_path / stage, stage, {"w": torch.full((2,), float(len(stage)))}, step=8)
            upload_stage(files, "org/model", revision_for(3), token="t", endpoint=hub.url)
        assert hub.branches == {("org/model", "epoch-3")}
        for stage in ("head", "tail"):
            path = hf_hub_download("org/model", f"{stage}.pt", revision="epoch-3", endpoint=hub.url,
                                   cache_dir=tmp_path / "cache", token="t")
            assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((2,), float(len(stage))))
        assert json.loads(hub.files[("org/model", "epoch-3", "tail.json")]) == {"step": 8}
    finally:
        hub.shutdown()


def test_snapshots_keep_each_stages_newest_and_leave_other_stages_alone(tmp_path: Path) -> None:
    root = snapshot_root(tmp_path, "run")
    for step in (2, 4, 6):
        save_snapshot(root, "body1", {"w": torch.full((2,), float(step))}, step)
    save_snapshot(root, "head", {"w": torch.zeros(2)}, 2)
    assert [step for step, _ in snapshot_dirs(root, "body1")] == [6, 4][:SNAPSHOTS_KEPT]
    assert [step for step, _ in snapshot_dirs(root, "head")] == [2], "pruning body1 kept head's step-2 snapshot"
    newest = snapshot_dirs(root, "body1")[0][1]
    assert json.loads((newest / "body1.json").read_text()) == {"step": 6}
    assert torch.equal(torch.load(newest / "body1.pt", weights_only=True)["w"], torch.full((2,), 6.0))
    (root / "step-9").mkdir()
    (root / "notes").mkdir()
    assert [step for step, _ in snapshot_dirs(root, "body1")] == [6, 4], "only step-N directories holding the stage"
