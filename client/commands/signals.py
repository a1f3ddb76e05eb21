"""Long-running services (the coordinator, the auth service, the dashboard) stop on SIGTERM as on Ctrl+C.

A service manager, a container runtime or `kill` sends SIGTERM, whose default action ends the process where it
stands: no clean shutdown, no line saying what was kept. Raised as ``KeyboardInterrupt`` instead, it takes the
path Ctrl+C takes: ``finally`` clauses close connections and stores, and the command prints its stopped line.
(The contributor's own process has its bounded ``run.Stopper``, which must also withdraw from the run.)
"""

from __future__ import annotations

import signal


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM interrupts the main thread as Ctrl+C does."""
    signal.signal(signal.SIGTERM, _interrupt)
