"""The auth service over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

import h11

from local_backend.auth.failures import AuthFailure, bad_request
from local_backend.auth.rules import AuthService

log = logging.getLogger("psyswarm.auth")

MAX_REQUEST_BYTES = 16 * 1024
MAX_HEADER_BYTES = 16 * 1024
REQUEST_TIMEOUT = 10.0  # seconds a client has to send its whole request
MAX_CONNECTIONS = 1024  # open connections at once; more are answered 503 at once
WORKERS = 8  # threads running requests (they may wait on the Hub or on SQLite)
LISTEN_BACKLOG = 1024
LINGER_SECONDS = 1.0  # after answering, how long the rest of a client's input is read and discarded


class AuthHTTPServer:
    """The auth service over HTTP: PUT /api/join, POST /api/queue|synced|leave|countersign, GET /api/occupancy and
    /api/contributors?run_id=.

    One asyncio loop holds the connections; each must deliver its whole request within ``request_timeout``
    (else 408), at most ``max_connections`` are open at once (more are answered 503), and requests run on
    ``workers`` threads. One request per connection.
    """

    def __init__(self, service: AuthService, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout: float = REQUEST_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 workers: int = WORKERS) -> None:
        self.service = service
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="auth-request")
        self._open = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving, self._stopped = threading.Event(), threading.Event()

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def start(self) -> AuthHTTPServer:
        """Serve in a background thread (tests, embedding); ``shutdown()`` stops it."""
        threading.Thread(target=self.serve_forever, name="auth-service", daemon=True).start()
        self._serving.wait()
        return self

    def shutdown(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._stopped.wait()

    def server_close(self) -> None:
        self._socket.close()
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            server = await asyncio.start_server(self._connection, sock=self._socket, backlog=LISTEN_BACKLOG)
            async with server:
                self._serving.set()
                await self._stop.wait()
        finally:
            self._serving.set()
            self._stopped.set()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self.max_connections:
                status, answer = HTTPStatus.SERVICE_UNAVAILABLE, {
                    "error": "busy", "message": "the auth service has too many open connections; try again shortly"}
            else:
                status, answer = await self._respond(reader)
            writer.write(_response(status, answer))
            async with asyncio.timeout(self.request_timeout):
                await writer.drain()
            writer.write_eof()
            await _linger(reader)
            writer.close()
        except (OSError, TimeoutError):  # the client went away or does not read: nothing more to tell it
            writer.transport.abort()
        except Exception:  # nothing a client sends may stop the loop; a bug drops only this connection
            log.exception("auth connection failed")
            writer.transport.abort()
        finally:
            self._open -= 1

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[HTTPStatus, dict[str, Any]]:
        try:
            async with asyncio.timeout(self.request_timeout):
                request, body = await _read_request(reader)
        except TimeoutError:
            return HTTPStatus.REQUEST_TIMEOUT, {
                "error": "timeout", "message": f"the request did not arrive within {self.request_timeout:g} s"}
        except h11.RemoteProtocolError as exc:
            return HTTPStatus(exc.error_status_hint), {"error": "bad_request", "message": f"malformed HTTP: {exc}"}
        except AuthFailure as failure:
            return failure.status, failure.answer()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._workers, self._dispatch, request, body)

    def _dispatch(self, request: h11.Request, body: bytes) -> tuple[HTTPStatus, dict[str, Any]]:
        method, target = request.method.decode(), request.target.decode("ascii", "replace")
        try:
            return HTTPStatus.OK, self._route(method, target, dict(request.headers), body)
        except AuthFailure as failure:
            return failure.status, failure.answer()
        except Exception:  # a bug must answer 500 and keep the service up, never leave the client hanging
            log.exception("auth request %s %s failed", method, target)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal", "message": "internal error"}

    def _route(self, method: str, target: str, headers: dict[bytes, bytes], body: bytes) -> dict[str, Any]:
        service = self.service
        if (method, target) == ("GET", "/api/occupancy"):
            return service.occupancy()
        path, _, query = target.partition("?")
        if (method, path) == ("GET", "/api/contributors"):
            return service.contributors(_query_value(query, "run_id"))
        if (method, target) == ("PUT", "/api/join"):
            request = _json_body(body)
            return service.join(_bearer(headers), request)
        actions = {"/api/queue": service.queue, "/api/synced": service.synced, "/api/leave": service.leave,
                   "/api/countersign": service.countersign}
        action = actions.get(target) if method == "POST" else None
        if action is None:
            raise AuthFailure(HTTPStatus.NOT_FOUND, "not_found", f"no {method} {target}")
        return action(_json_body(body))


async def _read_request(reader: asyncio.StreamReader) -> tuple[h11.Request, bytes]:
    """One request and its body, parsed by h11: headers stop at twice ``MAX_HEADER_BYTES``, the body at
    ``MAX_REQUEST_BYTES``."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(MAX_HEADER_BYTES))  # h11 refuses more once incomplete
        elif isinstance(event, h11.Request):
            request = event
            declared = dict(event.headers).get(b"content-length", b"0")  # h11 checked it: 1 to 20 digits
            if int(declared) > MAX_REQUEST_BYTES:
                raise _too_large()
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_REQUEST_BYTES:
                raise _too_large()
        elif isinstance(event, h11.EndOfMessage) and request is not None:
            return request, bytes(body)
        else:
            raise h11.RemoteProtocolError("the connection closed before a whole request arrived", 400)


async def _linger(reader: asyncio.StreamReader) -> None:
    """Let the client read the answer before closing: closing with its input unread (an oversize body, say)
    would reset the connection and lose the answer. At most ``LINGER_SECONDS``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_SECONDS):
            while await reader.read(MAX_HEADER_BYTES):
                pass


def _too_large() -> AuthFailure:
    return AuthFailure(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "too_large",
                       f"the body is over {MAX_REQUEST_BYTES} bytes; a request is a small JSON object")


def _json_body(body: bytes) -> Any:
    if not body:
        raise bad_request(f"the body must be 1..{MAX_REQUEST_BYTES} bytes of JSON")
    try:
        return json.loads(body)
    except RecursionError:
        raise bad_request("the body's JSON nests too deeply; a request is a flat object") from None
    except ValueError:
        raise bad_request("the body is not JSON") from None


def _query_value(query: str, name: str) -> str:
    """The one value of ``name`` in a query string; a missing or repeated one is a bad request."""
    try:
        values = urllib.parse.parse_qs(query, keep_blank_values=True, max_num_fields=8).get(name, [])
    except ValueError:  # more fields than a query of this service has
        values = []
    if len(values) != 1:
        raise bad_request(f"give exactly one {name}= in the query")
    return values[0]


def _bearer(headers: dict[bytes, bytes]) -> str:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
        raise AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                          "no Hugging Face token: send it as 'Authorization: Bearer <token>'")
    return auth.removeprefix("Bearer ").strip()


def _response(status: HTTPStatus, answer: dict[str, Any]) -> bytes:
    data = json.dumps(answer).encode()
    head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode() + data

