"""What one HTTP connection may hold, enforced in uvicorn's h11 protocol: a deadline for each request's headers,
caps on open connections (in all, and per client address) that refuse at once, and refusals that reach the
client (uvicorn's own refusals are plain text, and close at once on a client that may still be sending).

A request's body is the ASGI layer's (``body``): there the request is known and the app has not yet run.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from local_backend.web.answers import Refusal
from local_backend.web.limits import WebLimits


class GuardedConfig(uvicorn.Config):
    """uvicorn's settings for one web service under ``limits``, and the count of its open connections per client
    address. Its logs are the process's (no access log, uvicorn's lines through the root logger), and nothing a
    client sends chooses its address (no proxy headers) or upgrades its connection (no WebSockets)."""

    def __init__(self, app: ASGIApp, limits: WebLimits) -> None:
        super().__init__(app, http=GuardedH11Protocol, ws="none", lifespan="off", log_config=None, access_log=False,
                         proxy_headers=False, backlog=limits.backlog, timeout_keep_alive=limits.keep_alive,
                         h11_max_incomplete_event_size=limits.max_header_bytes,
                         timeout_graceful_shutdown=limits.shutdown_grace)  # type: ignore[arg-type]
        self.limits = limits
        self.per_client: Counter[str] = Counter()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection, under its service's ``WebLimits``."""

    config: GuardedConfig

    def __init__(self, config: GuardedConfig, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.limits
        self.conn = _Parser(self._headers_in, self.limits.max_header_bytes)
        self._deadline: asyncio.TimerHandle | None = None
        self._address = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Lingering(transport, self.limits.linger, self.loop))  # type: ignore[arg-type]
        self._address = self.client[0] if self.client else ""
        self.config.per_client[self._address] += 1
        if len(self.connections) > self.limits.max_connections:
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "busy",
                         "the service has too many open connections; try again shortly")
        elif self.config.per_client[self._address] > self.limits.max_connections_per_client:
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "busy",
                         f"this address holds {self.limits.max_connections_per_client} connections to the service, "
                         "the most one address may; close one first")
        else:
            self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.config.per_client[self._address] -= 1
        if not self.config.per_client[self._address]:
            del self.config.per_client[self._address]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self.transport.is_closing():  # else it lingers: the rest of the input is read and dropped
            super().data_received(data)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._await_headers()  # the next request's, counted from this answer
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse, with h11's reason and status (431 for oversize headers)."""
        failure = self.conn.failure
        status = HTTPStatus(failure.error_status_hint) if failure else HTTPStatus.BAD_REQUEST
        self._refuse(status, "bad_request", f"malformed HTTP: {failure or msg}")

    def shutdown(self) -> None:
        if not self.transport.is_closing():  # a refused connection already said all it will
            super().shutdown()

    def _refuse(self, status: HTTPStatus, code: str, message: str) -> None:
        self._cancel_deadline()
        self.transport.write(Refusal(status, code, message).raw())
        self.transport.close()

    def _await_headers(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _headers_in(self) -> None:
        self._cancel_deadline()

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self._refuse(HTTPStatus.REQUEST_TIMEOUT, "timeout",
                         f"the request's headers did not arrive within {self.limits.header_timeout:g} s")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class _Parser(h11.Connection):
    """uvicorn's h11 parser, telling the connection when a request's headers are in, keeping why parsing failed
    (uvicorn's own handling drops the reason), and holding a request's headers to ``max_header_bytes`` even when
    they arrive whole in one read (h11 caps only headers still incomplete, and uvicorn reads up to 256 KiB)."""

    def __init__(self, headers_in: Callable[[], None], max_header_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_header_bytes)
        self.headers_in, self.max_header_bytes = headers_in, max_header_bytes
        self.failure: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        pending = len(self.trailing_data[0]) if self.their_state is h11.IDLE else 0
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and pending - len(self.trailing_data[0]) > self.max_header_bytes:
                raise h11.RemoteProtocolError(f"the request's headers are over {self.max_header_bytes} bytes",
                                              error_status_hint=HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
        except h11.RemoteProtocolError as exc:
            self.failure = exc
            raise
        if isinstance(event, h11.Request):
            self.headers_in()
        return event


class _Lingering:
    """A connection's transport whose ``close`` lingers: it ends the answer (EOF), then reads and drops what the
    client still sends until the client closes or ``linger`` seconds pass."""

    def __init__(self, transport: asyncio.Transport, linger: float, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._linger, self._loop = transport, linger, loop
        self._lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing():
            return
        self._lingering = True
        self._transport.resume_reading()
        if self._transport.can_write_eof():
            self._transport.write_eof()
        self._loop.call_later(self._linger, self._transport.close)
