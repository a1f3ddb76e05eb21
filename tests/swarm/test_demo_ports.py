"""``psyswarm demo --port-base``: the demo's processes on ports the user chose, and a busy range refused in one line
before anything starts. Real demo processes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from client.swarm.demo import PORTS_TAKEN, busy_ports


def free_base() -> int:
    """A base whose ``PORTS_TAKEN`` ports are all free now."""
    for base in range(20000, 60000, 97):
        if not busy_ports(base):
            return base
    raise AssertionError("no free port range")


@pytest.mark.slow
def test_the_demo_takes_the_ports_from_its_base(tmp_path: Path) -> None:
    base, workdir = free_base(), tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "client.cli", "demo", "--workdir", str(workdir), "--epochs", "1",
                             "--rounds", "1", "--port-base", str(base)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            seen.append(line.strip())
            if "clients started" in line:
                break
        demo.send_signal(signal.SIGINT)
        demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
    assert any(f"coordinator up at 127.0.0.1:{base};" in line for line in seen), seen
    assert f"/tcp/{base + 2}/p2p/" in (workdir / "logs" / "dht.log").read_text()
    head = (workdir / "logs" / "worker-head.log")
    assert head.exists()


def test_a_busy_port_base_is_refused_before_anything_starts(tmp_path: Path) -> None:
    base = free_base()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 4))
        taken.listen()
        result = subprocess.run([sys.executable, "-m", "client.cli", "demo", "--workdir", str(tmp_path / "demo"),
                                 "--port-base", str(base)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"port {base + 4} of {base}..{base + PORTS_TAKEN - 1} is in use" in result.stderr
    assert not (tmp_path / "demo").exists()
