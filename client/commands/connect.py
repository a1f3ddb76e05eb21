"""How a command reaches a run: the options that name it, the caller's keys, and connecting to its coordinator.

A coordinator is reached either with ``--server`` (the TCP backend) or with ``--url`` and ``--run-id`` (the Solana
program on a cluster); ``open_backend`` checks that exactly one was given, and ``connect`` that the coordinator serves
the run the command names.

Who may join a run is fixed when it is created (``serve`` on TCP, ``create-run`` on Solana), and its creator must say
it: ``--join-authority`` names the key that countersigns every join (the run's auth service), and only
``--permissionless`` opens the run to anyone (``chosen_join_authority``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from client.commands.options import keypair_option, url_option

SERVER_HELP = "The TCP coordinator as HOST:PORT (started with `psyswarm serve`); or give --url."
Server = Annotated[str | None, typer.Option(metavar="HOST:PORT", help=SERVER_HELP)]
KeypairFile = Annotated[Path, keypair_option()]
Url = Annotated[str | None, url_option("A Solana cluster instead of --server: an RPC URL or localhost, devnet, "
                                       "testnet, mainnet-beta (as the Solana CLI's --url).")]
RunId = Annotated[str, typer.Option(metavar="RUN_ID", help=(
    "The run: it locates the run on chain, and a TCP coordinator must serve this run."))]
ProgramId = Annotated[str | None, typer.Option(envvar="PSYSWARM_PROGRAM_ID", help=(
    "The coordinator program's address on the cluster [default: the project's development program id]."))]
JoinAuthority = Annotated[str | None, typer.Option(metavar="PUBKEY_OR_KEYPAIR_FILE", help=(
    "The run's join authority: the key of its auth service (`psyswarm auth-service` prints it), as a public "
    "key or a keypair file. The coordinator then admits only joins it countersigned."))]
Permissionless = Annotated[bool, typer.Option(help="Let anyone join the run, with no auth service.")]


def public_key(text: str, option: str):
    """A base58 public key, or the public key of the keypair file ``text`` names; a usage error otherwise."""
    from solders.pubkey import Pubkey

    from client.identity import KeypairError, load_keypair

    try:
        return Pubkey.from_string(text)
    except ValueError:
        pass
    try:
        return load_keypair(text).pubkey()
    except KeypairError as exc:
        raise typer.BadParameter(f"{option} {text!r}: not a public key, and {exc}") from None


def chosen_join_authority(join_authority: str | None, permissionless: bool) -> bytes:
    """The join authority a run's creator chose: a key, or none (``NO_AUTHORITY``) only when it says
    ``--permissionless``. Neither, or both, exits with a one-line error."""
    from coordinator_program.spec.rules import NO_AUTHORITY

    if (join_authority is None) != permissionless:
        both = "give --join-authority or --permissionless, not both: a run with a join authority is not permissionless"
        neither = ("say who may join the run: --join-authority PUBKEY_OR_KEYPAIR_FILE (its auth service's key) or "
                   "--permissionless (anyone)")
        typer.secho(both if permissionless else neither, fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    if join_authority is None:
        return NO_AUTHORITY
    key = bytes(public_key(join_authority, "--join-authority"))
    if key == NO_AUTHORITY:
        raise typer.BadParameter("the all-zero key means no join authority: say --permissionless instead",
                                 param_hint="--join-authority")
    return key


def admission_line(state) -> str:
    from coordinator_program.facts import admission

    return f"admission: {admission(state.join_authority)}"


def open_identity(keypair: Path):
    """The caller's keypair, or end the command with the reason it cannot be read."""
    from client.identity import KeypairError, load_keypair

    try:
        return load_keypair(keypair)
    except KeypairError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def check_target(server: str | None, url: str | None, run_id: str | None) -> None:
    """A usage error unless exactly one of ``--server`` and ``--url`` is given, and ``--url`` with ``--run-id``."""
    if (server is None) == (url is None):
        raise typer.BadParameter("give exactly one of --server (a TCP coordinator) and --url (a Solana cluster)")
    if url is not None and run_id is None:
        raise typer.BadParameter("--url needs --run-id: the run id locates the run's accounts on chain")


def open_backend(server: str | None, url: str | None, run_id: str | None, program_id: str | None, keypair,
                 authorizer=None):
    """The backend ``--server`` or ``--url`` names, not yet connected; ``authorizer`` co-signs its joins (the
    client's ``AuthSession`` on a permissioned run)."""
    check_target(server, url, run_id)
    if server is not None:
        from client.backends.tcp import TcpBackend

        return TcpBackend(server, keypair, authorizer=authorizer)
    assert url is not None and run_id is not None
    from client.backends.solana import SolanaBackend

    return SolanaBackend(url, keypair, run_id, program_id=program_address(program_id), authorizer=authorizer)


def program_address(program_id: str | None):
    """``--program-id`` as a public key; the project's development program when it is not given."""
    from solders.pubkey import Pubkey

    from coordinator_program.onchain.program_id import PROGRAM_ID

    try:
        return Pubkey.from_string(program_id) if program_id else PROGRAM_ID
    except ValueError:
        raise typer.BadParameter(f"--program-id {program_id!r} is not a base58 public key") from None


async def connect(server: str | None, keypair, url: str | None = None, run_id: str | None = None,
                  program_id: str | None = None, authorizer=None):
    """A connected backend of run ``run_id``, or exit with the reason it could not connect (a TCP coordinator
    serving another run included: every command names the run it means)."""
    from client.backends.base import BackendError

    try:
        backend = open_backend(server, url, run_id, program_id, keypair, authorizer)
        await backend.connect()
    except BackendError as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    served = backend.state.run_id
    if run_id is not None and served != run_id:
        await backend.close()
        typer.secho(f"the coordinator at {server or url} serves run {served!r}, not {run_id!r}: check --run-id and "
                    "the coordinator's address", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    return backend
