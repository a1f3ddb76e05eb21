"""Start and stop a whole local swarm as separate processes: the coordinator (the TCP server, or a local
Solana chain running the program), a DHT bootstrap, and contributor clients. The demo uses it, and so do
the multi-process integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from solders.keypair import Keypair

from client.identity import save_keypair
from client.pipeline.addresses import free_port

DHT_LINE = "DHT bootstrap listening: --initial-peer "
AUTH_LINE = " listening on "
JOIN_AUTHORITY = "join-authority"
"""The auth service's keypair, under ``keys/``: the run's join authority when the swarm runs one."""
CLIENT_LAMPORTS = 10_000_000_000
"""What the local chain gives each client: its transaction fees for a long run."""


class Swarm:
    """Processes of one local run, each in its own process group and with its own log file.

    With ``auth_service`` the run is created with the key of its auth service (``start_auth``) as join authority,
    so only joins that service countersigns are admitted; without, it is created permissionless.
    """

    def __init__(self, workdir: Path, state_toml: str, *, threads: int = 1, backend: str = "tcp",
                 auth_service: bool = False) -> None:
        if backend not in ("tcp", "solana"):
            raise ValueError(f"backend must be tcp or solana, not {backend!r}")
        self.backend = backend
        self.auth_service = auth_service
        workdir = workdir.resolve()  # children run in it: no path may depend on the caller's cwd
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "state.toml"
        self.config.write_text(state_toml)
        self.threads = threads
        self.procs: dict[str, subprocess.Popen] = {}
        self.port = 0
        self.peer = ""

    @property
    def address(self) -> str:
        """The coordinator as clients name it: HOST:PORT of the server, or the local chain's RPC URL."""
        return f"http://127.0.0.1:{self.port}" if self.backend == "solana" else f"127.0.0.1:{self.port}"

    @property
    def target(self) -> list[str]:
        """The CLI options that point a command at this swarm's coordinator."""
        return ["--url", self.address] if self.backend == "solana" else ["--server", self.address]

    def _spawn(self, name: str, *args: str, command: tuple[str, ...] = ("-m", "client.cli")) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), PYTHONUNBUFFERED="1")
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it for its lifetime
        proc = subprocess.Popen([sys.executable, *command, *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=self.workdir)
        log.close()
        self.procs[name] = proc
        return proc

    def log_text(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start_server(self, port: int | None = None) -> None:
        """Start the coordinator: ``psyswarm serve``, or ``psyswarm localnet`` (on ``port`` and the next) and
        ``create-run`` on it."""
        if self.backend == "solana":
            self._start_chain(port)
            return
        self.port = port or self.port or free_port()
        self._spawn("server", "serve", "--config", str(self.config), "--port", str(self.port),
                    "--db", str(self.workdir / "run.sqlite"), *self._admission())
        self._wait(lambda: _listening(self.port), "the coordinator server", "server")

    def _start_chain(self, port: int | None = None, attempts: int = 3) -> None:
        """``psyswarm localnet`` on ``port`` and the next, or on a free pair: another process may take the second
        port between the check and the bind (an outgoing connection's, which no check sees listening), and then
        the chain starts again on another pair."""
        authority = self._keypair("authority")
        for attempt in range(1, attempts + 1):
            self.port = port or _free_pair()
            self._spawn("server", "localnet", "--port", str(self.port), "--fund", str(authority))
            try:  # ready once it prints its banner, which it does when both ports listen
                self._wait(lambda: "psyswarm localnet:" in self.log_text("server"), "the local chain", "server")
                break
            except RuntimeError as exc:
                if port or attempt == attempts or "address already in use" not in str(exc):
                    raise
        creator = self._spawn("create-run", "create-run", "--url", self.address, "--keypair", str(authority),
                              "--config", str(self.config), *self._admission())
        if creator.wait(120) != 0:
            raise RuntimeError(f"create-run failed:\n{self.log_text('create-run')[-2000:]}")

    def _admission(self) -> list[str]:
        """Who may join the run, as ``serve`` and ``create-run`` take it."""
        if self.auth_service:
            return ["--join-authority", str(self._keypair(JOIN_AUTHORITY))]
        return ["--permissionless"]

    def _keypair(self, name: str) -> Path:
        key = self.workdir / "keys" / f"{name}.json"
        if not key.exists():
            save_keypair(Keypair(), key)
        return key

    def _fund(self, key: Path) -> None:
        """Airdrop transaction fees to a client of the local chain."""
        from solana.rpc.api import Client

        from client.identity import load_keypair

        Client(self.address).request_airdrop(load_keypair(key).pubkey(), CLIENT_LAMPORTS)

    def start_dht(self, port: int = 0) -> None:
        self._spawn("dht", "dht", "--port", str(port))
        self._wait(lambda: DHT_LINE in self.log_text("dht"), "the DHT bootstrap", "dht")
        line = next(x for x in self.log_text("dht").splitlines() if DHT_LINE in x)
        self.peer = line.split(DHT_LINE, 1)[1].strip()

    def start_auth(self, *, stages: int, capacity: int, hf_endpoint: str, snapshot: tuple[str, str] | None = None,
                   max_integrating: int = 1) -> str:
        """Start the run's auth service (``psyswarm auth-service``) on a free port, with the run's join authority
        as its key; returns its URL."""
        args = ["auth-service", "--run-id", self.run_id(), "--stages", str(stages), "--capacity", str(capacity),
                "--hf-endpoint", hf_endpoint, "--max-integrating", str(max_integrating),
                "--keypair", str(self._keypair(JOIN_AUTHORITY)), *self.target]
        if self.backend == "solana":
            self._fund(self._keypair(JOIN_AUTHORITY))  # it pays the fee of each release_slot
        if snapshot is not None:
            args += ["--checkpoint-repo", snapshot[0], "--checkpoint-revision", snapshot[1]]
        self._spawn("auth", *args)
        self._wait(lambda: AUTH_LINE in self.log_text("auth"), "the auth service", "auth")
        line = next(x for x in self.log_text("auth").splitlines() if AUTH_LINE in x)
        return line.split(AUTH_LINE, 1)[1].split()[0]

    def start_client(self, name: str, role: str, stage: str | None = None, extra: tuple[str, ...] = (),
                     command: tuple[str, ...] = ("-m", "client.cli")) -> Path:
        """Start ``psyswarm join-run`` as ``name``; ``command`` replaces ``-m client.cli`` (a test's own client)."""
        key = self._keypair(name)
        if self.backend == "solana":
            self._fund(key)
        args = ["join-run", *self.target, "--run-id", self.run_id(), "--role", role,
                "--initial-peer", self.peer, "--keypair", str(key), "--threads", str(self.threads),
                "--checkpoint-dir", str(self.workdir / "checkpoints")]
        if stage:
            args += ["--stage", stage]
        self._spawn(name, *args, *extra, command=command)
        return key

    def observer(self):
        """A backend that only watches the run (a throwaway identity; it never joins)."""
        if self.backend == "solana":
            from client.backends.solana import SolanaBackend

            return SolanaBackend(self.address, Keypair(), self.run_id())
        from client.backends.tcp import TcpBackend

        return TcpBackend(self.address, Keypair())

    def run_id(self) -> str:
        import tomllib

        return tomllib.loads(self.config.read_text())["run_id"]

    def _wait(self, ready, what: str, name: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{what} exited early:\n{self.log_text(name)[-2000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not start within {timeout:.0f} s:\n{self.log_text(name)[-2000:]}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(30)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL what is still there after ``grace`` seconds."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _free_pair() -> int:
    """A port whose next one was free too when asked (the chain takes RPC and RPC + 1 for websockets)."""
    while True:
        port = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except (OSError, OverflowError):  # taken, or the last port there is
            continue


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False
