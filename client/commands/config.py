"""``psyswarm validate-config``: check a run's ``state.toml`` before anyone launches it."""

from __future__ import annotations

from pathlib import Path

import typer


def load_spec_or_exit(path: Path):
    """Read a state.toml for a command, or end the command with the reason it is invalid."""
    from coordinator_program.config import load_run_spec
    from coordinator_program.errors import CoordinatorError

    try:
        return load_run_spec(path)
    except CoordinatorError as exc:
        typer.secho(f"invalid config: {exc.detail}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def validate_config(
    path: Path = typer.Argument(..., help="The run's state.toml (run_id, [config], [model], [checkpoint])."),
) -> None:
    """Check a run config and print what it implies: account size, witness proof size, bloom error rate."""
    from coordinator_program import limits
    from coordinator_program.facts import config_facts, fits_in_transaction

    spec = load_spec_or_exit(path)
    c = spec.config
    facts = config_facts(c)
    lines = [
        f"run {spec.run_id!r}: {c.num_stages} stages, {c.min_clients}-{c.max_clients} clients, "
        f"{c.rounds_per_epoch} rounds per epoch, {c.total_steps} steps",
        f"coordinator account: {facts.account_bytes:,} bytes",
        f"witness filters: {c.bloom_slices} slices x {c.bloom_bits_per_slice} bits = {facts.bloom_bytes} bytes each",
        f"witness instruction: {facts.witness_data_bytes} bytes of data, "
        f"{facts.witness_transaction_bytes} bytes as a transaction (limit {limits.SOLANA_TX_LIMIT})",
        f"bloom false-positive rate at capacity ({c.max_clients} items): "
        f"{facts.false_positive_rate_at_capacity:.4%}",
    ]
    for line in lines:
        typer.echo(line)
    if not fits_in_transaction(facts):
        typer.secho("a witness proof would not fit in one Solana transaction: raise bloom_error_rate or "
                    "lower max_clients", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.secho("config OK", fg=typer.colors.GREEN)


def register(app: typer.Typer) -> None:
    app.command("validate-config")(validate_config)
