"""A request the auth service refuses: an HTTP status, a stable error code clients switch on, and a message for
people, answered as every psyswarm web service answers a refusal."""

from __future__ import annotations

from http import HTTPStatus

from local_backend.web.answers import Refusal


class AuthFailure(Refusal):
    """A request the auth service refuses."""


def bad_request(message: str) -> AuthFailure:
    return AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", message)
