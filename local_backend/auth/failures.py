"""A refused request, as the auth service answers it: an HTTP status, a stable error code clients switch on, and
a message for people."""

from __future__ import annotations

from http import HTTPStatus


class AuthFailure(Exception):
    """A refused request: an HTTP status, a stable error code clients switch on, and a message for people."""

    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def answer(self) -> dict[str, str]:
        return {"error": self.code, "message": self.message}


def bad_request(message: str) -> AuthFailure:
    return AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", message)
