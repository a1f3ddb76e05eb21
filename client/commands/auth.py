"""``psyswarm auth-service``: run a run's auth service (Hugging Face token → contributor slot and stage)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from client.commands.connect import ProgramId, check_target, open_backend, program_address
from client.commands.options import url_option
from client.commands.signals import sigterm_interrupts

CoordinatorServer = Annotated[str | None, typer.Option("--server", metavar="HOST:PORT", help=(
    "The run's TCP coordinator (`psyswarm serve`), which the service tells when a slot ends; or give --url."))]
CoordinatorUrl = Annotated[str | None, url_option(
    "The Solana cluster of the run instead of --server (an RPC URL or localhost, devnet, ...): the join authority "
    "pays a transaction fee each time it tells the program that a slot ended, so fund its key.")]


def auth_service(
    run_id: Annotated[str, typer.Option(metavar="RUN_ID", help="The run this service admits contributors to.")],
    stages: Annotated[int, typer.Option(help="Pipeline stages of the run (joiners get the least occupied).")],
    capacity: Annotated[int, typer.Option(help="Contributor slots (one per process); a full swarm rejects joins.")],
    max_slots_per_token: Annotated[int, typer.Option(
        min=1, help="Slots one contributor may hold: every process under a token (or another token of the same "
                    "Hub user) counts toward it, so no one fills the swarm.")] = 4,
    db: Annotated[Path, typer.Option(help="SQLite file keeping the slots (and spent request nonces) across "
                                          "restarts.")] = Path("auth.sqlite"),
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one.")] = 0,
    hf_endpoint: Annotated[str | None, typer.Option(envvar="HF_ENDPOINT", metavar="URL", help=(
        "Hugging Face Hub asked who owns a token [default: huggingface.co]."))] = None,
    keypair: Annotated[Path | None, typer.Option("--keypair", "-k", metavar="FILE", help=(
        "The run's join authority: a Solana keypair file that signs grants and countersigns joins; give its public "
        "key to `serve`/`create-run --join-authority` [default: next to --db, created if absent]."))] = None,
    lease: Annotated[float, typer.Option(help="Seconds a slot lives without being renewed.")] = 600.0,
    max_integrating: Annotated[int, typer.Option(help="Joins allowed to sync at once (0: no join queue).")] = 1,
    integration_time: Annotated[float, typer.Option(help="Seconds a join may hold the queue at most.")] = 900.0,
    checkpoint_repo: Annotated[str | None, typer.Option(help="Hub repo of the stage snapshots joiners "
                                                             "download.")] = None,
    checkpoint_revision: Annotated[str, typer.Option(help="Revision of --checkpoint-repo.")] = "main",
    program_id: ProgramId = None,
    server: CoordinatorServer = None,
    url: CoordinatorUrl = None,
    publish_contributors: Annotated[bool, typer.Option(help=(
        "Let anyone read GET /api/contributors, which Hub user holds which key (a dashboard's leaderboard uses "
        "it); private by default."))] = False,
) -> None:
    """Serve PUT /api/join (Bearer <HF token>), POST /api/queue|synced|leave|countersign and GET /api/occupancy.

    The service tells the run's coordinator (--server or --url) whenever a slot ends, and frees the slot only
    once the coordinator has let its key go: that is what keeps a contributor's keys in the run within its cap."""
    from solders.keypair import Keypair

    from client.identity import KeypairError, load_keypair, save_keypair
    from local_backend.auth.app import AuthHTTPServer
    from local_backend.auth.identity import HubIdentity
    from local_backend.auth.release import Releaser
    from local_backend.auth.rules import AuthService
    from local_backend.logs import to_stderr
    from local_backend.store import StoreError

    check_target(server, url, run_id)
    to_stderr(logging.INFO)
    key_path = keypair or db.with_suffix(".join-authority.json")
    try:
        if keypair is None and not key_path.exists():  # the run's join authority must outlive a restart
            save_keypair(Keypair(), key_path)
        signer = load_keypair(key_path)
    except KeypairError as exc:
        raise typer.BadParameter(str(exc), param_hint="--keypair") from None
    program = program_address(program_id)
    endpoint = hf_endpoint or None
    checkpoint = {"repo": checkpoint_repo, "revision": checkpoint_revision} if checkpoint_repo else None
    identity = HubIdentity(endpoint)
    try:
        service = AuthService(run_id=run_id, num_stages=stages, capacity=capacity, identify=identity,
                              max_slots_per_token=max_slots_per_token, db=db, lease_seconds=lease,
                              max_integrating=max_integrating, integration_seconds=integration_time,
                              checkpoint=checkpoint, keypair=signer, program_id=program,
                              publish_contributors=publish_contributors)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except StoreError as exc:
        raise typer.BadParameter(str(exc), param_hint="--db") from None
    try:
        web = AuthHTTPServer(service, host, port)
    except OSError as exc:
        service.close()
        typer.secho(f"cannot listen on {host}:{port}: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"auth service for run {run_id} listening on {web.url} "
               f"({capacity} slots, at most {max_slots_per_token} per contributor, {stages} stages, "
               f"identities from {identity.endpoint}, slots kept in {db})")
    typer.echo(f"join authority {signer.pubkey()} (from {key_path}): start the run with `psyswarm serve` or "
               f"`psyswarm create-run` --join-authority {signer.pubkey()}")
    mistake = coordinator_mistake(server, url, run_id, program_id, signer, key_path)
    if mistake:
        web.server_close()
        service.close()
        typer.secho(mistake, fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    releaser = Releaser(service, coordinator_release(server, url, run_id, program_id, signer)).start()
    try:
        with sigterm_interrupts():
            web.serve_forever()
    except KeyboardInterrupt:
        typer.echo("auth service stopped; its slots are kept in the same --db")
    finally:
        web.server_close()
        releaser.stop()
        service.close()


def misconfigured(state, where: str, run_id: str, signer, key_path: Path | None = None) -> str | None:
    """Why the coordinator at ``where`` (its ``state``) will never take this service's releases, or None: it
    serves another run, or ``signer`` is not its join authority (the operator gave the wrong address, run or key)."""
    from solders.pubkey import Pubkey

    from coordinator_program.spec.rules import NO_AUTHORITY

    if state.run_id != run_id:
        return (f"the coordinator at {where} serves run {state.run_id!r}, not {run_id!r}: give the auth service "
                f"that run's --run-id, or the coordinator of run {run_id!r}")
    if state.join_authority == bytes(signer.pubkey()):
        return None
    has = ("no join authority (a permissionless run)" if state.join_authority == NO_AUTHORITY
           else f"join authority {Pubkey.from_bytes(state.join_authority)}")
    key = f" {key_path}" if key_path is not None else ""
    return (f"the coordinator of run {run_id!r} at {where} has {has}, not this service's key {signer.pubkey()}: "
            f"start it with --join-authority{key}, or give the service the run's join authority with --keypair")


def coordinator_mistake(server: str | None, url: str | None, run_id: str, program_id: str | None, signer,
                        key_path: Path) -> str | None:
    """Checked at startup: ``misconfigured`` for the coordinator the service tells, if it can be reached now (a
    service started before its coordinator, as a new permissioned run is, checks nothing: its release passes
    report the mistake then)."""
    from client.backends.base import BackendError

    async def check() -> str | None:
        backend = open_backend(server, url, run_id, program_id, signer)
        try:
            await backend.connect()
        except (BackendError, OSError, TimeoutError):
            return None
        try:
            return misconfigured(backend.state, server or url or "", run_id, signer, key_path)
        finally:
            await backend.close()

    return asyncio.run(check())


def coordinator_release(server: str | None, url: str | None, run_id: str, program_id: str | None, signer):
    """The join authority's ``release_slot`` to the coordinator ``--server`` or ``--url`` names, for every key of a
    pass over one connection (a connection downloads the run's state, so not one per key); it returns the keys the
    coordinator confirmed gone, and raises if the coordinator cannot be reached or serves another run."""
    from client.backends.base import BackendError
    from coordinator_program.spec.errors import CoordinatorError, NotHealthy, NotJoined
    from coordinator_program.spec.instructions import ReleaseSlot

    async def release(keys: list[bytes]) -> set[bytes]:
        backend = open_backend(server, url, run_id, program_id, signer)
        await backend.connect()
        confirmed: set[bytes] = set()
        try:
            if (mistake := misconfigured(backend.state, server or url, run_id, signer)) is not None:
                raise BackendError(mistake)
            for key in keys:
                try:
                    await backend.submit(ReleaseSlot(key))
                except (NotJoined, NotHealthy):
                    pass  # the key is gone already, or leaving: what the release is for
                except CoordinatorError as exc:  # refused: its slot stays ended, and the next pass asks again
                    logging.getLogger("psyswarm.auth").warning("the coordinator refused to release key %s…: %s",
                                                               key.hex()[:8], exc)
                    continue
                confirmed.add(key)
        finally:
            await backend.close()
        return confirmed

    return lambda keys: asyncio.run(release(keys))


def register(app: typer.Typer) -> None:
    app.command("auth-service")(auth_service)
