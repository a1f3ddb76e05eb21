"""The auth service's signed-request format: what the client and the service must agree on, and nothing else.

A request is a JSON object signed by the peer's ed25519 key over its canonical JSON (``canonical``): the run
id, the action, the peer's key, the time, a fresh random nonce of ``NONCE_BYTES`` and the sha256 of the token
its slot is held under (``token_sha256``, never the token), plus the action's own fields
(``ACTION_FIELDS``). A refusal is answered as ``{"error": code, "message": text}``. The client
(``client.join.auth``) imports this module alone of the auth service: it never needs the server's side.

May import: nothing outside this module.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

NONCE_BYTES = 16
MAX_CLOCK_SKEW = 120.0  # seconds a signed request's timestamp may differ from the service's clock
ROLES = ("worker", "trainer")
SIGNED_FIELDS = ("run_id", "action", "peer", "time", "nonce", "token_sha256", "signature")
ACTION_FIELDS: dict[str, tuple[str, ...]] = {"join": ("role",), "queue": (), "synced": (), "leave": (),
                                              "countersign": ("message",)}
HEX_DIGITS = {"peer": 64, "nonce": 2 * NONCE_BYTES, "token_sha256": 64, "signature": 128}


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes a request or grant signature covers."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def token_sha256(token: str) -> str:
    """What requests are signed over in place of the token: it binds them to the token without revealing it."""
    return hashlib.sha256(token.encode()).hexdigest()
