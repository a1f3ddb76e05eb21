"""``psyswarm join-run``: contribute a stage worker or a trainer to a run.

Its log goes to stdout. A problem that ends the client (a join that cannot succeed, a DHT it cannot reach, a
dataset it does not have) is one line on stderr, naming the problem and the fix, and a non-zero exit status.
SIGTERM or Ctrl+C stops it within ``STOP_GRACE`` seconds, whatever it is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from client.commands.connect import KeypairFile, ProgramId, RunId, Server, Url
from client.commands.pipeline import (
    DeviceOption,
    InflightOption,
    InitialPeers,
    PublicHost,
    parse_device_option,
    parse_inflight_option,
    parse_public_host,
    quiet_clean_p2p_stop,
)
from client.data import DEFAULT_MAX_DATASET_BYTES
from client.identity import DEFAULT_KEYPAIR_PATH
from client.join.checkpoints import SNAPSHOT_EVERY

if TYPE_CHECKING:
    from rich.console import Console
    from solders.keypair import Keypair

    from client.backends.base import Backend
    from client.contributor.context import RunnerOptions
    from client.join.auth import AuthSession


def parse_stage(text: str | None) -> int:
    """``head``, ``bodyK``, ``tail`` or a stage number; None lets the coordinator choose."""
    from coordinator_program.spec import limits

    if text is None:
        return limits.NO_STAGE
    if text.isdigit():
        return int(text)
    if text == "head":
        return 0
    if text.startswith("body") and text[4:].isdigit() and int(text[4:]) >= 1:
        return int(text[4:])
    if text == "tail":
        return -1
    raise typer.BadParameter(f"{text!r} is not a stage: use head, body1..bodyK, tail or a number")


STOP_GRACE = 8.0
"""Seconds from SIGTERM or Ctrl+C to the process's end at the latest: the client's clean leave gets
``client.contributor.runner.STOP_TIMEOUT`` of them; past STOP_GRACE the process ends regardless."""
STOPPED = "stopped; started again with the same keypair, it rejoins the run (a worker from the stage it saved)"


class Stopper:
    """Stops the client on SIGTERM or SIGINT within ``grace`` seconds, whatever it is doing.

    The first signal cancels the running client, whose clean leave is bounded (before the event loop runs, it
    interrupts the main thread instead), and arms a timer that ends the process after ``grace`` seconds whatever
    still runs: threads busy with compute, a download or a peer that does not answer cannot be interrupted, and
    Python would wait for them. A second signal ends the process at once.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.requested = False
        self.finished = False  # the client has ended (the run finished, or it failed): only the exit is left
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.requested:
            end_process(0, STOPPED)
        if self.finished:  # the client is done and the process is on its way out: no traceback from an exit hook
            end_process(128 + signum)
        self.requested = True
        timer = threading.Timer(self.grace, end_process, (0, f"{STOPPED} (its clean leave was cut short)"))
        timer.daemon = True
        timer.start()
        if self.loop is None or self.task is None:
            raise KeyboardInterrupt
        self.loop.call_soon_threadsafe(self.task.cancel)

    def run(self, main: Coroutine[Any, Any, None]) -> None:
        """Run ``main`` on a fresh event loop; ``KeyboardInterrupt`` if a signal stopped it. The loop's threads are
        not waited for (``asyncio.run`` would: a thread stuck in compute would hold the process)."""
        loop = asyncio.new_event_loop()
        self.loop, self.task = loop, loop.create_task(main)
        try:
            loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            if not self.requested:
                raise
            raise KeyboardInterrupt from None
        finally:
            self.task, self.finished = None, True
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.wait(left, timeout=1.0))
            loop.close()
            self.loop = None


def end_process(code: int, line: str | None = None) -> None:
    """Print ``line`` and end the process with ``code`` now, not waiting for threads or helper processes that are
    still busy: they cannot be interrupted, and helpers die with this process (``client.helper_processes``). Safe
    in a signal handler, which may interrupt a write to stdout."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: a reentrant call, from a signal handler
            stream.flush()
    if sys.stdout.isatty():
        os.write(sys.stdout.fileno(), b"\x1b[?25h")  # the live line hid the cursor: a terminal gets it back
    if line is not None:
        os.write(sys.stdout.fileno(), f"{line}\n".encode())
    os._exit(code)


def finish(code: int) -> None:
    """End ``join-run`` with ``code``: at once if a thread or a helper process is still busy, which Python would
    wait for; otherwise as any command ends."""
    busy = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if busy or multiprocessing.active_children():
        end_process(code)
    if code:
        raise typer.Exit(code)


def fail(line: str, code: int = 1) -> typer.Exit:
    """Say why the client cannot go on, on one line of stderr; the caller raises what this returns."""
    typer.secho(" ".join(line.split()), fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def join_run(
    run_id: RunId,
    role: Annotated[str, typer.Option(help="worker (holds one pipeline stage) or trainer (routes data).")],
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
    stage: Annotated[str | None, typer.Option(help="Ask for a stage (head, body1.., tail); the "
                                                   "coordinator picks the least occupied if omitted.")] = None,
    keypair: KeypairFile = DEFAULT_KEYPAIR_PATH,
    checkpoint_dir: Annotated[Path, typer.Option(help="Where a worker saves its stage at each epoch's end.")] = (
        Path("checkpoints")),
    host: Annotated[str, typer.Option(help="Address this client's worker and DHT node listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="A worker's gRPC port, for trainers to reach (open it "
                                                            "in a firewall); 0 picks a free one.")] = 0,
    dht_port: Annotated[int, typer.Option(min=0, max=65535, help="This client's DHT node's port; 0 picks a free "
                                                                "one.")] = 0,
    public_host: PublicHost = None,
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's default).")] = 0,
    hub_repo: Annotated[str | None, typer.Option(help="A worker saves its stage at each epoch's end to this "
                                                      "Hugging Face repo (branch epoch-N) instead of "
                                                      "--checkpoint-dir.")] = None,
    auth_url: Annotated[str | None, typer.Option(help="The run's auth service (`psyswarm auth-service`): it "
                                                     "exchanges your Hugging Face token for a contributor slot, "
                                                     "assigns the stage and countersigns the join. Omit for a "
                                                     "permissionless run.")] = None,
    hf_token: Annotated[str | None, typer.Option(
        envvar="HF_TOKEN", help="Hugging Face token for --auth-url and --hub-repo [default: the huggingface_hub "
                                "login].")] = None,
    hf_endpoint: Annotated[str | None, typer.Option(envvar="HF_ENDPOINT", help="Hugging Face endpoint (for a "
                                                                               "mirror or a private hub).")] = None,
    snapshot_every: Annotated[int, typer.Option(help="A worker snapshots its stage under --checkpoint-dir every N "
                                                     "steps (0: never); if the stage empties, its next worker "
                                                     "starts from the newest snapshot.", min=0)] = SNAPSHOT_EVERY,
    device: DeviceOption = "auto",
    inflight: InflightOption = "auto",
    max_dataset_gib: Annotated[int, typer.Option(min=1, help=(
        "The most a trainer downloads of the run's dataset, in GiB: a dataset.json declaring more is refused "
        "before any token file is fetched."))] = DEFAULT_MAX_DATASET_BYTES >> 30,
    check_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help=(
        "The share of a trainer's microbatches it also asks of a second worker of each stage, chosen in secret, "
        "to catch wrong answers (runs that average gradients every step only; 0: none)."))] = 0.05,
    check_tolerance: Annotated[float, typer.Option(min=0.0, help=(
        "How far two workers' answers may differ and still agree (0: identical digests, right on CPU; set one "
        "where kernels are not deterministic, such as bf16 on GPUs)."))] = 0.0,
) -> None:
    """Join a run and contribute until it finishes: queue, load the model at warmup, train each round."""
    import client.contributor.runner  # noqa: F401 - torch, hivemind (seconds) load before the Stopper, not in its loop
    from client.commands.connect import check_target, open_identity
    from client.commands.live import terminal_console
    from client.contributor.context import RunnerOptions
    from coordinator_program.spec.state import Role

    check_target(server, url, run_id)
    if role not in ("worker", "trainer"):
        raise typer.BadParameter(f"--role must be worker or trainer, not {role!r}")
    if not initial_peers:
        raise typer.BadParameter("give the run's DHT with --initial-peer (printed by `psyswarm dht`)")
    if not all(peer.strip() for peer in initial_peers):
        raise typer.BadParameter("--initial-peer is empty (an unset shell variable?): give the address `psyswarm "
                                 "dht` printed")
    wanted = parse_stage(stage)
    if role == "trainer" and stage is not None:
        raise typer.BadParameter("a trainer holds no stage: drop --stage")
    if auth_url and stage is not None:
        raise typer.BadParameter("the auth service assigns the stage: drop --stage when using --auth-url")
    chosen_device = parse_device_option(device)
    max_inflight = parse_inflight_option(inflight)
    reached_at = parse_public_host(host, public_host, worker=role == "worker")
    if not math.isfinite(check_tolerance):
        raise typer.BadParameter(f"{check_tolerance!r}: give a finite number ≥ 0 (0: identical answers)",
                                 param_hint="--check-tolerance")
    if role == "worker" and max_inflight is not None:
        raise typer.BadParameter("a worker sends no microbatches: --inflight is a trainer's; drop it")
    console = terminal_console()
    log_to_stdout(console)
    if threads:
        import torch

        torch.set_num_threads(threads)
    stopper = Stopper(STOP_GRACE)  # the process's handlers from here to its end: a mistake above changes none
    stopper.install()
    code = 0
    try:
        identity = open_identity(keypair)
        claim = claim_or_exit(identity, run_id)  # noqa: F841 - held, not used: the claim lasts while it is open
        auth = authorize(auth_url, identity, run_id, role, hf_token) if auth_url else None
        options = RunnerOptions(role=Role.Worker if role == "worker" else Role.Trainer,
                                initial_peers=list(initial_peers),
                                stage=auth.grant.stage if auth is not None and role == "worker" else wanted,
                                checkpoint_dir=checkpoint_dir, host=host, public_host=reached_at, hub_repo=hub_repo,
                                hf_token=hf_token, hf_endpoint=hf_endpoint, auth=auth, snapshot_every=snapshot_every,
                                device=chosen_device, port=port, dht_port=dht_port, max_inflight=max_inflight,
                                max_dataset_bytes=max_dataset_gib << 30, check_rate=check_rate,
                                check_tolerance=check_tolerance)
        target = RunTarget(server, url, run_id, program_id, identity, authorizer=auth)
        stopper.run(contribute(target, options, console, asked=stage, keypair_file=keypair))
    except KeyboardInterrupt:
        typer.echo(STOPPED)
    except typer.Exit as exc:
        code = exc.exit_code
    finish(code)


@dataclasses.dataclass(frozen=True)
class RunTarget:
    """The run's coordinator as ``join-run`` names it (``--server``, or ``--url`` with ``--run-id`` and
    ``--program-id``), reached as ``identity``, with ``authorizer`` countersigning its joins on a permissioned run."""

    server: str | None
    url: str | None
    run_id: str
    program_id: str | None
    identity: Keypair
    authorizer: AuthSession | None

    async def connect(self) -> Backend:
        """The first connection; exit with the reason if it fails."""
        from client.commands.connect import connect

        return await connect(self.server, self.identity, self.url, self.run_id, self.program_id,
                             authorizer=self.authorizer)

    async def reconnect(self) -> Backend:
        """A connection again after the coordinator was lost; ``BackendError`` if it cannot be made yet."""
        from client.commands.connect import open_backend

        backend = open_backend(self.server, self.url, self.run_id, self.program_id, self.identity,
                               authorizer=self.authorizer)
        await backend.connect()
        return backend


async def contribute(target: RunTarget, options: RunnerOptions, console: Console | None, *, asked: str | None,
                     keypair_file: Path) -> None:
    """Connect, check that the run can take this client as ``options`` ask (``asked``: the --stage given), then
    contribute until the run finishes; every way it can fail ends as ``typer.Exit`` with its line on stderr."""
    from client.backends.base import BackendError
    from client.commands.live import live_line
    from client.contributor.errors import CannotContribute, ContributorRemoved
    from client.contributor.runner import Contributor
    from coordinator_program.spec import limits
    from coordinator_program.spec.state import Role

    identity, auth = target.identity, options.auth
    backend = await target.connect()
    state = backend.state
    refusal = admission_mismatch(state.join_authority, auth)
    if refusal is not None:
        await backend.close()
        typer.secho(refusal, fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    if await unfunded(backend, identity):
        await backend.close()
        raise fail(f"{identity.pubkey()} has no SOL to pay its transactions' fees on {target.url}: fund it first: "
                   f"`psyswarm airdrop -u {target.url} -k {keypair_file}` (localnet, devnet, testnet), or send it SOL")
    me = bytes(identity.pubkey())
    if state.client_index(me) is not None or state.pending_index(me) is not None:
        logging.getLogger("psyswarm.client").warning(
            "%s is already in run %s: taking its place again (a restart after a crash?); if another machine "
            "runs this keypair, stop one of them: one keypair per process", identity.pubkey(), target.run_id)
    num_stages = state.config.num_stages
    chosen = num_stages - 1 if options.stage == -1 else options.stage
    if options.role == Role.Worker and chosen != limits.NO_STAGE and chosen >= num_stages:
        await backend.close()
        which = f"the auth service's stage {chosen}" if auth is not None else f"--stage {asked}"
        raise fail(f"this run has {num_stages} stages, and {which} is not one of them: ask for "
                   f"{stage_choices(num_stages)}, or leave --stage out", code=2)
    contributor = Contributor(backend, identity, dataclasses.replace(options, stage=chosen))
    try:
        with live_line(contributor.status, console):
            await contributor.run(target.reconnect)
    except BackendError as exc:
        raise fail(str(exc) if exc.permanent else
                   f"gave up on the coordinator: {exc}; rerun the same command to rejoin") from None
    except CannotContribute as exc:
        raise fail(str(exc)) from None
    except ContributorRemoved as exc:
        raise fail(f"left the run: {exc}; check this machine's network, then rerun the same command") from None
    finally:
        await contributor.backend.close()


def stage_choices(num_stages: int) -> str:
    """The stages a worker may ask for, as ``--stage`` takes them."""
    from client.stages import stage_names

    names = stage_names(num_stages)
    return ", ".join(names) if num_stages <= 4 else f"head, body1..{names[-2]}, tail"


def log_to_stdout(console: Console | None = None) -> None:
    """The client's log, hivemind's and Python's warnings go to stdout, leaving stderr to the line that says why
    the client stopped, if it had to; through ``console`` on a terminal, so that they scroll above the live line."""
    from hivemind.utils.logging import use_hivemind_log_handler

    from client.commands.live import ConsoleHandler

    handler = logging.StreamHandler(sys.stdout) if console is None else ConsoleHandler(console)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per RPC call drowns the run's own lines
    logging.captureWarnings(True)
    use_hivemind_log_handler("nowhere")
    quiet_clean_p2p_stop()


async def unfunded(backend, identity: Keypair) -> bool:
    """Whether this client pays fees on a Solana cluster and holds no SOL at all: every transaction it sends, its
    join first, would fail. False when the balance cannot be read: the join then says what went wrong."""
    from client.backends.solana import SolanaBackend

    if not isinstance(backend, SolanaBackend):
        return False
    try:
        return (await backend.client.get_balance(identity.pubkey())).value == 0
    except Exception:  # noqa: BLE001 - the RPC fails in many ways; the check is only a shortcut to a clearer line
        return False


def claim_or_exit(identity: Keypair, run_id: str):
    """This process's claim on its identity (``client.commands.claim``), or exit with the one line that says which
    process holds it and what to do."""
    from client.commands.claim import IdentityInUse, claim_identity

    try:
        return claim_identity(str(identity.pubkey()), run_id)
    except IdentityInUse as exc:
        raise fail(str(exc)) from None


def admission_mismatch(join_authority: bytes, auth: AuthSession | None) -> str | None:
    """Why the coordinator would refuse every join of this client, known before trying: a permissioned run
    joined without its auth service, or through an auth service that is not the run's join authority."""
    from coordinator_program.facts import admission
    from coordinator_program.spec.rules import NO_AUTHORITY

    if join_authority == NO_AUTHORITY:
        return None
    if auth is None:
        return f"this run is {admission(join_authority)}: join through its auth service with --auth-url"
    if bytes(auth.pubkey()) != join_authority:
        return (f"the auth service's key {auth.pubkey()} is not this run's join authority: the run is "
                f"{admission(join_authority)}; check --auth-url")
    return None


def authorize(url: str, keypair: Keypair, run_id: str, role: str, hf_token: str | None) -> AuthSession:
    """Step 1 of the join flow: a Hugging Face token for a contributor slot and a stage, confirmed in one line."""
    from client.join.auth import AuthError, AuthSession, confirmation_line, resolve_token

    try:
        session = AuthSession.open(url, keypair, run_id, resolve_token(hf_token), role)
    except AuthError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(confirmation_line(session.grant))
    return session


def register(app: typer.Typer) -> None:
    app.command("join-run")(join_run)
