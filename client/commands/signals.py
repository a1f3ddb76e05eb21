"""Long-running services (the coordinator, the auth service, the dashboard) stop on SIGTERM as on Ctrl+C.

A service manager, a container runtime or `kill` sends SIGTERM, whose default action ends the process where it
stands: no clean shutdown, no line saying what was kept. Handed to the SIGINT handler instead, it takes the path
Ctrl+C takes: ``finally`` clauses close connections and stores, and the command prints its stopped line. Handed
on, not raised as ``KeyboardInterrupt`` here: inside ``asyncio.run`` the SIGINT handler is asyncio's, which
cancels the main task alone, so its clean-up still runs beside the other tasks (the coordinator's ``stop`` lets a
change being stored finish). An exception raised wherever the signal lands ends the loop instead, whose shutdown
then cancels every task at once, the one being waited for included, and can land inside the loop's own
bookkeeping: a ``psyswarm serve`` stopped that way after ``bench_broadcast.py``'s 1,024 followers once never exited.
(The contributor's own process has its bounded ``run.Stopper``, which must also withdraw from the run.)
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl+C: whatever SIGINT's handler is now (asyncio's inside ``asyncio.run``), else the
    ``KeyboardInterrupt`` Python's default one raises."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
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
