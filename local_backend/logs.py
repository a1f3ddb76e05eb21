"""How psyswarm's services log: peers choose how often a service has something to say about them, never the
size of its log, and a log nobody reads never stops a service.

``LogThrottle`` writes a few lines per kind of event in each period and counts the rest into one line;
``Throttled`` puts a library's logger (uvicorn's, asyncio's) under one. ``to_stderr`` sends a process's log to
stderr through a bounded queue and a writer thread: when stderr is a pipe nobody reads, the writer waits and
lines are dropped (then counted in one line), while the service itself never waits on a write.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import queue
import select
import sys
import threading
import time
from collections.abc import Callable

QUEUED_LINES = 1000
"""Log lines waiting for stderr at most; past them lines are dropped and counted."""
DRAIN_SECONDS = 1.0
"""How long an exiting process waits for its queued lines to reach stderr."""


@dataclasses.dataclass
class _Window:
    """One kind of event's current period in a ``LogThrottle``."""

    start: float
    level: int
    written: int = 0
    left_out: int = 0


class LogThrottle:
    """At most ``burst`` lines per kind of event in each ``period``; the rest are counted, and one line per
    kind says how many were left out once its period ends. Peers choose how often the server has something
    to say about them; they must not choose the size of its log."""

    def __init__(self, logger: logging.Logger, *, period: float = 10.0, burst: int = 20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.period, self.burst, self.clock = logger, period, burst, clock
        self._windows: dict[str, _Window] = {}

    def __call__(self, level: int, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        if self.admits(level, kind):
            self.logger.log(level, message, *args, exc_info=exc_info)

    def admits(self, level: int, kind: str) -> bool:
        """Whether a line of ``kind`` may be written now; one that may not is counted as left out."""
        now = self.clock()
        self._close_window(kind, now)
        window = self._windows.setdefault(kind, _Window(now, level))
        if window.written < self.burst:
            window.written += 1
            return True
        window.left_out += 1
        return False

    def flush(self) -> None:
        """Close every window whose period has ended; called now and then, so no count waits long."""
        now = self.clock()
        for kind in list(self._windows):
            self._close_window(kind, now)

    def _close_window(self, kind: str, now: float) -> None:
        window = self._windows.get(kind)
        if window is None or now - window.start < self.period:
            return
        del self._windows[kind]
        if window.left_out:
            self.logger.log(window.level, "%d more %s messages in the last %.0f s were left out", window.left_out,
                            kind, now - window.start)


class Throttled(logging.Filter):
    """A filter putting loggers psyswarm does not write to itself (uvicorn's, asyncio's) under a ``LogThrottle``:
    each message format is a kind of event. Their lines come from any thread (one event loop per service)."""

    def __init__(self, throttle: LogThrottle) -> None:
        super().__init__()
        self.throttle = throttle
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self._lock:
            return self.throttle.admits(record.levelno, f"{record.name} {str(record.msg)[:60]!r}")

    def flush(self) -> None:
        with self._lock:
            self.throttle.flush()


class _Queued(logging.Handler):
    """Hands each formatted line to the writer thread, or drops it (then counts it in one line) when the writer is
    ``QUEUED_LINES`` behind."""

    def __init__(self, lines: queue.Queue[str]) -> None:
        super().__init__()
        self.lines = lines
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        try:
            if self.dropped:
                self.lines.put_nowait(self.format(logging.makeLogRecord({
                    "name": "psyswarm.log", "levelno": logging.WARNING, "levelname": "WARNING",
                    "msg": f"{self.dropped} log lines were dropped: nothing read this process's stderr"})))
                self.dropped = 0
            self.lines.put_nowait(line)
        except queue.Full:
            self.dropped += 1


def to_stderr(level: int, fmt: str = "%(asctime)s %(name)s: %(message)s", datefmt: str | None = "%H:%M:%S") -> None:
    """Log at ``level`` and above to stderr, never blocking the thread that logs; like ``logging.basicConfig``, a
    process whose root logger already has a handler (an embedding program, a test) is left as it is."""
    root = logging.getLogger()
    if root.handlers:
        return
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no stderr at all (a detached process): nowhere to log
        root.addHandler(logging.NullHandler())
        return
    lines: queue.Queue[str] = queue.Queue(QUEUED_LINES)
    handler = _Queued(lines)
    handler.setFormatter(logging.Formatter(fmt, datefmt))
    threading.Thread(target=_write, args=(lines, fd), name="log-writer", daemon=True).start()
    atexit.register(_drain, lines)
    root.addHandler(handler)
    root.setLevel(level)


def _write(lines: queue.Queue[str], fd: int) -> None:
    """The writer thread: each line straight to the descriptor. Not through ``sys.stderr``, nor a logging handler,
    whose locks it would hold while a write waits on a full pipe, and which the process's exit takes. A line
    that cannot be written (the reader closed the pipe) is dropped; the thread goes on."""
    while True:
        data = f"{lines.get()}\n".encode(errors="backslashreplace")
        while data:
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:  # a non-blocking stderr: wait until it takes more
                select.select([], [fd], [])
            except OSError:
                break


def _drain(lines: queue.Queue[str]) -> None:
    """Give the writer ``DRAIN_SECONDS`` to write what is queued: an exit must not wait on a reader either."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while not lines.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
