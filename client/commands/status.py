"""``psyswarm status``: where a run stands, from its coordinator and, with ``--initial-peer``, its DHT."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated

import typer

from client.commands.connect import ProgramId, RunId, Server, Url, admission_line, connect
from client.commands.pipeline import InitialPeers


def status(
    run_id: RunId,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    keypair: Annotated[Path | None, typer.Option("--keypair", "-k", hidden=True, help=(
        "Not read: status only reads the run, as a throwaway identity; accepted so that a command line made for "
        "another command works."))] = None,
    watch: bool = typer.Option(False, help="Keep printing the status as the run changes."),
    initial_peers: InitialPeers = [],  # noqa: B006 - typer reads the default, never mutates it
) -> None:
    """Show the run: phase, epoch, round, clients per stage, witnesses, checkpoint; with the run's DHT
    (--initial-peer), also the last loss the trainers committed and the workers each stage announces, with
    how many are still syncing. Needs no keypair: it only reads."""
    from solders.keypair import Keypair

    from client.swarm.status import describe

    async def run() -> None:
        backend = await connect(server, Keypair(), url, run_id, program_id)
        board = await asyncio.to_thread(open_board, initial_peers, backend.state) if initial_peers else None
        try:
            async for state in backend.updates():
                text = describe(state, now=time.time()) + "\n" + admission_line(state)
                if board is not None:
                    text += "\n" + await asyncio.to_thread(loss_line, board, state)
                    text += "\n" + await asyncio.to_thread(dht_workers_line, board, state)
                typer.echo(text + ("\n" if watch else ""))
                if not watch:
                    return
        finally:
            await backend.close()
            if board is not None:
                await asyncio.to_thread(board.dht.shutdown)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


def open_board(initial_peers: list[str], state):
    """The run's records in the DHT, under its instance (``Board``)."""
    from client.pipeline.discovery import start_dht
    from client.witness.records import Board

    return Board(start_dht(initial_peers), state)


def loss_line(board, state) -> str:
    from client.witness.records import last_loss

    found = last_loss(board, state)
    if found is None:
        return "last loss: none committed yet"
    epoch, round_, loss = found
    return f"last loss: {loss:.4f} (epoch {epoch}, round {round_ + 1})"


def dht_workers_line(board, state) -> str:
    from client.swarm.status import workers_line

    return workers_line(dht_worker_records(board, state))


def dht_worker_records(board, state) -> dict:
    """Each stage's name and the worker records it announces in the run's DHT."""
    from client.contributor.run_model import model_config
    from client.pipeline.discovery import WorkerDirectory
    from client.stages import stage_name
    from coordinator_program.spec.derived import run_instance

    directory = WorkerDirectory(board.dht, run_instance(state), model_config(state).fingerprint())
    stages = [stage_name(i, state.config.num_stages) for i in range(state.config.num_stages)]
    return {stage: directory.records(stage) for stage in stages}


def register(app: typer.Typer) -> None:
    app.command()(status)
