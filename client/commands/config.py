"""``psyswarm validate-config``: check a run's ``state.toml`` before anyone launches it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

UNCHECKED_DIGEST = b"\xff" * 32  # stands in, in an offline check only, for a digest that only the source can give


def _unchecked_digests(model):
    """Offline: the model's source and a remote dataset are not read. A digest the file leaves out stands in as
    ``UNCHECKED_DIGEST`` so that the rest can be validated; the command says so (``create-run`` reads the source
    and the dataset's host, and fills it)."""
    import dataclasses

    from client.data.locations import is_remote
    from coordinator_program.spec.config import PSYSWARM_ARCHITECTURE, Tokenizer

    missing = {}
    if model.architecture != PSYSWARM_ARCHITECTURE:
        missing = {"config_sha256": UNCHECKED_DIGEST} if model.config_sha256 == bytes(32) else {}
        if model.tokenizer == Tokenizer.Model and model.tokenizer_sha256 == bytes(32):
            missing["tokenizer_sha256"] = UNCHECKED_DIGEST
        if missing:
            typer.secho(f"offline: {' and '.join(missing)} not checked; without --offline they are filled from "
                        f"{model.source} (create-run needs them)", fg=typer.colors.YELLOW, err=True)
    if is_remote(model.dataset) and model.dataset_sha256 == bytes(32):
        missing["dataset_sha256"] = UNCHECKED_DIGEST
        typer.secho(f"offline: dataset_sha256 not checked; without --offline it is filled from {model.dataset}'s "
                    "dataset.json (create-run needs it)", fg=typer.colors.YELLOW, err=True)
    return dataclasses.replace(model, **missing)


def resolve_dataset_digest(model):
    """The run's model with ``dataset_sha256`` filled from its token dataset's ``dataset.json`` (as the model's
    digests are from its source), or checked against it when the file names one. A dataset this machine cannot
    read keeps the digest the file names (its trainers check it); with none named, it cannot be pinned."""
    import dataclasses

    from client.data import DatasetError, DatasetMissing, DatasetUnreachable, dataset_sha256, is_token_location
    from client.data.locations import is_remote

    if not is_remote(model.dataset) and not is_token_location(model.dataset):
        return model  # stdlib, text read as bytes, or a local path this machine lacks
    try:
        found = dataset_sha256(model.dataset)
    except (DatasetMissing, DatasetUnreachable) as exc:
        if model.dataset_sha256 != bytes(32):
            typer.secho(f"dataset_sha256 not checked: {exc}", fg=typer.colors.YELLOW, err=True)
            return model
        raise DatasetError(f"{exc}; cannot pin its dataset.json from here: give dataset_sha256 in [model]") from None
    if model.dataset_sha256 not in (bytes(32), found):
        raise DatasetError(f"{model.dataset}'s dataset.json has sha256 {found.hex()}, the run names "
                           f"{model.dataset_sha256.hex()}")
    return dataclasses.replace(model, dataset_sha256=found)


def _resolve_digests(model):
    """What ``parse_run_spec`` completes a model with online: the model's digests, then the dataset's."""
    from client.models import resolve_model_digests

    return resolve_dataset_digest(resolve_model_digests(model))


def load_spec_or_exit(path: Path, *, offline: bool = False):
    """Read a state.toml for a command, or end the command with the reason it is invalid. A Hugging Face model's
    config and tokenizer digests, and a token dataset's, are filled from (or checked against) their source,
    unless ``offline``."""
    from client.data import DatasetError
    from client.models import ModelSourceError
    from coordinator_program.spec.config import load_run_spec
    from coordinator_program.spec.errors import CoordinatorError

    try:
        return load_run_spec(path, _unchecked_digests if offline else _resolve_digests)
    except CoordinatorError as exc:
        typer.secho(f"invalid config: {exc.detail}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except ModelSourceError as exc:
        typer.secho(f"invalid config: [model] {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    except DatasetError as exc:
        typer.secho(f"invalid config: dataset: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def local_dataset_problem(location: str) -> str | None:
    """Why a local dataset path cannot be read as the run's data (None if it can, or if it is not local): it does
    not exist, or is a directory without a file."""
    from client.data import STDLIB_SOURCE
    from client.data.locations import is_remote

    if location == STDLIB_SOURCE or is_remote(location):
        return None
    path = Path(location).expanduser()
    if not path.exists():
        return (f"{location} does not exist on this machine: give a text file or directory, a directory of token "
                "files (psyswarm tokenize), hf:org/name or an http(s) URL, or stdlib")
    if path.is_dir() and not any(child.is_file() for child in path.rglob("*")):
        return f"{location} is a directory without a file in it"
    return None


def check_dataset_or_exit(model, *, offline: bool = False, here: bool = True) -> None:
    """Refuse a local dataset that does not exist, or a remote one its host says does not exist (``here``: this
    machine is one the run trains on; else it is only reported, as on a coordinator whose trainers hold the data
    or the token to a private one), and a token dataset made with another
    tokenizer than the model's; one this machine cannot reach (offline) is reported and left to the trainers, which
    check it again before they train."""
    from client.data import DatasetError, DatasetMissing, DatasetUnreachable, check_dataset_tokenizer
    from client.data.locations import is_remote, is_token_location

    problem = local_dataset_problem(model.dataset)
    if problem is not None and here:
        typer.secho(f"invalid config: dataset: {problem}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    if problem is not None:
        typer.secho(f"dataset: {problem}; every trainer must have it there, or it fails at warmup",
                    fg=typer.colors.YELLOW, err=True)
        return
    digest_unknown = model.tokenizer_sha256 == UNCHECKED_DIGEST  # the model's own tokenizer, offline
    if digest_unknown and not is_token_location(model.dataset):
        typer.secho(f"invalid config: dataset: {model.dataset} is text read as bytes, but the model uses its own "
                    "tokenizer; tokenize the data with it (psyswarm tokenize)", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    if digest_unknown or (offline and is_remote(model.dataset)):
        typer.secho(f"offline: dataset {model.dataset} not checked against the model's tokenizer",
                    fg=typer.colors.YELLOW, err=True)
        return
    try:
        check_dataset_tokenizer(model.dataset, model.tokenizer_sha256)
    except DatasetUnreachable as exc:
        typer.secho(f"dataset tokenizer not checked: {exc}", fg=typer.colors.YELLOW, err=True)
    except DatasetMissing as exc:
        if here:
            typer.secho(f"invalid config: dataset: {exc}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        typer.secho(f"dataset: {exc}; every trainer must be able to read it, or it fails at warmup",
                    fg=typer.colors.YELLOW, err=True)
    except DatasetError as exc:
        typer.secho(f"invalid config: dataset: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def validate_config(
    config: Annotated[Path | None, typer.Option(metavar="FILE", help=(
        "The run's state.toml (run_id, [config], [model], [checkpoint]), as `serve` and `create-run` take it."))] = (
        None),
    path: Annotated[Path | None, typer.Argument(metavar="FILE", show_default=False, help=(
        "The same file given positionally (an alias of --config)."))] = None,
    offline: Annotated[bool, typer.Option(help=(
        "Read nothing over the network: digests of a Hub model that the file leaves out, and a remote dataset, "
        "are reported as not checked."))] = False,
) -> None:
    """Check a run config and print what it implies: account size, witness proof size, bloom error rate."""
    from coordinator_program.facts import config_facts, fits_in_transaction
    from coordinator_program.spec import limits
    from coordinator_program.spec.config import filter_capacity

    if (config is None) == (path is None):
        raise typer.BadParameter("give the run's state.toml once: --config FILE (or FILE alone)",
                                 param_hint="--config")
    spec = load_spec_or_exit(config or path, offline=offline)
    check_dataset_or_exit(spec.model, offline=offline)
    c = spec.config
    facts = config_facts(c)
    lines = [
        f"run {spec.run_id!r}: {c.num_stages} stages, {c.min_clients}-{c.max_clients} clients, "
        f"{c.rounds_per_epoch} rounds per epoch, {c.total_steps} steps",
        f"coordinator account: {facts.account_bytes:,} bytes",
        f"witness filters: {c.bloom_slices} slices x {c.bloom_bits_per_slice} bits = {facts.bloom_bytes} bytes each",
        f"witness proof: {facts.witness_parts} part(s) of up to {limits.PART_CLIENTS} clients, each one instruction of "
        f"{facts.witness_data_bytes} bytes of data, {facts.witness_transaction_bytes} bytes as a transaction "
        f"(limit {limits.SOLANA_TX_LIMIT})",
        f"bloom false-positive rate at capacity ({filter_capacity(c.max_clients)} keys a part, 2 per client): "
        f"{facts.false_positive_rate_at_capacity:.4%}",
    ]
    for line in lines:
        typer.echo(line)
    if not fits_in_transaction(facts):
        typer.secho("a witness proof part would not fit in one Solana transaction: raise bloom_error_rate or "
                    "lower max_clients", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.secho("config OK", fg=typer.colors.GREEN)


def register(app: typer.Typer) -> None:
    app.command("validate-config")(validate_config)
