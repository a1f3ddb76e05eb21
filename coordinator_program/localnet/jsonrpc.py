"""JSON-RPC 2.0 framing, independent of the transport and of the methods.

Both the HTTP endpoint and the websocket endpoint parse requests here, so that malformed input gets the
same standard errors everywhere: -32700 for bytes that are not JSON, -32600 for JSON that is not a request,
-32601 for an unknown method, -32602 for bad parameters, -32603 (logged) for a failure of the server's own.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("psyswarm.localnet")

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


class RpcError(Exception):
    """An error reply: a JSON-RPC code, a message and optional data, as Solana validators send them."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data

    def to_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def invalid_params(reason: str) -> RpcError:
    return RpcError(INVALID_PARAMS, f"Invalid params: {reason}")


Method = Callable[[list[Any]], Any]


def _valid_id(value: Any) -> bool:
    return value is None or isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


class Dispatcher:
    """Calls ``methods[name](params)`` for each request of a body; batches and notifications included."""

    def __init__(self, methods: dict[str, Method]) -> None:
        self.methods = methods

    def handle(self, body: str | bytes) -> str | None:
        """The reply to one HTTP body or websocket message; None when it held only notifications."""
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            return json.dumps(_error_reply(None, RpcError(PARSE_ERROR, "Parse error")))
        if isinstance(request, list):
            if not request:
                return json.dumps(_error_reply(None, RpcError(INVALID_REQUEST, "Invalid request")))
            replies = [reply for reply in map(self.reply, request) if reply is not None]
            return json.dumps(replies) if replies else None
        reply = self.reply(request)
        return None if reply is None else json.dumps(reply)

    def reply(self, request: Any) -> dict[str, Any] | None:
        """The reply object to one request; None for a valid notification (a request without an id)."""
        if not isinstance(request, dict):
            return _error_reply(None, RpcError(INVALID_REQUEST, "Invalid request"))
        request_id = request.get("id")
        if not _valid_id(request_id):
            return _error_reply(None, RpcError(INVALID_REQUEST, "Invalid request: id must be a number or a string"))
        method, params = request.get("method"), request.get("params", [])
        if request.get("jsonrpc") != "2.0" or not isinstance(method, str):
            return _error_reply(request_id, RpcError(INVALID_REQUEST, "Invalid request"))
        try:
            result = self.call(method, params)
        except RpcError as exc:
            reply = _error_reply(request_id, exc)
        except Exception:
            log.exception("%s failed", method)
            reply = _error_reply(request_id, RpcError(INTERNAL_ERROR, "Internal error"))
        else:
            reply = {"jsonrpc": "2.0", "result": result, "id": request_id}
        return reply if "id" in request else None

    def call(self, method: str, params: Any) -> Any:
        handler = self.methods.get(method)
        if handler is None:
            raise RpcError(METHOD_NOT_FOUND, "Method not found")
        if params is None:
            params = []
        if not isinstance(params, list):
            raise invalid_params("params must be an array")
        return handler(params)


def _error_reply(request_id: Any, error: RpcError) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "error": error.to_json(), "id": request_id}
