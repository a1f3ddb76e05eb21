"""SIGTERM stops a service as Ctrl+C does (``client.commands.signals``), and inside ``asyncio.run`` that means the
main task is cancelled while everything else still runs, so its clean-up can wait for work under way (the
coordinator's ``stop`` lets a change being stored finish)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from client.commands.signals import sigterm_interrupts


def test_sigterm_cancels_the_main_task_and_lets_its_clean_up_finish_what_is_under_way() -> None:
    """On the old handler (``KeyboardInterrupt`` raised wherever the signal landed) the loop's shutdown cancelled
    every task at once, the one being waited for included."""
    finished: list[str] = []

    async def main() -> None:
        async def under_way() -> None:
            await asyncio.sleep(0.5)
            finished.append("the change under way")

        task = asyncio.create_task(under_way())
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        try:
            await asyncio.Event().wait()
        finally:
            await task

    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        asyncio.run(main())
    assert finished == ["the change under way"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_outside_an_event_loop_interrupts_as_ctrl_c() -> None:
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(5)  # interrupted at once
