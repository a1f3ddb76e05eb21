"""``psyswarm demo --workdir DIR`` deletes only what an earlier demo wrote: never a directory it did not make."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from client.swarm.demo import DEMO_MARKER, WorkdirNotOurs, claim_workdir


def test_the_demo_refuses_a_workdir_it_did_not_create_and_deletes_nothing(tmp_path: Path) -> None:
    precious = tmp_path / "thesis"
    (precious / "chapters").mkdir(parents=True)
    (precious / "chapters" / "one.tex").write_text("years of work")
    (precious / "notes.txt").write_text("more work")
    # Short settings, so that a demo that went ahead anyway ends by itself.
    done = subprocess.run([sys.executable, "-m", "client.cli", "demo", "--workdir", str(precious), "--epochs", "1",
                           "--rounds", "1", "--timeout", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"--workdir {precious} is not empty and was not created by the demo (it has no {DEMO_MARKER}), so nothing "
        "was deleted; pass a new or empty directory, or empty it yourself"]
    assert (precious / "chapters" / "one.tex").read_text() == "years of work"
    assert sorted(p.name for p in precious.iterdir()) == ["chapters", "notes.txt"]


def test_a_new_or_empty_directory_is_claimed_with_the_marker(tmp_path: Path) -> None:
    fresh, empty = tmp_path / "runs" / "demo", tmp_path / "empty"
    empty.mkdir()
    for workdir in (fresh, empty):
        claim_workdir(workdir)
        assert [p.name for p in workdir.iterdir()] == [DEMO_MARKER]


def test_a_directory_an_earlier_demo_made_is_emptied(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    claim_workdir(workdir)
    (workdir / "logs").mkdir()
    (workdir / "logs" / "server.log").write_text("old run")
    (workdir / "run.sqlite").write_bytes(b"old state")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the demo's")
    (workdir / "link").symlink_to(outside, target_is_directory=True)
    claim_workdir(workdir)
    assert [p.name for p in workdir.iterdir()] == [DEMO_MARKER]
    assert (outside / "keep.txt").read_text() == "not the demo's"  # a link is removed, never followed


@pytest.mark.parametrize("fake_marker", ["directory", "symlink"])
def test_only_a_real_marker_file_counts(tmp_path: Path, fake_marker: str) -> None:
    workdir = tmp_path / "demo"
    workdir.mkdir()
    (workdir / "data.bin").write_bytes(b"someone's")
    elsewhere = tmp_path / "marker-elsewhere"
    elsewhere.write_text("")
    if fake_marker == "directory":
        (workdir / DEMO_MARKER).mkdir()
    else:
        (workdir / DEMO_MARKER).symlink_to(elsewhere)
    with pytest.raises(WorkdirNotOurs, match="not created by the demo"):
        claim_workdir(workdir)
    assert (workdir / "data.bin").read_bytes() == b"someone's"


def test_a_file_as_workdir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    target.write_text("a file")
    with pytest.raises(WorkdirNotOurs, match="is a file, not a directory"):
        claim_workdir(target)
    assert target.read_text() == "a file"
