"""A service's log: nothing reading its stderr never blocks it, and its lines of a kind are throttled."""

from __future__ import annotations

import logging
import select
import subprocess
import sys

from local_backend.logs import LogThrottle, Throttled

LOGS_INTO_A_PIPE_NOBODY_READS = """
import logging, time
from local_backend.logs import to_stderr
to_stderr(logging.INFO)
started = time.monotonic()
for i in range(20_000):  # some 2.6 MB, forty times what a pipe holds
    logging.getLogger("psyswarm.test").info("line %d %s", i, "x" * 100)
print(f"{time.monotonic() - started:.3f}", flush=True)
"""


def test_a_log_nobody_reads_never_blocks_the_process() -> None:
    process = subprocess.Popen([sys.executable, "-c", LOGS_INTO_A_PIPE_NOBODY_READS], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        said, _, _ = select.select([process.stdout], [], [], 20)
        assert said, "the process blocked on its log"
        logged_in = float(process.stdout.readline())  # type: ignore[union-attr, arg-type]
        process.wait(timeout=10)  # its exit does not wait on the pipe either
    finally:
        process.kill()
    assert logged_in < 5.0 and process.returncode == 0, process.stderr.read()[-2000:]  # type: ignore[union-attr]


def test_a_librarys_lines_of_one_kind_are_throttled(caplog) -> None:
    now = 0.0
    logger = logging.getLogger("psyswarm.test.library")
    throttled = Throttled(LogThrottle(logging.getLogger("psyswarm.test"), period=10.0, burst=3, clock=lambda: now))
    logger.addFilter(throttled)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                logger.warning("Invalid HTTP request received.")
            now = 10.0
            throttled.flush()
    finally:
        logger.removeFilter(throttled)
    assert [record.getMessage() for record in caplog.records] == ["Invalid HTTP request received."] * 3 + [
        "997 more psyswarm.test.library 'Invalid HTTP request received.' messages in the last 10 s were left out"]
