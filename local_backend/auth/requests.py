"""Checking a signed request: its fields and their types, its run and action, that its time is fresh, and its
signature. Spending its nonce is the rules' part (``rules``), inside the request's transaction."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from client.identity import verify
from local_backend.auth.failures import AuthFailure, bad_request
from local_backend.auth.protocol import ACTION_FIELDS, HEX_DIGITS, MAX_CLOCK_SKEW, SIGNED_FIELDS, canonical


@dataclass(frozen=True)
class SignedRequest:
    """A request whose shape, run, action, time and signature checked out (its nonce is not yet spent)."""

    peer: str  # hex ed25519 public key
    time: float
    nonce: str
    token_sha256: str
    fields: dict[str, str]  # the action's own fields (a join's role)


def check_signed(request: Any, action: str, run_id: str, now: float) -> SignedRequest:
    """Check a request's fields and types, its run and action, that its time is fresh, and its signature."""
    if not isinstance(request, dict):
        raise bad_request("the request body must be a JSON object")
    expected = {*SIGNED_FIELDS, *ACTION_FIELDS[action]}
    if missing := sorted(expected - request.keys()):
        raise bad_request(f"the request lacks {', '.join(missing)}")
    if unexpected := sorted(request.keys() - expected):
        raise bad_request(f"the request has unexpected field(s) {', '.join(unexpected)}")
    for name in sorted(expected - {"time"}):
        if not isinstance(request[name], str):
            raise bad_request(f"{name} must be a string, not {type(request[name]).__name__}")
    for name, digits in HEX_DIGITS.items():
        if not re.fullmatch(f"[0-9a-f]{{{digits}}}", request[name]):
            raise bad_request(f"{name} must be {digits} lowercase hex digits")
    stamp = _finite_time(request["time"])
    if request["run_id"] != run_id:
        raise AuthFailure(HTTPStatus.BAD_REQUEST, "wrong_run",
                          f"this auth service serves run {run_id!r}, not {request['run_id']!r}")
    if request["action"] != action:
        raise bad_request(f"the request is signed for {request['action']!r}, not {action!r}")
    if abs(now - stamp) > MAX_CLOCK_SKEW:
        raise AuthFailure(HTTPStatus.BAD_REQUEST, "stale_request",
                          f"the request's time is over {MAX_CLOCK_SKEW:.0f} s off the service's clock; "
                          "check this machine's clock")
    unsigned = {k: v for k, v in request.items() if k != "signature"}
    if not verify(bytes.fromhex(request["peer"]), canonical(unsigned), bytes.fromhex(request["signature"])):
        raise AuthFailure(HTTPStatus.UNAUTHORIZED, "bad_signature", "the request's signature does not verify")
    return SignedRequest(request["peer"], stamp, request["nonce"], request["token_sha256"],
                         {name: request[name] for name in ACTION_FIELDS[action]})


def _finite_time(value: Any) -> float:
    """A request's time as seconds since the epoch; NaN, infinities and non-numbers would never go stale."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            stamp = float(value)
        except OverflowError:  # an integer beyond any float
            stamp = math.inf
        if math.isfinite(stamp):
            return stamp
    raise bad_request("time must be a finite number of seconds since the epoch")
