"""How a psyswarm web service refuses what it will not serve (``Refusal``): JSON ``{"error": code, "message":
text}``, the auth service's refusals and the web stack's own in both services, on an answer that closes the
connection."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from starlette.responses import Response


class Refusal(Exception):
    """A request a service will not serve: an HTTP status, a stable error code clients switch on, and a message
    for people."""

    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, str]:
        return {"error": self.code, "message": self.message}

    def response(self) -> Response:
        """The refusal, as an app answers it."""
        return json_answer(self.status, self.body())

    def raw(self) -> bytes:
        """The refusal as the bytes sent, for a connection refused before a request was parsed (too many
        connections, headers too late or malformed), where no app runs."""
        body = json.dumps(self.body()).encode()
        head = (f"HTTP/1.1 {self.status.value} {self.status.phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        return head.encode() + body


def json_answer(status: HTTPStatus, answer: dict[str, Any]) -> Response:
    """A JSON answer that closes its connection."""
    return Response(json.dumps(answer).encode(), status_code=status, media_type="application/json",
                    headers={"Connection": "close"})
