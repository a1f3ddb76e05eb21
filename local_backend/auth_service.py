"""The run's auth service: a Hugging Face token in, a contributor slot and a stage out.

The token is used for identity only: the service asks the Hugging Face Hub who owns it (``whoami``, through
``huggingface_hub`` against a configurable endpoint) and never stores it. Every process started with the same
token is the same contributor: each process (each ed25519 peer key) holds its own slot, and all of them
count toward one identity. A join needs a free slot — a full swarm rejects it outright, there is no waiting
list — and gets the least occupied stage. Slots are leases: a client renews its slot by joining again, and a
slot not renewed within ``lease_seconds`` frees itself.

Pacing (the join queue): at most ``max_integrating`` admitted peers integrate (download state, sync) at once;
the others wait in join order, keeping their slots. A peer integrates until it reports it has synced, or for
``integration_seconds`` at most, so a joiner that crashed does not hold the queue.

Requests are JSON over HTTP. Every request is signed by the peer's ed25519 key over its canonical JSON with
a timestamp, which binds the slot to the key that asked for it; grants are signed by the service's key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from solders.keypair import Keypair

from client.identity import verify

log = logging.getLogger("psyswarm.auth")

MAX_REQUEST_BYTES = 16 * 1024
MAX_CLOCK_SKEW = 120.0  # seconds a signed request's timestamp may differ from the service's clock
ROLES = ("worker", "trainer")


class AuthFailure(Exception):
    """A refused request: an HTTP status, a stable error code clients switch on, and a message for people."""

    def __init__(self, status: HTTPStatus, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes a request or grant signature covers."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


# ----- identity ----------------------------------------------------------------------------------------


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

        key = hashlib.sha256(token.encode()).hexdigest()
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


# ----- slots, stages and the queue ----------------------------------------------------------------------


@dataclass
class Slot:
    peer: str  # hex ed25519 public key of the process holding the slot
    contributor: str  # the Hub user the token belongs to
    role: str
    stage: int  # -1 for a trainer
    index: int
    expires: float
    queued_at: float
    integrating_since: float | None = None
    synced: bool = False


@dataclass
class AuthService:
    """Slot, stage and queue bookkeeping for one run; thread-safe. ``identify`` maps a token to a user name."""

    run_id: str
    num_stages: int
    capacity: int
    identify: Callable[[str], str]
    keypair: Keypair = field(default_factory=Keypair)
    lease_seconds: float = 600.0
    max_integrating: int = 1
    integration_seconds: float = 900.0
    checkpoint: dict[str, str] | None = None
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if self.num_stages < 2 or self.capacity < 1 or self.lease_seconds <= 0 or self.max_integrating < 0:
            raise ValueError("need num_stages >= 2, capacity >= 1, lease_seconds > 0, max_integrating >= 0")
        self._slots: dict[str, Slot] = {}
        self._lock = threading.Lock()

    # --- requests ---

    def join(self, token: str, request: dict[str, Any]) -> dict[str, Any]:
        """Grant (or renew) the requesting peer's slot; the signed grant is the answer."""
        peer = self._verified(request, "join")
        role = request.get("role", "worker")
        if role not in ROLES:
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", f"role must be one of {ROLES}, not {role!r}")
        contributor = self.identify(token)  # outside the lock: it may call the Hub
        with self._lock:
            now = self.clock()
            self._expire(now)
            slot = self._slots.get(peer)
            if slot is not None and (slot.contributor != contributor or slot.role != role):
                raise AuthFailure(HTTPStatus.CONFLICT, "peer_taken",
                                  f"this peer key already holds a {slot.role} slot for another identity or role; "
                                  "use a separate keypair per process")
            if slot is None:
                if len(self._slots) >= self.capacity:
                    raise AuthFailure(HTTPStatus.SERVICE_UNAVAILABLE, "swarm_full",
                                      f"the swarm of run {self.run_id} is full: all {self.capacity} contributor "
                                      "slots are taken; try again later")
                slot = Slot(peer=peer, contributor=contributor, role=role,
                            stage=self._least_occupied_stage() if role == "worker" else -1,
                            index=self._free_index(), expires=0.0, queued_at=now)
                self._slots[peer] = slot
                log.info("granted slot %d to %s (%s, peer %s…), stage %d", slot.index, contributor, role,
                         peer[:8], slot.stage)
            slot.expires = now + self.lease_seconds
            grant = {
                "run_id": self.run_id, "contributor": contributor, "peer": peer, "role": role,
                "slot": slot.index, "capacity": self.capacity, "stage": slot.stage,
                "num_stages": self.num_stages, "expires": slot.expires,
                "peers_of_contributor": sum(s.contributor == contributor for s in self._slots.values()),
                "checkpoint": self.checkpoint,
            }
        signature = bytes(self.keypair.sign_message(canonical(grant))).hex()
        return {"grant": grant, "signature": signature, "service": bytes(self.keypair.pubkey()).hex()}

    def queue(self, request: dict[str, Any]) -> dict[str, Any]:
        """The peer's place in the join queue: 0 and ``admitted`` means go and sync now, 1 is next in line."""
        peer = self._verified(request, "queue")
        with self._lock:
            now = self.clock()
            self._expire(now)
            slot = self._held(peer)
            slot.expires = now + self.lease_seconds
            if self.max_integrating == 0 or slot.synced or slot.integrating_since is not None:
                return self._queue_answer(0, True)
            waiting = sorted((s for s in self._slots.values()
                              if not s.synced and s.integrating_since is None), key=lambda s: (s.queued_at, s.index))
            ahead = waiting.index(slot)
            if ahead == 0 and self._integrating() < self.max_integrating:
                slot.integrating_since = now
                return self._queue_answer(0, True)
            return self._queue_answer(ahead + 1, False)

    def synced(self, request: dict[str, Any]) -> dict[str, Any]:
        """The peer finished its sync phases: the next queued joiner may integrate."""
        peer = self._verified(request, "synced")
        with self._lock:
            slot = self._held(peer)
            slot.synced, slot.integrating_since = True, None
            slot.expires = self.clock() + self.lease_seconds
        return {"ok": True}

    def leave(self, request: dict[str, Any]) -> dict[str, Any]:
        peer = self._verified(request, "leave")
        with self._lock:
            self._slots.pop(peer, None)
        return {"ok": True}

    def occupancy(self) -> dict[str, Any]:
        """Live slots per stage and contributors (the dashboard's view); needs no authentication."""
        with self._lock:
            self._expire(self.clock())
            slots = list(self._slots.values())
        return {
            "run_id": self.run_id, "capacity": self.capacity, "slots": len(slots),
            "contributors": len({s.contributor for s in slots}),
            "stages": [sum(s.stage == i for s in slots) for i in range(self.num_stages)],
            "trainers": sum(s.role == "trainer" for s in slots),
        }

    # --- bookkeeping (under the lock) ---

    def _verified(self, request: dict[str, Any], action: str) -> str:
        """Check a signed request's fields, freshness and signature; returns the peer key (hex)."""
        if not isinstance(request, dict):
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", "the request body must be a JSON object")
        peer, signature, stamp = request.get("peer"), request.get("signature"), request.get("time")
        if request.get("run_id") != self.run_id:
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "wrong_run",
                              f"this auth service serves run {self.run_id!r}, not {request.get('run_id')!r}")
        if request.get("action") != action:
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", f"the request is not signed for {action!r}")
        if not (isinstance(peer, str) and isinstance(signature, str) and isinstance(stamp, int | float)):
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", "peer, time and signature are required")
        if abs(self.clock() - stamp) > MAX_CLOCK_SKEW:
            raise AuthFailure(HTTPStatus.BAD_REQUEST, "stale_request",
                              f"the request's time is over {MAX_CLOCK_SKEW:.0f} s off the service's clock; "
                              "check this machine's clock")
        unsigned = {k: v for k, v in request.items() if k != "signature"}
        try:
            valid = verify(bytes.fromhex(peer), canonical(unsigned), bytes.fromhex(signature))
        except ValueError:
            valid = False
        if not valid:
            raise AuthFailure(HTTPStatus.UNAUTHORIZED, "bad_signature", "the request's signature does not verify")
        return peer

    def _held(self, peer: str) -> Slot:
        slot = self._slots.get(peer)
        if slot is None:
            raise AuthFailure(HTTPStatus.NOT_FOUND, "no_slot", "this peer holds no slot (expired?): join again")
        return slot

    def _expire(self, now: float) -> None:
        for peer, slot in list(self._slots.items()):
            if slot.expires <= now:
                del self._slots[peer]
                log.info("slot %d of %s expired", slot.index, slot.contributor)
            elif slot.integrating_since is not None and now - slot.integrating_since > self.integration_seconds:
                slot.integrating_since, slot.synced = None, True  # gave it its time; stop holding the queue

    def _integrating(self) -> int:
        return sum(s.integrating_since is not None for s in self._slots.values())

    def _least_occupied_stage(self) -> int:
        counts = [0] * self.num_stages
        for slot in self._slots.values():
            if slot.stage >= 0:
                counts[slot.stage] += 1
        return counts.index(min(counts))

    def _free_index(self) -> int:
        taken = {s.index for s in self._slots.values()}
        return next(i for i in range(self.capacity) if i not in taken)

    def _queue_answer(self, position: int, admitted: bool) -> dict[str, Any]:
        return {"position": position, "admitted": admitted, "integrating": self._integrating(),
                "max_integrating": self.max_integrating}


# ----- HTTP ----------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: AuthHTTPServer
    protocol_version = "HTTP/1.1"

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/api/join":
            self._send(HTTPStatus.NOT_FOUND, {"error": "not_found", "message": f"no PUT {self.path}"})
            return
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        self._answer(lambda body: self.server.service.join(token, body) if token else _no_token())

    def do_POST(self) -> None:  # noqa: N802
        service = self.server.service
        actions = {"/api/queue": service.queue, "/api/synced": service.synced, "/api/leave": service.leave}
        action = actions.get(self.path)
        if action is None:
            self._send(HTTPStatus.NOT_FOUND, {"error": "not_found", "message": f"no POST {self.path}"})
            return
        self._answer(action)

    def do_GET(self) -> None:  # noqa: N802
        if self.path != "/api/occupancy":
            self._send(HTTPStatus.NOT_FOUND, {"error": "not_found", "message": f"no GET {self.path}"})
            return
        self._send(HTTPStatus.OK, self.server.service.occupancy())

    def _answer(self, action: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
            if not 0 < length <= MAX_REQUEST_BYTES:
                raise AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request",
                                  f"the body must be 1..{MAX_REQUEST_BYTES} bytes of JSON")
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise AuthFailure(HTTPStatus.BAD_REQUEST, "bad_request", "the body is not JSON") from None
            self._send(HTTPStatus.OK, action(body))
        except AuthFailure as failure:
            self._send(failure.status, {"error": failure.code, "message": failure.message})
        except Exception:  # a bug must answer 500 and keep the service up, never leave the client hanging
            log.exception("auth request %s failed", self.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal", "message": "internal error"})

    def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("%s %s", self.address_string(), format % args)


def _no_token() -> dict[str, Any]:
    raise AuthFailure(HTTPStatus.UNAUTHORIZED, "invalid_token",
                      "no Hugging Face token: send it as 'Authorization: Bearer <token>'")


class AuthHTTPServer(ThreadingHTTPServer):
    """The auth service over HTTP: PUT /api/join, POST /api/queue|synced|leave, GET /api/occupancy."""

    daemon_threads = True

    def __init__(self, service: AuthService, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.service = service

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> AuthHTTPServer:
        """Serve in a background thread (tests, embedding); ``shutdown()`` stops it."""
        threading.Thread(target=self.serve_forever, name="auth-service", daemon=True).start()
        return self
