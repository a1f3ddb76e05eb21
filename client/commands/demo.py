"""``psyswarm demo``: run the whole system locally on the embedded defaults."""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import Annotated

import typer


class DemoModel(enum.StrEnum):
    """The models the demo trains (``client.swarm.demo.MODELS``), named here so that ``--help`` stays fast."""

    psyswarm = "psyswarm"
    tiny_llama = "tiny-llama"


def demo_model(text: str) -> DemoModel:
    """``--model``'s value, or a usage error naming the choices and the likeliest one meant."""
    import difflib

    if isinstance(text, DemoModel):
        return text
    choices = [m.value for m in DemoModel]
    if text not in choices:
        close = difflib.get_close_matches(text, choices, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise typer.BadParameter(f"'{text}' is not a demo model: choose {' or '.join(map(repr, choices))}{hint}")
    return DemoModel(text)


def demo(
    workdir: Annotated[Path, typer.Option(help="Where the run's database, logs, checkpoints and plot go: a new or "
                                               "empty directory, or one an earlier demo made (it is emptied, "
                                               "but for a prepared tiny Llama).")] = Path(
        "runs/demo"),
    epochs: Annotated[int, typer.Option(min=1, help="Epochs to train.")] = 3,
    rounds: Annotated[int, typer.Option(min=1, help="Rounds (optimizer steps) per epoch.")] = 8,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 900.0,
    backend: Annotated[str, typer.Option(help="tcp (the centralised server) or solana (the program on a local "
                                              "chain, ticked by the clients).")] = "tcp",
    model: Annotated[DemoModel, typer.Option(parser=demo_model, metavar="psyswarm|tiny-llama", help=(
        "psyswarm: the embedded byte-level model on the whole corpus. tiny-llama: the tiny Llama of "
        "examples/tiny-llama (6 layers, 64 wide, a 2048-token BPE trained here) on the first 2 MB of the corpus, "
        "prepared once (about 10 s) and kept in the workdir for the next run."))] = DemoModel.psyswarm,
    port_base: Annotated[int, typer.Option(metavar="PORT", help=(
        "Take the demo's 10 ports from PORT on: the coordinator PORT (a local chain PORT and PORT+1), the DHT "
        "bootstrap PORT+2, the workers' gRPC PORT+3..5 and DHT nodes PORT+6..8, the trainer's DHT node PORT+9 "
        "[default: free ports]."))] = 0,
) -> None:
    """Start a coordinator, a DHT and a 3-stage pipeline on this machine and train on the stdlib's sources."""
    if backend not in ("tcp", "solana"):
        raise typer.BadParameter(f"--backend must be tcp or solana, not {backend!r}")
    if port_base:
        from client.swarm.demo import PORTS_TAKEN, busy_ports  # light: no torch

        if not 1024 <= port_base <= 65536 - PORTS_TAKEN:
            raise typer.BadParameter(f"{port_base} leaves no room for {PORTS_TAKEN} ports: give 1024..."
                                     f"{65536 - PORTS_TAKEN}", param_hint="--port-base")
        if busy := busy_ports(port_base):
            raise typer.BadParameter(f"port {', '.join(map(str, busy))} of {port_base}..{port_base + PORTS_TAKEN - 1} "
                                     "is in use: give another --port-base", param_hint="--port-base")
    started = time.monotonic()
    typer.echo(f"psyswarm demo: {epochs} epochs of {rounds} rounds on the {backend} backend, model {model.value}, "
               f"in {workdir}; loading the libraries")
    from client.swarm.demo import WorkdirNotOurs, plot, run_demo  # seconds: torch, hivemind, solders
    try:
        results = run_demo(workdir, epochs, rounds, timeout, out=typer.echo, backend=backend, model=model.value,
                           port_base=port_base)
    except WorkdirNotOurs as exc:
        typer.secho(str(exc), fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo("\ninterrupted: every child process was stopped")
        raise typer.Exit(130) from None
    except (RuntimeError, TimeoutError) as exc:
        typer.secho(f"the demo failed: {exc}\nlogs: {workdir / 'logs'}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    if not results:
        typer.secho(f"no round finished; see the logs in {workdir / 'logs'}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    png = plot(results, workdir / "loss.png", model.value)
    rate = sum(r.tokens for r in results) / sum(r.seconds for r in results)
    trained = sorted({r.epoch for r in results})
    typer.echo(
        f"\ndone in {time.monotonic() - started:.0f} s: trained epochs {trained[0]}-{trained[-1]} "
        f"({len(trained)} of {epochs}), {len(results)} rounds, "
        f"loss {results[0].loss:.3f} -> {results[-1].loss:.3f}, {rate:,.0f} tokens/s while training\n"
        f"loss curve: {png}\ncheckpoints: {workdir / 'checkpoints'}\nlogs: {workdir / 'logs'}")


def register(app: typer.Typer) -> None:
    app.command()(demo)
