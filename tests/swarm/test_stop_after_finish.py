"""A client whose run has finished, told to stop while it exits (as `kill $(jobs -p)` after a run does), ends
without a traceback: the signal used to raise KeyboardInterrupt inside whatever exit hook was running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

SCRIPT = """
import asyncio, atexit, sys, time
from client.commands.run import STOP_GRACE, Stopper

stopper = Stopper(STOP_GRACE)
stopper.install()

async def run():
    pass

stopper.run(run())
atexit.register(lambda: time.sleep(30))  # a slow exit hook, as torch's and hivemind's can be
print("finished", flush=True)
"""


def test_a_signal_after_the_client_finished_ends_it_quietly() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "finished"
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 128 + signal.SIGTERM
