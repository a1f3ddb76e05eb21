"""Helper processes (hivemind's DHT node, its p2pd daemon, the averager) live and die with their host.

Stopping is left to the host. Ctrl+C signals the whole foreground process group, and ``Swarm.stop`` sends
SIGTERM to a client's group: a helper that took the signal itself would die mid-operation with a
KeyboardInterrupt traceback while its host is still shutting it down in order. A forked child inherits the
forking thread's signal mask, so blocking SIGINT and SIGTERM in that thread for the duration of the fork
leaves the helper deaf to both; the host's own handling (in its main thread) is untouched, and a signal that
arrives meanwhile is delivered on unblock.

Deaf to everyone but its host. A helper that overruns its graceful shutdown is ended with SIGTERM by hivemind
(``terminate()``), and so is every helper still running when its host exits (multiprocessing's exit hook, which
then waits for it): a helper deaf to that would hold its host for ever. So a thread of each helper waits for
SIGTERM (``sigwaitinfo``, which says who sent it) and ends the helper when its host sent it, only then.

Dying is not left to the host. A host killed with SIGKILL cannot shut anything down, and its helpers would be
left running, reparented to init, holding hundreds of megabytes. So every helper forked under
``forking_helpers`` watches its host and exits as soon as it is orphaned, and every program a helper starts
(hivemind's DHT node starts p2pd through asyncio, which offers no hook but ``preexec_fn``) asks the kernel for
Linux's parent-death signal, so it dies with the helper. The helper itself cannot use that signal: it follows
the thread that forked, and the host may fork helpers from a short-lived thread.

Commands reach a helper whole. hivemind's DHT node and averager take commands from their host through a
``multiprocessing`` pipe, which the helper polls with uvloop's ``add_reader``, and libuv makes the pipe's descriptor
non-blocking for that. ``Connection.send`` writes a message of more than 16 KiB as two writes, its length and then
its body, so the helper could wake between them, find the body not there yet and get ``BlockingIOError`` from
``recv``: the command was lost, its caller waited for ever, and the stream, left out of step, ended the helper at the
next command (``EOFError``). ``receive_whole`` makes a helper read each command with the descriptor blocking, which
waits for the rest of a message whose first bytes are in, its writer being in the middle of sending it.

May import: nothing outside this module.
"""

from __future__ import annotations

import asyncio.subprocess
import ctypes
import functools
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_forking = False


@contextmanager
def forking_helpers() -> Iterator[None]:
    """Fork helpers inside this block: they ignore stop signals and die with this process."""
    global _forking
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    _forking = True
    try:
        yield
    finally:
        _forking = False
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


ORPHAN_POLL_SECONDS = 0.5


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits; exit now if it already has.

    For programs a helper starts from its main thread, which lives exactly as long as the helper.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _spawn_children_that_die_with_us() -> None:
    """In a helper: every program it starts through asyncio (p2pd) dies with it too."""
    original = asyncio.subprocess.create_subprocess_exec
    helper = os.getpid()

    @functools.wraps(original)
    async def create_subprocess_exec(*args, **kwargs):
        kwargs.setdefault("preexec_fn", functools.partial(die_with_parent, helper))
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create_subprocess_exec


def _remember_parent() -> None:
    global _parent
    _parent = os.getpid()


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_SECONDS)
    os._exit(1)


def _exit_on_hosts_sigterm(host: int) -> None:
    """Consume SIGTERM (blocked in every thread of a helper, so it waits here); exit when the host sent it."""
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == host:
            os._exit(128 + signal.SIGTERM)


def _after_fork_in_child() -> None:
    if _forking:
        threading.Thread(target=_exit_when_orphaned, args=(_parent,), name="orphan-watch", daemon=True).start()
        threading.Thread(target=_exit_on_hosts_sigterm, args=(_parent,), name="host-sigterm", daemon=True).start()
        _spawn_children_that_die_with_us()


_parent = os.getpid()
os.register_at_fork(before=_remember_parent, after_in_child=_after_fork_in_child)


def receive_whole(pipe: Connection) -> None:
    """Make ``pipe.recv`` (a helper's end of its command pipe) read each message whole: with the descriptor blocking
    for the read, and non-blocking again for the event loop that polls it."""
    receive = pipe.recv

    def whole() -> Any:
        os.set_blocking(pipe.fileno(), True)
        try:
            return receive()
        finally:
            os.set_blocking(pipe.fileno(), False)

    pipe.recv = whole  # type: ignore[method-assign]
