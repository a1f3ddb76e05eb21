"""``join-run``'s live line on a terminal: where the run and this client stand, redrawn in place with rich.

On a terminal the log scrolls above one line that keeps phase, round, stage, sync phase, microbatches this round
("batches") and points current, for example::

    RoundTrain | epoch 1 round 3/8 | body1 | active | 12 batches | 40 points (10+30)

A worker with no stage model yet is ``idle``; a client not yet in the epoch shows ``joining`` or ``queued 2/5``.
When stdout is not a terminal (a log file, a pipe, a service manager) there is no live line, and the log is plain
lines, as before.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from client.stages import stage_name
from client.swarm.status import ROUND_PHASES, last_epoch
from coordinator_program.spec import limits
from coordinator_program.spec.state import CoordinatorState, Phase, Role

if TYPE_CHECKING:
    from rich.console import Console

    from client.contributor.status import ContributorStatus

REFRESH_PER_SECOND = 2
SYNC_NAMES = {0: "active", 1: "sync 1", 2: "sync 2"}


def on_terminal() -> bool:
    return sys.stdout.isatty()


def membership(state: CoordinatorState, me: bytes) -> str | None:
    """Where this client waits if it is not in the epoch: queued (and where), or joining; None once in it."""
    if state.client_index(me) is not None:
        return None
    position = state.pending_index(me)
    return "joining" if position is None else f"queued {position + 1}/{len(state.pending)}"


def points_text(state: CoordinatorState, me: bytes, *, parts: bool = True) -> str:
    """This identity's points in the coordinator's ledger: the total, and (with ``parts``) presence + compute."""
    entry = state.points(me)
    if entry is None:
        return "0 points"
    return f"{entry.total} points ({entry.presence}+{entry.compute})" if parts else f"{entry.total} points"


def epoch_text(state: CoordinatorState) -> str:
    """The epoch, and its round while one runs (none between epochs: the state's round is then the last one's)."""
    if state.phase in ROUND_PHASES and state.phase != Phase.Warmup:
        return f"epoch {state.epoch} round {state.round.height + 1}/{state.config.rounds_per_epoch}"
    return f"epoch {last_epoch(state)}"


def live_text(status: ContributorStatus, width: int | None = None) -> str:
    """The live line: phase, epoch and round; this client's membership, stage and sync phase; microbatches this
    round; points. Given the terminal's ``width``, the least needed details go first (the points' split, then
    the microbatches, then the separators' spaces) until it fits; rich cuts what still does not."""
    state = status.state
    waiting = membership(state, status.me)
    parts = [state.phase.name, epoch_text(state), *([waiting] if waiting else [])]
    if status.role == Role.Worker:
        index = state.client_index(status.me)
        stage = state.clients[index].stage if index is not None else status.asked_stage  # assigned, or asked
        parts.append(stage_name(stage, state.config.num_stages) if stage != limits.NO_STAGE else "any stage")
        phase = status.sync_phase
        parts.append(SYNC_NAMES.get(int(phase), "?") if phase is not None else "idle")
    else:
        parts.append("trainer")
    batches = f"{status.batches} batches"
    shorter = [
        (" | ", [*parts, batches, points_text(state, status.me)]),
        (" | ", [*parts, batches, points_text(state, status.me, parts=False)]),
        (" | ", [*parts, points_text(state, status.me, parts=False)]),
        ("|", [*parts, points_text(state, status.me, parts=False)]),
    ]
    for separator, fields in shorter:
        line = separator.join(fields)
        if width is None or len(line) <= width:
            return line
    return line


class ConsoleHandler(logging.Handler):
    """Log records printed through rich's console, so that they scroll above the live line instead of through
    it."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(self.format(record), markup=False, highlight=False, soft_wrap=True)
        except Exception:  # noqa: BLE001 - logging must never raise into the client
            self.handleError(record)


def terminal_console() -> Console | None:
    """rich's console for stdout when it is a terminal; None otherwise."""
    if not on_terminal():
        return None
    from rich.console import Console

    return Console()


@contextlib.contextmanager
def live_line(status: Callable[[], ContributorStatus], console: Console | None) -> Iterator[None]:
    """Keep the live line, of what ``status`` says when it is drawn, at the bottom of ``console`` while the block
    runs; nothing without a console."""
    if console is None:
        yield
        return
    from rich.live import Live
    from rich.text import Text

    def render() -> Text:
        try:
            return Text(live_text(status(), console.width), no_wrap=True, overflow="ellipsis", style="bold")
        except Exception as exc:  # noqa: BLE001 - a state being replaced mid-read: show why, try again next refresh
            return Text(f"(no status: {exc})")

    with Live(console=console, get_renderable=render, refresh_per_second=REFRESH_PER_SECOND, transient=True):
        yield
