"""A request's body under ``WebLimits``: read whole before the app runs, within ``body_timeout`` of its headers
and at most ``max_body_bytes`` (declared or sent), else refused with 408 or 413. Both services take small bodies
or none, so holding one whole costs little, and no app ever waits on a slow client."""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from local_backend.web.answers import Refusal
from local_backend.web.limits import WebLimits


class BoundedBody:
    """ASGI middleware that hands ``app`` each request with its whole body, or refuses the request."""

    def __init__(self, app: ASGIApp, limits: WebLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._body(scope, receive)
        except Refusal as refused:
            await refused.response()(scope, receive, send)
            return
        if body is not None:  # else the client went away
            await self.app(scope, _replay(body, receive), send)

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        declared = dict(scope["headers"]).get(b"content-length", b"0")  # h11 checked it: 1 to 20 digits
        if int(declared) > self.limits.max_body_bytes:
            raise self._too_large()
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > self.limits.max_body_bytes:
                        raise self._too_large()
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            raise Refusal(HTTPStatus.REQUEST_TIMEOUT, "timeout", f"the request's body did not arrive within "
                           f"{self.limits.body_timeout:g} s") from None

    def _too_large(self) -> Refusal:
        return Refusal(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "too_large",
                        f"the body is over {self.limits.max_body_bytes} bytes, the most this service takes")


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` as the app sees it: the whole body at once, then what the connection says next (a disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
