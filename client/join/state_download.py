"""A joining worker's state download: from a Hub checkpoint or from same-stage peers, outside averaging.

Sources:
- Hub: ``<stage>.safetensors`` (the stage's ``state_dict``, as workers save at Cooldown: see
  ``client.join.checkpoints``) from a Hugging Face repo at a revision, through ``huggingface_hub.hf_hub_download``
  (its endpoint configurable; its own progress bar). An optional ``<stage>.json`` beside it gives ``{"step": N}``,
  the swarm step the snapshot was taken at; without it the snapshot's age is unknown and the sync phases treat
  it as stale. An optional ``<stage>.optim.pt`` gives the optimizer's moments; without it they start afresh.
- Local: the same files in a local checkpoint directory (``load_local``), as workers save them.
- Peers: hivemind's state sharing. Active same-stage workers serve their state (``worker_state_provider``);
  the joiner's own ``SpartaAverager`` downloads it with a progress bar, checking what arrives.

The join blocking window: a download reads parameters, and one taken while an averaging round updates them
is neither the pre-round nor the post-round model. ``JoinWindow`` blocks downloads during the swarm steps
around each averaging round; donors additionally serve their state only between rounds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from client.averaging.anchored import Anchors
from client.averaging.state_transfer import SharedState, StateExpectation
from client.identity import from_json
from client.join.checkpoints import (
    CheckpointError,
    FileLimits,
    OptimizerState,
    check_optimizer_state,
    check_weights,
    load_optimizer_state,
    read_optimizer_state,
    read_weights,
    stage_files,
)
from client.pipeline.digests import state_digest

if TYPE_CHECKING:
    from client.averaging.sparta import SpartaAverager
    from client.pipeline.worker import StageWorker

log = logging.getLogger("psyswarm.state")

_HOST_GRACE = 30.0  # seconds the host waits beyond the download's own timeout before declaring it lost


class StateDownloadError(RuntimeError):
    """The state could not be downloaded or does not fit this stage; the message says which and why."""


@dataclass(frozen=True)
class StageState:
    """A stage's ``state_dict``, the swarm step it was taken at (None: unknown), where it came from, and the
    optimizer state saved with it, as read and not yet checked (None: none, or unreadable), and the SPARTA anchors
    a peer served with it."""

    tensors: dict[str, torch.Tensor]
    step: int | None
    source: str
    optimizer: object = None
    anchors: Anchors | None = None  # a donor's SPARTA anchors, served with its state (``client.averaging.anchored``)


class JoinWindow:
    """The swarm steps during which a join may download state.

    Averaging runs once the swarm has completed a multiple of ``every`` steps (``sparta.averaging_index``).
    A download is blocked while ``step % every`` is within ``window`` of that boundary on either side. The
    window shrinks to leave at least one open step; with ``every`` = 1 no step is free of averaging, and donors
    serving state only between rounds is the remaining guarantee.
    """

    def __init__(self, every: int, window: int = 1) -> None:
        if every < 1 or window < 0:
            raise ValueError("every must be at least 1 and window non-negative")
        self.every = every
        self.window = min(window, (every - 2) // 2) if every >= 2 else -1

    def blocked(self, step: int) -> bool:
        if self.window < 0:
            return False
        phase = step % self.every
        return phase <= self.window or phase >= self.every - self.window

    def wait(self, current_step: Callable[[], int | None], *, poll: float = 0.5, timeout: float | None = None,
             say: Callable[[str], None] = log.info) -> int | None:
        """Block until the swarm's step is outside the window; returns that step.

        ``current_step`` returns None while the swarm is between epochs: no round trains, so no averaging
        round starts, and a round the last step began has run out its timeouts before the next Warmup (donors
        still serve only between rounds).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        step = current_step()
        if step is not None and self.blocked(step):
            say(f"step {step} is next to an averaging round: waiting for a stable window to download state")
        while step is not None and self.blocked(step):
            if deadline is not None and time.monotonic() > deadline:
                raise StateDownloadError(f"the swarm stayed within an averaging window for {timeout:.0f} s")
            time.sleep(poll)
            step = current_step()
        return step


# ----- Hub ---------------------------------------------------------------------------------------------


def download_from_hub(repo_id: str, stage: str, *, limits: FileLimits, revision: str | None = None,
                      endpoint: str | None = None, token: str | None = None,
                      cache_dir: Path | None = None) -> StageState:
    """Download ``<stage>.safetensors`` (and ``<stage>.json``, ``<stage>.optim.pt`` if present) from a Hub repo;
    each file is checked against the stage's ``limits`` before it is read."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    state_file, optim_file, meta_file = stage_files(stage)
    where = f"{repo_id}@{revision or 'main'}/{state_file}"
    common: dict[str, Any] = dict(repo_id=repo_id, revision=revision, endpoint=endpoint, token=token,
                                  cache_dir=cache_dir)
    try:
        path = hf_hub_download(filename=state_file, **common)
    except (HfHubHTTPError, OSError) as exc:
        raise StateDownloadError(f"could not download {where}: {exc}") from None
    meta: object = None
    try:
        meta = from_json(Path(hf_hub_download(filename=meta_file, **common)).read_text())
    except EntryNotFoundError:
        log.info("%s has no %s: its step is unknown, so the node will sync", repo_id, meta_file)
    except (HfHubHTTPError, OSError, ValueError) as exc:
        log.warning("ignoring %s of %s: %s", meta_file, repo_id, exc)
    optimizer: object = None
    try:
        optimizer = _read_optimizer(Path(hf_hub_download(filename=optim_file, **common)), f"{repo_id}/{optim_file}",
                                    limits.optimizer)
    except EntryNotFoundError:
        log.info("%s has no %s: the optimizer's moments start afresh", repo_id, optim_file)
    except (HfHubHTTPError, OSError) as exc:
        log.warning("ignoring %s of %s: %s", optim_file, repo_id, exc)
    return StageState(tensors=_load_tensors(Path(path), where, limits.weights),
                      step=_step_of(meta, f"{repo_id}/{meta_file}"), source=f"hub:{where}", optimizer=optimizer)


def load_local(directory: Path, stage: str, limits: FileLimits) -> StageState | None:
    """A stage's files (``checkpoints.stage_files``) from a local checkpoint directory, if its weights are there,
    each checked against the stage's ``limits`` before it is read."""
    state_file, optim_file, meta_file = (directory / name for name in stage_files(stage))
    if not state_file.exists():
        return None
    meta: object = None
    try:
        meta = from_json(meta_file.read_text())
    except (OSError, ValueError) as exc:
        log.info("no readable step in %s (%s): the node will sync", meta_file, exc)
    optimizer = _read_optimizer(optim_file, str(optim_file), limits.optimizer) if optim_file.exists() else None
    return StageState(tensors=_load_tensors(state_file, str(state_file), limits.weights),
                      step=_step_of(meta, str(meta_file)), source=f"local:{state_file}", optimizer=optimizer)


def saved_step(directory: Path, stage: str) -> int | None:
    """The step a local copy of ``stage`` says it was taken at, without reading its tensors; None if it says none."""
    meta_file = directory / stage_files(stage)[2]
    try:
        with meta_file.open("rb") as f:
            meta = from_json(f.read(4096))
        return _step_of(meta, str(meta_file))
    except (OSError, ValueError, StateDownloadError):
        return None


def _load_tensors(path: Path, where: str, limit: int) -> dict[str, torch.Tensor]:
    try:
        return read_weights(path, where, limit)
    except CheckpointError as exc:
        raise StateDownloadError(str(exc)) from None


def _read_optimizer(path: Path, where: str, limit: int) -> object:
    """An optimizer state file's content, or None if unreadable or too large: the weights are still worth
    loading."""
    try:
        return read_optimizer_state(path, where, limit)
    except CheckpointError as exc:
        log.warning("%s; the optimizer's moments start afresh", exc)
        return None


def _step_of(meta: object, where: str) -> int | None:
    """The ``step`` of a checkpoint's metadata; None (unknown: the node syncs) unless a non-negative int."""
    step = meta.get("step") if isinstance(meta, dict) else None
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        log.warning("ignoring %s: step %r is not a non-negative integer", where, step)
        return None
    return step


# ----- peers -------------------------------------------------------------------------------------------


def stage_identity(run_id: str, stage: str, model_fingerprint: str) -> dict[str, str]:
    """The metadata a donor's state must carry to be accepted by a joiner of this run, stage and model."""
    return {"run_id": run_id, "stage": stage, "model": model_fingerprint}


MOMENTS = "optimizer/"
"""The prefix of the optimizer's state among a replica's tensors: ``optimizer/<parameter>/<step|exp_avg|exp_avg_sq>``
(a module's own names hold dots, never a slash)."""


def replica_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Everything a replica's next steps depend on, as one flat state: ``module``'s ``state_dict`` and, for each
    trainable parameter, AdamW's step and moments (step 0 and zeros where the optimizer has not stepped it yet,
    which AdamW treats as a fresh state). Two replicas equal here take equal steps on equal gradients, so this is
    what a donor serves and what a replica's digest covers: a state resynchronised from it agrees from then on,
    which parameters alone would not (moments that kept a cut-short round's gradient step differently)."""
    tensors = {name: tensor.detach() for name, tensor in module.state_dict().items()}
    state = optimizer.state if optimizer is not None else {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            entry = state.get(param, {})
            tensors[f"{MOMENTS}{name}/step"] = entry.get("step", torch.zeros((), dtype=torch.float32)).detach()
            for moment in ("exp_avg", "exp_avg_sq"):
                tensors[f"{MOMENTS}{name}/{moment}"] = entry.get(moment, torch.zeros_like(param)).detach()
    return tensors


def split_replica_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], OptimizerState]:
    """``replica_tensors`` back into a ``state_dict`` and the optimizer's per-parameter state."""
    weights: dict[str, torch.Tensor] = {}
    moments: OptimizerState = {}
    for name, tensor in tensors.items():
        if name.startswith(MOMENTS):
            param, _, key = name.removeprefix(MOMENTS).rpartition("/")
            moments.setdefault(param, {})[key] = tensor
        else:
            weights[name] = tensor
    return weights, moments


def worker_state_provider(worker: StageWorker, current_step: Callable[[], int]) -> Callable[[], SharedState]:
    """What an active worker serves to joiners: its ``replica_tensors`` and the swarm step they belong to."""

    def provide() -> SharedState:
        compute = worker.compute
        with compute.lock:  # on the CPU, where hivemind sends from, whatever the worker's device
            state = {k: v.to("cpu", copy=True) for k, v in replica_tensors(compute.module,
                                                                             compute.optimizer.optimizer).items()}
        metadata = {**stage_identity(worker.run_id, worker.stage, worker.config.fingerprint()),
                    "step": int(current_step()), "keys": list(state)}
        return SharedState(metadata=metadata, tensors=list(state.values()))

    return provide


def download_from_peers(averager: SpartaAverager, module: nn.Module, identity: dict[str, str], *,
                        timeout: float = 300.0, chunk_timeout: float = 30.0, progress: bool = True,
                        vouched: Mapping[int, str] | None = None) -> StageState:
    """Download the state of a same-stage peer that serves one matching ``identity`` and ``module``'s layout.

    ``vouched`` (swarm step → the digest its stage's majority published for it, ``client.witness.digests``): when
    given and not empty, only a state hashing to one of them is accepted (donors serving another are refused and
    the next tried), and the state's step is the step of the digest it hashes to, never the donor's claim."""
    from tqdm.auto import tqdm

    vouched = dict(vouched or {})
    # The layout (values unread), with the anchors a donor may serve after the state: at most their bytes more.
    expect = StateExpectation.of(identity, replica_tensors(module), vouched.values(), **averager.anchor_layout)
    future = averager.fetch_state(expect, timeout=timeout, chunk_timeout=chunk_timeout)
    deadline = time.monotonic() + timeout + _HOST_GRACE
    with tqdm(total=expect.nbytes + expect.anchor_nbytes, unit="B", unit_scale=True,
              desc=f"{identity['stage']} state from peers", disable=not progress) as bar:
        while True:
            try:
                metadata, tensors, refusals = future.result(timeout=0.2)
                break
            except TimeoutError:
                bar.update(averager.bytes_received - bar.n)
                if time.monotonic() > deadline:  # the averaging process itself is gone or wedged
                    raise StateDownloadError(f"the state download did not finish in {timeout:.0f} s") from None
        if metadata is not None:
            bar.update(bar.total - bar.n)
    for refusal in refusals:
        log.warning("state download: %s", refusal)
    if metadata is None:
        raise StateDownloadError("no same-stage peer served a usable state: " + "; ".join(refusals))
    # The donor's step is its own claim, and a donor claiming a later one than it holds would spare its poison
    # the sync phases (and have the joiner advertise that step in turn): a state from peers counts as stale,
    # and the joiner's sync phases replace it partition by partition with the stage's robust average, unless
    # it hashes to a digest the stage's majority vouched for, which proves its step.
    # Its optimizer state too, then: the moments of a state nobody vouched for are not loaded, since a donor's
    # moments alone could make the joiner's first steps as large as it likes.
    # Its anchors need no trust (``client.averaging.anchored``): they are taken whether or not the state is vouched for.
    count = len(expect.names)
    state = dict(zip(expect.names, tensors[:count], strict=True))
    anchored = expect.anchored(metadata)
    got = state_digest(state) if vouched else None
    proven = [step for step, digest in vouched.items() if digest == got]
    weights, moments = split_replica_tensors(state)
    return StageState(tensors=weights, step=max(proven, default=None),
                      source="peers (its digest vouched for)" if proven else "peers",
                      optimizer=moments if proven else None,
                      anchors=Anchors(anchored, tensors[count:]) if anchored else None)


# ----- loading -----------------------------------------------------------------------------------------


def load_stage_state(module: nn.Module, state: StageState, lock: Any,
                     optimizer: torch.optim.Optimizer | None = None) -> None:
    """Replace ``module``'s state (and ``optimizer``'s, if the state carries one that fits) with ``state`` under
    ``lock``. Weights that do not fit change nothing; an optimizer state that does not fit is ignored."""
    try:
        check_weights(state.tensors, module.state_dict(), f"state from {state.source}")
    except CheckpointError as exc:
        raise StateDownloadError(str(exc)) from None
    moments = None
    if optimizer is not None and state.optimizer is not None:
        try:
            moments = check_optimizer_state(state.optimizer, module, f"the optimizer state from {state.source}")
        except CheckpointError as exc:
            log.warning("%s; the optimizer's moments start afresh", exc)
    with lock:
        module.load_state_dict(state.tensors)
        if moments is not None:
            load_optimizer_state(module, optimizer, moments)
