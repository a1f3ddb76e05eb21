"""The server killed with SIGKILL and restarted resumes the run where it was, with nothing lost."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from coordinator_program.spec.state import Phase, Role, decode_state
from local_backend.store import RunStore

STATE_TOML = """
run_id = "persist"
[config]
min_clients = 4
max_clients = 8
warmup_time = 600
[model]
n_layers = 3
d_model = 16
n_heads = 2
seq_len = 8
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Path, db: Path, port: int) -> subprocess.Popen:
    """``psyswarm serve``, once it serves: it binds its port before it opens the run, so a connection alone does
    not say the run is stored yet; its log line does."""
    proc = subprocess.Popen([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db", str(db),
                             "--port", str(port), "--permissionless"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen = []
    timer = threading.Timer(60, proc.kill)  # a server that never says it serves ends the read below
    timer.start()
    try:
        for line in proc.stdout:
            seen.append(line.decode(errors="replace"))
            if b"serving run" in line:
                proc.startup_log = "".join(seen)  # type: ignore[attr-defined] - what it said until then
                return proc
    finally:
        timer.cancel()
    proc.kill()
    raise AssertionError(f"server did not start: {''.join(seen)}")


async def join_four(address: str) -> tuple[list[TcpBackend], int]:
    clients = [TcpBackend(address, Keypair()) for _ in range(4)]
    for i, c in enumerate(clients):
        await c.connect()
        await c.join(Role.Worker if i < 3 else Role.Trainer)
    state = await clients[0].wait_for(lambda s: s.phase == Phase.Warmup, 10)
    return clients, state.nonce


def four_join_then(tmp_path: Path, stop: Callable[[subprocess.Popen], None]) -> tuple[subprocess.Popen, Path, Path,
                                                                                        int, list[TcpBackend], int]:
    """Serve a fresh run, let four clients join it, then ``stop`` the server however the test stops it."""
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML)
    db = tmp_path / "run.sqlite"
    port = free_port()
    proc = start_server(config, db, port)
    try:
        clients, nonce = asyncio.run(join_four(f"127.0.0.1:{port}"))
    finally:
        stop(proc)
    return proc, config, db, port, clients, nonce


def test_sigkill_and_restart_lose_nothing(tmp_path: Path) -> None:
    def kill(proc: subprocess.Popen) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    _, config, db, port, clients, nonce = four_join_then(tmp_path, kill)
    ids = {bytes(c.keypair.pubkey()) for c in clients}

    store = RunStore(db)
    saved = decode_state(store.load("persist"))
    assert saved.nonce >= nonce and saved.phase == Phase.Warmup
    assert {c.id for c in saved.clients} == ids
    log = store.operations()
    assert [row[3] for row in log] == sorted(row[3] for row in log), "the log is in nonce order"
    assert log[-1][3] == saved.nonce
    store.close()

    proc = start_server(config, db, port)
    try:
        async def reconnect() -> None:
            watcher = TcpBackend(f"127.0.0.1:{port}", Keypair())
            await watcher.connect()
            state = watcher.state
            assert state.nonce == saved.nonce and state.phase == Phase.Warmup
            assert {c.id for c in state.clients} == ids
            await watcher.close()

        asyncio.run(reconnect())
    finally:
        proc.terminate()
        proc.wait(10)


def test_sigterm_stops_the_server_cleanly(tmp_path: Path) -> None:
    """A service manager's stop: before, SIGTERM ended the process where it stood (exit -15, no line said what was
    kept); now it takes Ctrl+C's path: connections closed, the stopped line, exit 0, and every change stored."""
    said: list[bytes] = []

    def terminate(proc: subprocess.Popen) -> None:
        proc.terminate()
        said.append(proc.communicate(timeout=20)[0])

    proc, _, db, _, _, nonce = four_join_then(tmp_path, terminate)
    out = said[0]
    assert proc.returncode == 0, out.decode(errors="replace")
    assert "stopped; the run is saved and resumes with the same --db" in out.decode(errors="replace")
    store = RunStore(db)
    assert decode_state(store.load("persist")).nonce >= nonce
    store.close()


def test_a_database_of_another_run_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML)
    other = tmp_path / "other.toml"
    other.write_text(STATE_TOML.replace('"persist"', '"other"'))
    db = tmp_path / "run.sqlite"
    port = free_port()
    proc = start_server(config, db, port)
    proc.terminate()
    proc.wait(10)
    result = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--config", str(other), "--db", str(db),
                             "--port", str(port), "--permissionless"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "holds run 'persist'" in result.stderr


def test_serve_on_a_busy_port_creates_nothing(tmp_path: Path) -> None:
    """Before: the database and the authority key were made, then the bind failed."""
    config = tmp_path / "state.toml"
    config.write_text(STATE_TOML)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db",
                                 str(tmp_path / "run.sqlite"), "--port", str(port), "--permissionless"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.toml"], "a refused serve leaves nothing behind"
