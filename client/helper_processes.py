"""Helper processes (hivemind's DHT node and averager) must leave stopping to the process that started them.

Ctrl+C signals the whole foreground process group, and ``Swarm.stop`` sends SIGTERM to a client's group: a
helper that took the signal itself would die mid-operation with a KeyboardInterrupt traceback while its host
is still shutting it down in order. A forked child inherits the forking thread's signal mask, so blocking
SIGINT and SIGTERM in that thread for the duration of the fork leaves the helper deaf to both; the host's
own handling (in its main thread) is untouched, and a signal that arrives meanwhile is delivered on unblock.

May import: nothing outside this module.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in the calling thread (any thread) while helpers are forked."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
