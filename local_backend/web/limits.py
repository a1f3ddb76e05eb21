"""What either web service lets a client hold: the one place the deadlines, caps and sizes of psyswarm's web
services are set. The defaults suit both: each takes small requests (the auth service small JSON objects, the
dashboard none) from a few clients at a time."""

from __future__ import annotations

import dataclasses
import logging

from local_backend.open_files import open_file_limit

log = logging.getLogger("psyswarm.web")

RESERVED_FILES = 64
"""Descriptors kept out of the connection cap: the listener, databases, the event loop, the standard streams,
the dashboard's connection to the coordinator and its DHT, modules imported late."""


@dataclasses.dataclass(frozen=True)
class WebLimits:
    """The limits every psyswarm web service enforces on its clients."""

    header_timeout: float = 10.0
    """Seconds a request's headers have to arrive, counted from the accept, or from the previous answer on a
    kept-alive connection: a client trickling bytes holds a connection no longer (else 408)."""
    body_timeout: float = 10.0
    """Seconds a request's body has to arrive once its headers are in (else 408)."""
    max_connections: int = 1024
    """Connections open at once; more are answered 503 at once."""
    max_connections_per_client: int = 512
    """Connections one client address may hold (more: 503 at once); half the total, so no one address fills the
    server alone."""
    max_header_bytes: int = 16 * 1024
    """The request line and headers at most (else 431)."""
    max_body_bytes: int = 16 * 1024
    """A request's body at most (else 413)."""
    keep_alive: float = 5.0
    """Seconds an idle kept-alive connection stays open (the dashboard's page asks once a second)."""
    linger: float = 1.0
    """Seconds that, after a closing answer, what the client still sends is read and dropped: closing with its
    input unread would reset the connection, and a client still sending would lose the answer."""
    shutdown_grace: float = 5.0
    """Seconds a stopping service waits for the answers in progress."""
    backlog: int = 1024
    """Connections the kernel queues before they are accepted."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"{field.name} must be positive, not {getattr(self, field.name)}")

    def fitted_to_open_files(self) -> WebLimits:
        """These limits, with the connection caps lowered to what the process may open once its soft open-file
        limit is raised as far as the hard one allows: past the limit accept fails, and a cap above it would
        never refuse anyone."""
        need = self.max_connections + RESERVED_FILES
        soft = open_file_limit(need)
        if soft >= need:
            return self
        cap = int(soft) - RESERVED_FILES
        if cap < 1:
            raise ValueError(f"the open-file limit ({soft}) leaves no room for connections: raise it (ulimit -n)")
        log.warning("the open-file limit (%d) allows %d web connections, not %d: raise it (ulimit -n) for more",
                    soft, cap, self.max_connections)
        per_client = max(1, self.max_connections_per_client * cap // self.max_connections)
        return dataclasses.replace(self, max_connections=cap, max_connections_per_client=per_client)
