"""``psyswarm export``: a run's stage checkpoints as a Hugging Face model directory, optionally pushed to the Hub."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from client.commands.connect import ProgramId, Server, Url

if TYPE_CHECKING:
    from client.models.export import ModelCard

_HUB = re.compile(r"hub:([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?")
_EPOCH = re.compile(r"epoch-(\d+)")


class ExportFailed(Exception):
    """Why the export cannot go on, in one line."""


def export_command(
    run_id: Annotated[str, typer.Option(metavar="RUN_ID", help="The run whose model to export.")],
    checkpoint: Annotated[str, typer.Option(metavar="DIR|hub:REPO@REV", help=(
        "Where the run's stage checkpoints are: a directory holding <stage>.safetensors for every stage (e.g. "
        "checkpoints/RUN_ID/epoch-3), or a Hub repo at a revision (hub:org/run@epoch-3)."))],
    output: Annotated[Path, typer.Option(metavar="DIR", help="The model directory to write (new or empty).")],
    config: Annotated[Path | None, typer.Option(metavar="FILE", help=(
        "The run's state.toml, to read its model offline instead of from the coordinator."))] = None,
    server: Server = None,
    url: Url = None,
    program_id: ProgramId = None,
    push_to: Annotated[str | None, typer.Option(metavar="REPO", help=(
        "Also upload the directory to this Hub model repo (created if needed)."))] = None,
    max_shard_mb: Annotated[int, typer.Option(min=1, metavar="MIB", help=(
        "Largest weights file; bigger models are sharded."))] = 4096,
    hf_token: Annotated[str | None, typer.Option(envvar="HF_TOKEN", metavar="TOKEN", help=(
        "Hugging Face token for a private source or checkpoint and for --push-to [default: the huggingface_hub "
        "login]."))] = None,
    hf_endpoint: Annotated[str | None, typer.Option(envvar="HF_ENDPOINT", metavar="URL",
                                                    help="Hugging Face endpoint.")] = None,
) -> None:
    """Assemble a complete Hugging Face model directory (config, merged weights, tokenizer, model card) from a
    run's stage checkpoints; `transformers` loads it with AutoModelForCausalLM.from_pretrained."""
    from client.models import ModelSourceError, load_source, model_spec_for
    from client.models.export import ExportError, export_model
    from client.models.sources import BYTE_MODEL

    run = read_run(run_id, config, server, url, program_id)
    model = run.model
    try:
        if model.architecture == BYTE_MODEL:
            raise ExportFailed(f"run {run_id} trains psyswarm's own byte-level model, for which transformers has no "
                               "class: export takes runs of a transformers architecture (llama, qwen2, ...)")
        spec = model_spec_for(run, endpoint=hf_endpoint, token=hf_token)
        source = load_source(model.source, model.source_revision or None, endpoint=hf_endpoint, token=hf_token)
        stage_weights, card = locate_checkpoint(checkpoint, run_id, spec.stage_names(), hf_token, hf_endpoint)
        files = export_model(spec, stage_weights, source, output, card, max_shard_bytes=max_shard_mb * 2**20)
    except (ExportFailed, ExportError, ModelSourceError) as exc:
        typer.secho(f"export failed: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    typer.echo(f"exported {run_id} (epoch {card.epoch}, step {card.step}) to {output}: "
               f"{', '.join(f.name for f in files)}")
    if push_to:
        push(output, push_to, f"psyswarm export of run {run_id} at step {card.step}", hf_token, hf_endpoint)
        typer.echo(f"pushed to {push_to}")


def read_run(run_id: str, config: Path | None, server: str | None, url: str | None, program_id: str | None):
    """The run's description (its ``model`` and ``config``): from ``--config``, else from the coordinator."""
    import asyncio

    from solders.keypair import Keypair

    from client.commands.config import load_spec_or_exit
    from client.commands.connect import check_target, connect

    if config is not None:
        spec = load_spec_or_exit(config)
        if spec.run_id != run_id:
            raise typer.BadParameter(f"{config} describes run {spec.run_id!r}, not {run_id!r}", param_hint="--config")
        return spec
    check_target(server, url, run_id)

    async def fetch():
        backend = await connect(server, Keypair(), url, run_id, program_id)
        try:
            return backend.state
        finally:
            await backend.close()

    return asyncio.run(fetch())


def locate_checkpoint(location: str, run_id: str, stages: list[str], token: str | None,
                      endpoint: str | None) -> tuple[dict[str, Path], ModelCard]:
    """Each stage's weights file, local or downloaded, and the model card naming where and when they were saved.
    Stages saved at different steps are not one model and are refused."""
    from client.join.checkpoints import stage_files
    from client.models.export import ModelCard

    hub = _HUB.fullmatch(location)
    if hub is None and location.startswith("hub:"):
        raise ExportFailed(f"--checkpoint {location!r} is not hub:ORG/NAME@REVISION")
    fetch = _hub_fetcher(hub[1], hub[2], token, endpoint) if hub else _local_fetcher(Path(location))
    weights: dict[str, Path] = {}
    steps: dict[str, int | None] = {}
    for stage in stages:
        weights_name, _, meta_name = stage_files(stage)
        found = fetch(weights_name)
        if found is None:
            raise ExportFailed(f"{location} holds no {weights_name}: every stage is needed")
        weights[stage] = found
        steps[stage] = _step(fetch(meta_name))
    if len(set(steps.values())) > 1:
        raise ExportFailed(f"the stages of {location} were saved at different steps ({steps}): not one model")
    revision = hub[2] if hub else Path(location).name
    epoch = _EPOCH.fullmatch(revision or "")
    card = ModelCard(run_id=run_id, epoch=int(epoch[1]) if epoch else None, step=steps[stages[0]],
                     checkpoint=location)
    return weights, card


def _local_fetcher(directory: Path):
    if not directory.is_dir():
        raise ExportFailed(f"{directory} is not a directory")
    return lambda name: (directory / name) if (directory / name).is_file() else None


def _hub_fetcher(repo: str, revision: str | None, token: str | None, endpoint: str | None):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    def fetch(name: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo, name, revision=revision, token=token, endpoint=endpoint))
        except EntryNotFoundError:
            return None
        except (HfHubHTTPError, OSError) as exc:
            raise ExportFailed(f"could not download {repo}@{revision or 'main'}/{name}: {exc}") from None

    return fetch


def _step(meta: Path | None) -> int | None:
    """The step a stage's ``<stage>.json`` names; None when it is missing or unreadable."""
    try:
        step = json.loads(meta.read_text()).get("step") if meta is not None else None
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def push(directory: Path, repo: str, message: str, token: str | None, endpoint: str | None) -> None:
    """Upload the exported directory to the Hub model repo ``repo`` (created if needed) in one commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=directory, commit_message=message)
    except (HfHubHTTPError, OSError) as exc:
        typer.secho(f"push to {repo} failed: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


def register(app: typer.Typer) -> None:
    app.command("export")(export_command)
