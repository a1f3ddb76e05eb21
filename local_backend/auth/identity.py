"""Who owns a Hugging Face token: the only use the auth service makes of a token, which it never stores."""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from http import HTTPStatus

from local_backend.auth.failures import AuthFailure
from local_backend.auth.protocol import token_sha256

MAX_REFUSED = 65_536  # refused token hashes remembered (the oldest forgotten first)
MAX_KNOWN = 65_536  # token hashes the Hub accepted, remembered (the longest unconfirmed forgotten first)
MAX_NAME_CHARS = 96  # the Hub's longest namespace (huggingface_hub's REPO_ID_REGEX)


def hub_user_name(name: object, endpoint: str) -> str:
    """``name`` if it is a name the Hub gives users, else ``AuthFailure`` saying why.

    The name is stored with every slot, counts a contributor's slots and is shown on the dashboard, and the
    Hub that answers is whatever ``--hf-endpoint`` names: so it is held to the Hub's own rule for a namespace
    (huggingface_hub's ``validate_repo_id``: 1–96 ASCII letters, digits, ``-``, ``_`` and ``.``; no ``--`` or
    ``..``; neither end ``-`` or ``.``), which every real user name meets, since every repo id starts with one.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(name, str) or not name:
        raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                          f"the Hugging Face Hub at {endpoint} returned no user name for the token")
    try:
        validate_repo_id(name)
        valid = "/" not in name  # validate_repo_id also takes "namespace/name"
    except HFValidationError:
        valid = False
    if not valid:
        shown = name[:MAX_NAME_CHARS] + ("…" if len(name) > MAX_NAME_CHARS else "")
        raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                          f"the Hugging Face Hub at {endpoint} returned {shown!r} ({len(name)} characters) as the "
                          f"token's user name, which is not a Hub user name (1-{MAX_NAME_CHARS} letters, digits, "
                          "'-', '_' or '.'); check --hf-endpoint")
    return name


class HubIdentity:
    """Who owns a Hugging Face token, asked of the Hub's ``/api/whoami-v2`` through huggingface_hub.

    Answers are cached per token hash for ``ttl`` seconds: the Hub rate-limits whoami, and slot renewals
    would otherwise call it every few minutes per peer. Refusals are cached as well (for ``ttl``, at most
    ``MAX_REFUSED`` of them), and the Hub is asked about at most ``lookups`` unseen tokens per ``window``
    seconds: a flood of made-up tokens is answered from here, and the Hub sees a bounded number of calls. A
    token the Hub accepted before is re-checked once its answer is ``ttl`` old outside that bound (at most once
    per ``ttl`` each, and only tokens the Hub accepted become known), so a flood that spends the bound never
    keeps a contributor already in the run from renewing its slot; one the Hub now refuses is forgotten.
    """

    def __init__(self, endpoint: str | None = None, *, ttl: float = 300.0, lookups: int = 30, window: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from huggingface_hub import HfApi

        self.api = HfApi(endpoint=endpoint)
        self.endpoint = self.api.endpoint
        self.ttl, self.lookups, self.window = ttl, lookups, window
        self.clock = clock
        self._cache: OrderedDict[str, tuple[float, str]] = OrderedDict()  # token hash -> (confirmed when, user)
        self._refused: OrderedDict[str, float] = OrderedDict()  # token hash -> when the Hub refused it
        self._asked: deque[float] = deque()  # when the Hub was last asked, at most ``lookups`` times
        self._lock = threading.Lock()

    def __call__(self, token: str) -> str:
        """The token owner's Hub user name; ``AuthFailure`` for a bad token or an unreachable Hub."""
        from huggingface_hub.errors import HfHubHTTPError

        key = token_sha256(token)
        with self._lock:
            now = self.clock()
            cached = self._cache.get(key)
            if cached is not None and now - cached[0] < self.ttl:
                return cached[1]
            if now - self._refused.get(key, -math.inf) < self.ttl:
                raise self._invalid()
            if cached is None:
                self._spend_lookup(now)
        try:
            answer = self.api.whoami(token=token)
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else None
            if status in (401, 403):
                self._remember_refusal(key)
                raise self._invalid() from None
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"the Hugging Face Hub at {self.endpoint} answered {status}; try again later") from None
        except Exception as exc:  # transport errors differ across huggingface_hub versions (requests, httpx)
            raise AuthFailure(HTTPStatus.BAD_GATEWAY, "identity_unavailable",
                              f"cannot reach the Hugging Face Hub at {self.endpoint}: {exc}") from None
        name = hub_user_name(answer.get("name") if isinstance(answer, dict) else None, self.endpoint)
        with self._lock:
            self._cache[key] = (self.clock(), name)
            self._cache.move_to_end(key)
            while len(self._cache) > MAX_KNOWN:
                self._cache.popitem(last=False)
        return name

    def _spend_lookup(self, now: float) -> None:
        """Count a lookup of an unseen token against the window's ``lookups`` (the lock held)."""
        while self._asked and now - self._asked[0] >= self.window:
            self._asked.popleft()
        if len(self._asked) >= self.lookups:
            raise AuthFailure(HTTPStatus.SERVICE_UNAVAILABLE, "identity_busy",
                              f"more than {self.lookups} new tokens were checked in the last {self.window:.0f} s; "
                              "try again in a minute")
        self._asked.append(now)

    def _invalid(self) -> AuthFailure:
        return AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                           f"the Hugging Face Hub at {self.endpoint} does not recognise this token")

    def _remember_refusal(self, key: str) -> None:
        with self._lock:
            self._cache.pop(key, None)
            self._refused[key] = self.clock()
            self._refused.move_to_end(key)
            while len(self._refused) > MAX_REFUSED:
                self._refused.popitem(last=False)
