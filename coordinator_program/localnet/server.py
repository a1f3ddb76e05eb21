"""``psyswarm localnet``'s endpoints: JSON-RPC over HTTP on a port, account subscriptions on the next one.

The two ports follow solana-test-validator (8899 and 8900), so Solana tooling derives the websocket URL
from the HTTP one as it does for a real validator. HTTP/1.1 is parsed by h11 (already installed with
httpx) on asyncio streams, so the chain, the RPC and the subscriptions share one thread and LiteSVM needs
no locking. Bad HTTP gets a 4xx and the connection closed; bad JSON-RPC gets a JSON-RPC error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import logging
from collections.abc import Callable

import h11
from websockets.asyncio.server import serve as serve_websockets

from coordinator_program.localnet.chain import LocalChain
from coordinator_program.localnet.jsonrpc import Dispatcher
from coordinator_program.localnet.methods import ChainMethods
from coordinator_program.localnet.pubsub import AccountSubscriptions

log = logging.getLogger("psyswarm.localnet")

MAX_BODY = 64 * 1024
"""Largest request body accepted: ample for 100 account keys or a 1,232-byte transaction in base58."""
MAX_HEADERS = 16 * 1024
IDLE_TIMEOUT = 60.0
"""A keep-alive connection that sends nothing for this long is closed."""


class HttpError(Exception):
    """A request refused at the HTTP level, with its status code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _next_event(connection: h11.Connection, reader: asyncio.StreamReader) -> h11.Event | type[h11.PAUSED]:
    while True:
        event = connection.next_event()
        if event is not h11.NEED_DATA:
            return event
        connection.receive_data(await asyncio.wait_for(reader.read(MAX_BODY), IDLE_TIMEOUT))


async def _read_request(connection: h11.Connection, reader: asyncio.StreamReader) -> tuple[h11.Request, bytes] | None:
    """The next request and its body, or None when the client closed the connection between requests."""
    request = await _next_event(connection, reader)
    if isinstance(request, h11.ConnectionClosed):
        return None
    assert isinstance(request, h11.Request), request  # all h11 yields to a server awaiting a request
    body = bytearray()
    while not isinstance(event := await _next_event(connection, reader), h11.EndOfMessage):
        assert isinstance(event, h11.Data), event
        body += event.data
        if len(body) > MAX_BODY:
            raise HttpError(413, f"request bodies are limited to {MAX_BODY} bytes")
    return request, bytes(body)


def _response(connection: h11.Connection, status: int, body: bytes, content_type: str,
              close: bool = False) -> bytes:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    if close:
        headers.append(("Connection", "close"))
    reason = http.HTTPStatus(status).phrase.encode()
    return (connection.send(h11.Response(status_code=status, headers=headers, reason=reason))
            + connection.send(h11.Data(data=body)) + connection.send(h11.EndOfMessage()))


async def serve_http(dispatcher: Dispatcher, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One HTTP connection: POST bodies are JSON-RPC; GET /health answers ``ok``, as a validator's does."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADERS)
    try:
        while (received := await _read_request(connection, reader)) is not None:
            request, body = received
            if request.method == b"POST":
                reply = dispatcher.handle(body)
                writer.write(_response(connection, 200, (reply or "").encode(), "application/json"))
            elif request.method == b"GET" and request.target == b"/health":
                writer.write(_response(connection, 200, b"ok", "text/plain"))
            else:
                writer.write(_response(connection, 405, b"use POST for JSON-RPC", "text/plain"))
            await writer.drain()
            if connection.our_state is h11.MUST_CLOSE:
                break
            connection.start_next_cycle()
    except (h11.RemoteProtocolError, HttpError) as exc:
        status = exc.status if isinstance(exc, HttpError) else exc.error_status_hint
        if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with contextlib.suppress(h11.LocalProtocolError, ConnectionError):
                writer.write(_response(connection, status, f"bad request: {exc}".encode(), "text/plain", True))
                await writer.drain()
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def run_localnet(host: str, port: int, chain: LocalChain, on_ready: Callable[[], None] | None = None) -> None:
    """Serve ``chain`` until cancelled: JSON-RPC on ``port``, subscriptions on ``port + 1``."""
    dispatcher = Dispatcher(ChainMethods(chain).table())
    subscriptions = AccountSubscriptions(chain)
    rpc_server = await asyncio.start_server(functools.partial(serve_http, dispatcher), host, port)
    async with rpc_server, serve_websockets(subscriptions.serve, host, port + 1, max_size=MAX_BODY):
        if on_ready is not None:
            on_ready()
        await asyncio.Event().wait()
