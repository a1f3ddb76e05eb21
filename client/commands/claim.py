"""One process per identity on a machine: ``join-run`` claims its keypair's public key before it joins.

Two processes started with one keypair are one client to the coordinator: the first joins, the second finds
itself queued or admitted already and would wait for ever, doing nothing. So ``join-run`` takes an exclusive
lock on ``<cache>/psyswarm/<pubkey>.lock`` (``$XDG_CACHE_HOME``, or ``~/.cache``) for its whole life, and a second
process of that identity on the machine ends at once with one line saying what to do. The lock is a POSIX
record lock (``fcntl.lockf``): the kernel releases it when its process dies however it dies, and a child process
does not inherit it, so a client restarted after a crash claims it again and rejoins as before. Processes on
different machines cannot see each other's locks, and the coordinator cannot tell a restart from a second machine:
a ``join-run`` whose identity the coordinator already lists logs that it takes that place again and that one
keypair serves one process; keeping to it across machines is the user's part.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO


class IdentityInUse(RuntimeError):
    """Another live process on this machine holds the identity; the message says which and what to do."""


def lock_directory() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "psyswarm"


def claim_identity(pubkey: str, run_id: str, directory: Path | None = None) -> IO[str] | None:
    """Hold ``pubkey`` for this process (keep the returned file open for as long as it runs), or raise
    ``IdentityInUse`` naming the process and the run that hold it. None when no lock can be made here (a read-only
    home): the claim protects the user from a mistake, and must not keep a client from running."""
    directory = directory or lock_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / f"{pubkey}.lock", "a+")  # noqa: SIM115 - held open for the process's life
    except OSError:
        return None
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = _holder(handle.read())
        handle.close()
        raise IdentityInUse(
            f"{pubkey} is already in run {holder.get('run', '?')!r} (another process uses this keypair: pid "
            f"{holder.get('pid', '?')}): give each process its own keypair: psyswarm keygen -o worker2.json, then "
            "--keypair worker2.json") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "run": run_id}))
    handle.flush()
    return handle


def _holder(text: str) -> dict:
    """What the holding process wrote in the lock file; empty if it is being written or was tampered with."""
    with contextlib.suppress(ValueError):
        found = json.loads(text)
        if isinstance(found, dict):
            return found
    return {}
