"""What ``status``, the demo and its plot say: the checkpoint's real directory, the saved stages by name, no round of
the previous epoch shown as the current one, the last epoch that trained named at the end, labelled epoch lines."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import torch

from client.join.checkpoints import revision_for, save_stage
from client.swarm.demo import DEMO_TOML, LiveView, RoundResult, draw_losses
from client.swarm.status import describe
from coordinator_program.spec import rules
from coordinator_program.spec.config import Checkpoint, CheckpointKind, parse_run_spec
from coordinator_program.spec.state import CoordinatorState, Phase

matplotlib.use("Agg")
ME = bytes(range(32))


def demo_state(rounds: int = 8, epochs: int = 3) -> CoordinatorState:
    """The demo's run as the specification creates it: waiting for members."""
    import tomllib

    spec = parse_run_spec(tomllib.loads(DEMO_TOML.format(rounds=rounds, steps=rounds * epochs)))
    state = rules.init_coordinator(spec.run_id, ME, rules.NO_AUTHORITY, now=0)
    rules.update(state, ME, spec.config, spec.model, spec.checkpoint)
    rules.set_paused(state, ME, False)
    rules.tick(state, 1_000, 0)
    assert state.phase == Phase.WaitingForMembers
    return state


def test_a_local_checkpoint_is_shown_where_the_workers_saved_it(tmp_path: Path) -> None:
    state = demo_state()
    directory = (tmp_path / "checkpoints" / state.run_id).resolve() / revision_for(0)  # as a worker saves it
    for stage in ("head", "tail"):
        save_stage(directory, stage, {"w": torch.zeros(1)}, 8)
    saved = Checkpoint(CheckpointKind.Local, str(directory.parent), revision_for(0))
    state.checkpoints[:3] = [saved, Checkpoint(CheckpointKind.P2P, saved.repo, saved.revision), saved]
    line = next(x for x in describe(state, now=1_000).splitlines() if x.startswith("checkpoint: "))
    assert line == f"checkpoint: Local {directory}: head, tail; from peers (P2P): body1 (2 of 3 stages saved)"
    assert {p.name for p in directory.iterdir()} >= {"head.json", "tail.json"}


def test_a_hub_checkpoint_names_its_branch() -> None:
    state = demo_state()
    state.checkpoints[1] = Checkpoint(CheckpointKind.Hub, "org/model", revision_for(2))
    assert ("checkpoint: fresh initialisation: head, tail; Hub hub:org/model@epoch-2: body1 (1 of 3 stages saved)"
            in describe(state, now=1_000))
    assert "checkpoint: fresh initialisation\n" in describe(demo_state(), now=1_000) + "\n"


def test_the_next_epoch_shows_no_round_of_the_last() -> None:
    state = demo_state()
    state.epoch, state.round.height = 1, 7  # what Cooldown leaves: the last epoch's last round
    text = describe(state, now=1_000)
    assert "round 8/8" not in text and "epoch 1, no round yet (8 per epoch)" in text, text
    state.phase = Phase.RoundTrain
    assert "epoch 1, round 8/8" in describe(state, now=1_000)


def test_the_demo_ends_on_the_last_epoch_it_trained() -> None:
    state = demo_state(epochs=3)
    state.phase, state.epoch, state.step = Phase.Finished, 3, 24  # finishing counted epoch 2 as over
    lines: list[str] = []
    LiveView(lines.append).phase(state)
    assert "epoch 2 finished" in lines[-1] and "epoch 3" not in lines[-1], lines


def test_the_loss_plot_labels_every_epoch() -> None:
    import matplotlib.pyplot as plt

    results = [RoundResult(epoch, r, epoch * 2 + r + 1, 3.0 - 0.1 * r, 100, 1.0) for epoch in range(3)
               for r in range(2)]
    fig, ax = plt.subplots()
    try:
        draw_losses(ax, results)
        assert [t.get_text() for t in ax.texts] == ["epoch 0", "epoch 1", "epoch 2"]
        assert [line.get_xdata()[0] for line in ax.lines[1:]] == [0.5, 2.5, 4.5]  # where each epoch begins
    finally:
        plt.close(fig)


def test_every_printed_checkpoint_is_what_export_takes(tmp_path: Path) -> None:
    """Workers logged `<dir>/<run>@epoch-0` for the directory `<dir>/<run>/epoch-0`; pasted into export, it failed."""
    from client.commands.export import _HUB
    from client.stages import checkpoint_location

    directory = tmp_path / "checkpoints" / "run" / revision_for(0)
    assert checkpoint_location(str(directory.parent), revision_for(0), hub=False) == str(directory)
    assert _HUB.fullmatch(checkpoint_location("org/run", revision_for(3), hub=True)).groups() == ("org/run", "epoch-3")


def test_the_demo_plots_title_fits_in_its_figure(tmp_path: Path) -> None:
    """The one-line title of the byte-level demo ran past both edges of the saved figure."""
    import matplotlib.pyplot as plt

    from client.swarm.demo import MODELS

    results = [RoundResult(0, r, r, 5.0 - 0.1 * r, 100, 1.0) for r in range(3)]
    for model in MODELS.values():
        fig, ax = plt.subplots(figsize=(7, 4))  # as the demo's plot()
        try:
            draw_losses(ax, results, model)
            fig.tight_layout()
            box = ax.title.get_window_extent(fig.canvas.get_renderer())
            assert box.x0 >= 0 and box.x1 <= fig.bbox.x1, (model.title, box, fig.bbox)
        finally:
            plt.close(fig)
