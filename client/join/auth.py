"""The client side of authorization and the join queue (steps 1 and 3 of the join flow).

``AuthClient.join`` exchanges the contributor's Hugging Face token for a contributor slot and a stage with the
run's auth service (``local_backend.auth``); ``wait_turn`` waits in the join queue, logging the
position once a minute, while the downloaded state stays in memory. Every request is signed with the
client's ed25519 identity over the run, the action, the sha256 of the token (never the token) and a fresh
nonce, which binds the slot to this process's key and token and makes a captured request useless to replay;
the grant comes back signed by the service.

The service's key is the run's join authority, and ``AuthSession`` signs like a keypair of it (``pubkey``,
``sign_message``): given to the coordinator backend as its authorizer, it has the service countersign the join
the backend is about to send, which the coordinator requires of a permissioned run.
"""

from __future__ import annotations

import http.client
import json
import logging
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from solders.keypair import Keypair
from solders.pubkey import Pubkey
from solders.signature import Signature

from client.identity import from_json, verify
from client.stages import stage_name
from local_backend.auth.protocol import NONCE_BYTES, canonical, token_sha256

log = logging.getLogger("psyswarm.auth")

QUEUE_LOG_PERIOD = 60.0
QUEUE_POLL = 2.0  # seconds between asks whether this process's turn to integrate has come


class AuthError(RuntimeError):
    """The join was refused or the service could not be asked; ``code`` is the service's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def resolve_token(flag: str | None = None) -> str:
    """The Hugging Face token: the flag, else ``HF_TOKEN``, else the huggingface_hub login."""
    if flag:
        return flag
    from huggingface_hub import get_token

    token = get_token()  # HF_TOKEN first, then the token saved by `hf auth login`
    if not token:
        raise AuthError("no_token", "no Hugging Face token: pass --hf-token, set HF_TOKEN, or log in with "
                                    "`hf auth login`")
    return token


@dataclass(frozen=True)
class Grant:
    """A contributor slot: who (the Hub user), which slot, which stage, until when; signed by the service."""

    run_id: str
    contributor: str
    peer: str
    role: str
    slot: int
    capacity: int
    stage: int  # -1 for a trainer
    num_stages: int
    expires: float
    peers_of_contributor: int
    checkpoint: dict[str, str] | None  # the Hub snapshot of the stages, if the run publishes one
    signature: str
    service: str

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Grant:
        try:
            fields = dict(answer["grant"])
            grant = cls(**fields, signature=answer["signature"], service=answer["service"])
        except (KeyError, TypeError, ValueError) as exc:
            raise AuthError("bad_answer", f"the auth service sent a malformed grant: {exc}") from None
        if not grant.verifies():
            raise AuthError("bad_answer", "the auth service's grant signature does not verify")
        return grant

    def fields(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("run_id", "contributor", "peer", "role", "slot", "capacity", "stage",
                                               "num_stages", "expires", "peers_of_contributor", "checkpoint")}

    def verifies(self) -> bool:
        try:
            return verify(bytes.fromhex(self.service), canonical(self.fields()), bytes.fromhex(self.signature))
        except ValueError:
            return False

    @property
    def stage_name(self) -> str:
        return "none (trainer)" if self.stage < 0 else stage_name(self.stage, self.num_stages)


def confirmation_line(grant: Grant) -> str:
    """The single log line that confirms the slot and the stage."""
    others = grant.peers_of_contributor - 1
    shared = f"; {others} other process(es) under this identity" if others else ""
    return (f"[AUTH] Authorized as {grant.contributor}: slot {grant.slot + 1} of {grant.capacity} in run "
            f"{grant.run_id}, stage {grant.stage_name}{shared}")


@dataclass(frozen=True)
class QueueStatus:
    position: int  # 0 once admitted, 1 when next in line
    admitted: bool
    integrating: int
    max_integrating: int


class AuthClient:
    """Talks to one run's auth service on behalf of one process (one keypair) and its token.

    The token is the one this process joins with: ``join`` sets it, and every later request is signed over
    its hash, as the service expects of the slot's holder.
    """

    def __init__(self, url: str, keypair: Keypair, run_id: str, *, timeout: float = 30.0,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.keypair = keypair
        self.run_id = run_id
        self.timeout = timeout
        self.token = token

    def join(self, token: str, role: str = "worker") -> Grant:
        """Ask for (or renew) this process's slot; ``AuthError`` says why a join is refused."""
        self.token = token
        answer = self._call("PUT", "/api/join", self._signed("join", role=role),
                            headers={"Authorization": f"Bearer {token}"})
        grant = Grant.from_answer(answer)
        if grant.peer != bytes(self.keypair.pubkey()).hex() or grant.run_id != self.run_id:
            raise AuthError("bad_answer", "the auth service granted a slot to another peer or run")
        return grant

    def queue_status(self) -> QueueStatus:
        answer = self._call("POST", "/api/queue", self._signed("queue"))
        try:
            return QueueStatus(int(answer["position"]), bool(answer["admitted"]), int(answer["integrating"]),
                               int(answer["max_integrating"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise AuthError("bad_answer", f"the auth service sent a malformed queue status: {exc}") from None

    def wait_turn(self, *, poll: float = 5.0, log_every: float = QUEUE_LOG_PERIOD,
                  say: Callable[[str], None] = log.info, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> None:
        """Wait in the join queue until this peer may integrate, saying its position once per ``log_every``."""
        last_said: float | None = None
        while True:
            status = self.queue_status()
            if status.admitted:
                if last_said is not None:
                    say("[QUEUE] Admitted: starting to synchronise with the swarm")
                return
            now = clock()
            if last_said is None or now - last_said >= log_every:
                say(f"[QUEUE] Position {status.position} in the join queue ({status.integrating} of "
                    f"{status.max_integrating} joins integrating); keeping the downloaded state")
                last_said = now
            sleep(poll)

    def synced(self) -> None:
        """Tell the service this peer finished its sync phases, freeing the queue for the next joiner."""
        self._call("POST", "/api/synced", self._signed("synced"))

    def leave(self) -> None:
        self._call("POST", "/api/leave", self._signed("leave"))

    def countersign(self, message: bytes, authority: Pubkey) -> Signature:
        """``authority``'s signature over ``message``, a join of this process's key (``AuthSession.sign_message``);
        ``AuthError`` when the service refuses it or answers with anything else."""
        answer = self._call("POST", "/api/countersign", self._signed("countersign", message=message.hex()))
        try:
            signature = Signature.from_bytes(bytes.fromhex(answer["signature"]))
        except (KeyError, TypeError, ValueError):
            signature = None
        if signature is None or not signature.verify(authority, message):
            raise AuthError("bad_answer", f"the auth service's countersignature does not verify under {authority}")
        return signature

    # ----- transport -----

    def _signed(self, action: str, **fields: Any) -> dict[str, Any]:
        if self.token is None:
            raise AuthError("no_slot", "join first: requests are signed over the hash of the token joined with")
        request = {"run_id": self.run_id, "action": action, "peer": bytes(self.keypair.pubkey()).hex(),
                   "time": time.time(), "nonce": secrets.token_hex(NONCE_BYTES),
                   "token_sha256": token_sha256(self.token), **fields}
        return {**request, "signature": bytes(self.keypair.sign_message(canonical(request))).hex()}

    def _call(self, method: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
              ) -> dict[str, Any]:
        data = json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return _json(response.read())
        except urllib.error.HTTPError as exc:
            answer = _json(exc.read(), strict=False)
            code = answer.get("error", f"http_{exc.code}")
            message = answer.get("message", f"the auth service answered HTTP {exc.code}")
            raise AuthError(code, _explain(code, message)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise AuthError("unreachable", f"cannot reach the auth service at {self.url}: {reason}") from None


@dataclass
class AuthSession:
    """A process's slot for the length of a run: renewed within its lease, left on exit."""

    client: AuthClient
    token: str
    grant: Grant

    @classmethod
    def open(cls, url: str, keypair: Keypair, run_id: str, token: str, role: str) -> AuthSession:
        client = AuthClient(url, keypair, run_id, token=token)
        return cls(client, token, client.join(token, role))

    @property
    def snapshot(self) -> tuple[str, str] | None:
        """The (Hub repo, revision) of the stage snapshots the service points joiners to, if any."""
        checkpoint = self.grant.checkpoint
        if not checkpoint or not checkpoint.get("repo"):
            return None
        return checkpoint["repo"], checkpoint.get("revision") or "main"

    def renew_every(self) -> float:
        """Seconds until the next renewal: a third of what is left of the lease, so two renewals may fail."""
        return max(5.0, (self.grant.expires - time.time()) / 3)

    def renew(self) -> Grant:
        self.grant = self.client.join(self.token, self.grant.role)
        return self.grant

    def wait_turn(self) -> None:
        """Wait in the join queue; pacing is advisory, so a service that stops answering does not hold the join
        of a process whose slot it already granted."""
        try:
            self.client.wait_turn(poll=QUEUE_POLL)
        except AuthError as exc:
            log.warning("the join queue cannot be asked (%s): integrating now", exc)

    def pubkey(self) -> Pubkey:
        """The join authority: the service's key, which signed the grant."""
        return Pubkey.from_bytes(bytes.fromhex(self.grant.service))

    def sign_message(self, message: bytes) -> Signature:
        """The service's countersignature over a join of this process (a TCP ``join_authorization``, or a Solana
        join_run transaction message), asked over HTTP: it blocks for up to the client's timeout."""
        return self.client.countersign(message, self.pubkey())

    def report_synced(self) -> None:
        """Free the join queue for the next joiner; a service that cannot be told is no reason to stop training
        (its integration timeout frees the queue anyway)."""
        try:
            self.client.synced()
        except AuthError as exc:
            log.warning("could not tell the auth service this client has synced: %s", exc)


def _json(data: bytes, *, strict: bool = True) -> dict[str, Any]:
    try:
        value = from_json(data)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    if strict:
        raise AuthError("bad_answer", "the auth service did not answer with a JSON object")
    return {}


def _explain(code: str, message: str) -> str:
    if code == "invalid_token":
        return f"the Hugging Face token was rejected: {message} (check --hf-token, HF_TOKEN or `hf auth login`)"
    if code in ("swarm_full", "contributor_full"):
        return f"join rejected: {message}"
    return message
