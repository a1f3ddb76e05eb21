"""Long-running services (the coordinator, the auth service, the dashboard) stop on SIGTERM as on Ctrl+C.

A service manager, a container runtime or `kill` sends SIGTERM, whose default action ends the process where it
stands: no clean shutdown, no line saying what was kept. Raised as ``KeyboardInterrupt`` instead, it takes the
path Ctrl+C takes: ``finally`` clauses close connections and stores, and the command prints its stopped line.
(The contributor's own process has its bounded ``run.Stopper``, which must also withdraw from the run.)
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While inside, SIGTERM interrupts the main thread as Ctrl+C does; the previous handler is back afterwards (a
    command run in-process, as tests run them, leaves the process's signals as it found them: a helper process
    forked later would otherwise inherit a handler that turns its own SIGTERM into an exception it may swallow)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
