"""The auth service's HTTP API: a starlette app, served like every psyswarm web service by the shared web stack
(``local_backend.web``: deadlines, connection caps and sizes, set in ``WebLimits``).

PUT /api/join (``Authorization: Bearer <HF token>``), POST /api/queue, /api/synced, /api/leave and
/api/countersign, GET /api/occupancy and /api/contributors?run_id=. Every answer is JSON and closes its
connection (one request per connection: a client asks a few times a minute); a refusal is ``{"error": code,
"message": text}``, with anything unrouted a 404 ``not_found``. Requests run on ``workers`` threads, since they
may wait on the Hub or on SQLite and the event loop must not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from local_backend.auth.failures import AuthFailure, bad_request
from local_backend.auth.rules import AuthService
from local_backend.web.answers import Refusal, json_answer
from local_backend.web.limits import WebLimits
from local_backend.web.server import WebServer

log = logging.getLogger("psyswarm.auth")

WORKERS = 8  # threads running requests (they may wait on the Hub or on SQLite)

Work = Callable[[Request, bytes], dict[str, Any]]
"""What a route does with a request and its body, on a worker thread: the answer, or ``AuthFailure``."""


class AuthHTTPServer(WebServer):
    """The auth service on ``host:port``, its requests run on ``workers`` threads."""

    def __init__(self, service: AuthService, host: str = "127.0.0.1", port: int = 0, *,
                 limits: WebLimits = WebLimits(), workers: int = WORKERS) -> None:
        self.service = service
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="auth-request")
        super().__init__(create_app(service, self._workers, limits.max_body_bytes), host, port, limits=limits)

    def server_close(self) -> None:
        super().server_close()
        self._workers.shutdown(wait=False, cancel_futures=True)


def create_app(service: AuthService, workers: ThreadPoolExecutor, max_body_bytes: int) -> Starlette:
    def endpoint(work: Work) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            body = await request.body()  # already whole: the web stack reads it before the app runs
            return await asyncio.get_running_loop().run_in_executor(workers, _run, work, request, body)

        return answer

    def json_body(body: bytes) -> Any:
        if not body:
            raise bad_request(f"the body must be 1..{max_body_bytes} bytes of JSON")
        try:
            return json.loads(body)
        except RecursionError:
            raise bad_request("the body's JSON nests too deeply; a request is a flat object") from None
        except ValueError:
            raise bad_request("the body is not JSON") from None

    def act(action: Callable[[Any], dict[str, Any]]) -> Work:
        return lambda request, body: action(json_body(body))

    routes = [
        Route("/api/occupancy", endpoint(lambda request, body: service.occupancy()), methods=["GET"]),
        Route("/api/contributors", endpoint(lambda request, body: service.contributors(
            _query_value(_query(request), "run_id"))), methods=["GET"]),
        Route("/api/join", endpoint(lambda request, body: service.join(_bearer(request.headers), json_body(body),
                                                                       _address(request))), methods=["PUT"]),
        *(Route(path, endpoint(act(action)), methods=["POST"]) for path, action in (
            ("/api/queue", service.queue), ("/api/synced", service.synced), ("/api/leave", service.leave),
            ("/api/countersign", service.countersign))),
    ]
    return Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_found})


def _run(work: Work, request: Request, body: bytes) -> Response:
    """``work``'s answer, or its refusal; a bug answers 500 and keeps the service up, never leaving the client
    hanging."""
    try:
        return json_answer(HTTPStatus.OK, work(request, body))
    except AuthFailure as failure:
        return failure.response()
    except Exception:
        log.exception("auth request %s %s failed", request.method, _target(request))
        return Refusal(HTTPStatus.INTERNAL_SERVER_ERROR, "internal", "internal error").response()


def _not_found(request: Request, exc: Exception) -> Response:
    return Refusal(HTTPStatus.NOT_FOUND, "not_found", f"no {request.method} {_target(request)}").response()


def _query(request: Request) -> str:
    return request.scope["query_string"].decode("ascii", "replace")


def _target(request: Request) -> str:
    """The request's target as the client sent it."""
    query = _query(request)
    return request.scope["raw_path"].decode("ascii", "replace") + (f"?{query}" if query else "")


def _query_value(query: str, name: str) -> str:
    """The one value of ``name`` in a query string; a missing or repeated one is a bad request."""
    try:
        values = urllib.parse.parse_qs(query, keep_blank_values=True, max_num_fields=8).get(name, [])
    except ValueError:  # more fields than a query of this service has
        values = []
    if len(values) != 1:
        raise bad_request(f"give exactly one {name}= in the query")
    return values[0]


def _address(request: Request) -> str:
    """The peer's IP address, which a request for a new slot is charged to (``AuthService.join``)."""
    return request.client.host if request.client is not None else ""


def _bearer(headers: Headers) -> str:
    auth = headers.get("authorization", "")
    if not auth.startswith("Bearer ") or not auth.removeprefix("Bearer ").strip():
        raise AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                          "no Hugging Face token: send it as 'Authorization: Bearer <token>'")
    return auth.removeprefix("Bearer ").strip()
