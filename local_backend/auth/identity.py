"""Who owns a Hugging Face token: the only use the auth service makes of a token, which it never stores."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http import HTTPStatus

from local_backend.auth.failures import AuthFailure
from local_backend.auth.protocol import token_sha256


class HubIdentity:
    """Who owns a Hugging Face token, asked of the Hub's ``/api/whoami-v2`` through huggingface_hub.

    Answers are cached per token hash for ``ttl`` seconds: the Hub rate-limits whoami, and slot renewals
    would otherwise call it every few minutes per peer.
    """

    def __init__(self, endpoint: str | None = None, *, ttl: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from huggingface_hub import HfApi

        self.api = HfApi(endpoint=endpoint)
        self.endpoint = self.api.endpoint
        self.ttl = ttl
        self.clock = clock
        self._cache: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()

    def __call__(self, token: str) -> str:
        """The token owner's Hub user name; ``AuthFailure`` for a bad token or an unreachable Hub."""
        from huggingface_hub.errors import HfHubHTTPError

        key = token_sha256(token)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and self.clock() - cached[0] < self.ttl:
                return cached[1]
        try:
            answer = self.api.whoami(token=token)
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status in (401, 403):
                raise AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                                  f"the Hugging Face Hub at {self.endpoint} does not recognise this token") from None
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"the Hugging Face Hub at {self.endpoint} answered {status}; try again later") from None
        except Exception as exc:  # transport errors differ across huggingface_hub versions (requests, httpx)
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"cannot reach the Hugging Face Hub at {self.endpoint}: {exc}") from None
        name = answer.get("name") if isinstance(answer, dict) else None
        if not isinstance(name, str) or not name:
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"the Hugging Face Hub at {self.endpoint} returned no user name for the token")
        with self._lock:
            now = self.clock()
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.ttl}
            self._cache[key] = (now, name)
        return name
