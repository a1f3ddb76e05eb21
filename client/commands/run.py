"""``psyswarm join-run``: contribute a stage worker or a trainer to a run."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.commands.coordinator import KEYPAIR_HELP, ProgramId, Server, Url
from client.commands.pipeline import InitialPeers
from client.identity import DEFAULT_KEYPAIR_PATH

if TYPE_CHECKING:
    from solders.keypair import Keypair

    from client.join.auth import AuthSession


def parse_stage(text: str | None) -> int:
    """``head``, ``bodyK``, ``tail`` or a stage number; None lets the coordinator choose."""
    from coordinator_program import limits

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


def join_run(
    run_id: Annotated[str, typer.Option(help="The run to join; must match the coordinator's.")],
    role: Annotated[str, typer.Option(help="worker (holds one pipeline stage) or trainer (routes data).")],
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
    stage: Annotated[str | None, typer.Option(help="Ask for a stage (head, body1.., tail); the "
                                                   "coordinator picks the least occupied if omitted.")] = None,
    keypair: Annotated[Path, typer.Option(help=KEYPAIR_HELP)] = DEFAULT_KEYPAIR_PATH,
    checkpoint_dir: Annotated[Path, typer.Option(help="Where a worker saves its stage at each epoch's end.")] = (
        Path("checkpoints")),
    host: Annotated[str, typer.Option(help="Address this client's worker and DHT node listen on.")] = "127.0.0.1",
    wire_dtype: Annotated[str, typer.Option(help="Activations on the wire: float32, float16 or bfloat16.")] = (
        "float32"),
    threads: Annotated[int, typer.Option(help="torch threads (0: torch's default).")] = 0,
    hub_repo: Annotated[str | None, typer.Option(help="A worker saves its stage at each epoch's end to this "
                                                      "Hugging Face repo (branch epoch-N) instead of "
                                                      "--checkpoint-dir.")] = None,
    auth_url: Annotated[str | None, typer.Option(help="The run's auth service (`psyswarm auth-service`): it "
                                                     "exchanges your Hugging Face token for a contributor slot "
                                                     "and assigns the stage. Omit for an open run.")] = None,
    hf_token: Annotated[str | None, typer.Option(
        envvar="HF_TOKEN", help="Hugging Face token for --auth-url and --hub-repo [default: the huggingface_hub "
                                "login].")] = None,
    hf_endpoint: Annotated[str | None, typer.Option(envvar="HF_ENDPOINT", help="Hugging Face endpoint (for a "
                                                                               "mirror or a private hub).")] = None,
) -> None:
    """Join a run and contribute until it finishes: queue, load the model at warmup, train each round."""
    import signal

    from client.commands.coordinator import check_target, connect, open_backend, open_identity
    from client.coordinator.backend import BackendError
    from client.runner import Contributor, ContributorRemoved, RunnerOptions
    from coordinator_program import limits
    from coordinator_program.state import Role

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per RPC call drowns the run's own lines
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop cleanly: leave the DHT, close sockets
    check_target(server, url, run_id)
    if role not in ("worker", "trainer"):
        raise typer.BadParameter(f"--role must be worker or trainer, not {role!r}")
    if not initial_peers:
        raise typer.BadParameter("give the run's DHT with --initial-peer (printed by `psyswarm dht`)")
    wanted = parse_stage(stage)
    if role == "trainer" and stage is not None:
        raise typer.BadParameter("a trainer holds no stage: drop --stage")
    if auth_url and stage is not None:
        raise typer.BadParameter("the auth service assigns the stage: drop --stage when using --auth-url")
    if threads:
        import torch

        torch.set_num_threads(threads)
    identity = open_identity(keypair, required=True)
    auth = authorize(auth_url, identity, run_id, role, hf_token) if auth_url else None
    if auth is not None and role == "worker":
        wanted = auth.grant.stage

    async def run() -> None:
        backend = await connect(server, identity, url, run_id, program_id)
        state = backend.state
        if state.run_id != run_id:
            await backend.close()
            typer.secho(f"the coordinator at {server or url} serves run {state.run_id!r}, not {run_id!r}",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(1)
        num_stages = state.config.num_stages
        chosen = num_stages - 1 if wanted == -1 else wanted
        if role == "worker" and chosen != limits.NO_STAGE and chosen >= num_stages:
            await backend.close()
            asked = f"the auth service's stage {chosen}" if auth is not None else repr(stage)
            raise typer.BadParameter(f"this run has {num_stages} stages; {asked} is not one of them")
        options = RunnerOptions(role=Role.Worker if role == "worker" else Role.Trainer,
                                initial_peers=list(initial_peers), stage=chosen, checkpoint_dir=checkpoint_dir,
                                host=host, wire_dtype=wire_dtype, hub_repo=hub_repo, hf_token=hf_token,
                                hf_endpoint=hf_endpoint, auth=auth)
        async def reconnect():
            fresh = open_backend(server, url, run_id, program_id, identity)
            await fresh.connect()
            return fresh

        contributor = Contributor(backend, identity, options)
        try:
            await contributor.run(reconnect)
        except BackendError as exc:
            typer.secho(f"gave up on the coordinator: {exc}; rerun the same command to rejoin",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        except ContributorRemoved as exc:
            typer.secho(f"left the run: {exc}; check this machine's network, then rerun the same command",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        finally:
            await contributor.backend.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        typer.echo("stopped; the coordinator drops this client at the next health check")


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
