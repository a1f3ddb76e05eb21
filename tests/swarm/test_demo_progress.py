"""``psyswarm demo`` says what it is doing from its first second: the libraries loading, then each part of the swarm
as it comes up; Ctrl+C then stops every child. A real demo process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_demo_reports_progress_before_the_run_starts(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    began = time.monotonic()
    demo = subprocess.Popen([sys.executable, "-m", "client.cli", "demo", "--workdir", str(workdir), "--epochs", "1",
                             "--rounds", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=False)
    lines: list[tuple[float, str]] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append((time.monotonic() - began, line.strip()))
            if "clients started" in line:
                break
        demo.send_signal(signal.SIGINT)  # as Ctrl+C: the demo stops its children
        rest = demo.communicate(timeout=60)[0]
    finally:
        if demo.poll() is None:
            demo.kill()
    texts = [text for _, text in lines]
    assert texts[0].startswith("psyswarm demo: 1 epochs of 1 rounds on the tcp backend"), texts
    steps = ["starting the coordinator server", "coordinator up at 127.0.0.1:", "DHT up", "clients started"]
    for step in steps:
        assert any(step in text for text in texts), (step, texts)
    assert lines[0][0] < lines[-1][0] and all("s] " in text for text in texts[1:]), texts  # each step with its time
    assert "interrupted: every child process was stopped" in rest, rest
