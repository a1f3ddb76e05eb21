"""One psyswarm web service on its socket: an ASGI app served by uvicorn under ``WebLimits``, in the foreground
(``serve``, ``serve_forever``) or in a background thread (``start``, then ``shutdown``).

Peers choose how often the stack has something to say about them, not how much it writes: uvicorn's lines (a
malformed request, an app's failure), the event loop's (accept failing when descriptors run out) and the Hub
client's (a request to the Hub) are throttled, a few of a kind per period.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Self

import uvicorn
from starlette.types import ASGIApp

from local_backend.logs import LogThrottle, Throttled
from local_backend.web.body import BoundedBody
from local_backend.web.connections import GuardedConfig
from local_backend.web.limits import WebLimits

LIBRARY_LOGS = ("uvicorn.error", "asyncio", "httpx", "httpx2")
"""The loggers the stack throttles: uvicorn's (one line per malformed request), the event loop's (one line per
failed accept) and huggingface_hub's HTTP clients' (one line per call to the Hub, which any request bearing a
token the service has not seen makes)."""
_throttled = Throttled(LogThrottle(logging.getLogger("psyswarm.web")))


class WebServer:
    """``app`` served on ``host:port`` (port 0: a free one) under ``limits``; the socket listens from the start."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                 limits: WebLimits = WebLimits()) -> None:
        self.limits = limits.fitted_to_open_files()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        self._server = uvicorn.Server(GuardedConfig(BoundedBody(app, self.limits), self.limits))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def serve(self) -> None:
        """Serve until ``shutdown`` (or, in the main thread, SIGINT or SIGTERM)."""
        throttle_library_logs()
        flushing = asyncio.create_task(_flush_every(_throttled.throttle.period))
        try:
            await self._server.serve(sockets=[self._socket])
        finally:
            flushing.cancel()

    def serve_forever(self) -> None:
        asyncio.run(self.serve())

    def start(self) -> Self:
        """Serve in a background thread (tests, embedding)."""
        self._thread = threading.Thread(target=self.serve_forever, name="web-service", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving, from any thread; returns once a ``start``-ed server has stopped."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def server_close(self) -> None:
        self._socket.close()


def throttle_library_logs() -> None:
    """Put ``LIBRARY_LOGS`` under the stack's throttle (once per process), and leave uvicorn's informational lines
    (started, shutting down) out: the commands say what they serve themselves."""
    for name in LIBRARY_LOGS:
        logger = logging.getLogger(name)
        if _throttled not in logger.filters:
            logger.addFilter(_throttled)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)


async def _flush_every(period: float) -> None:
    """Write the throttle's counts of left-out lines once their period ends, even if no line of their kind
    comes again."""
    while True:
        await asyncio.sleep(period)
        _throttled.flush()
