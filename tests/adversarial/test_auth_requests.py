"""Attacks on the auth service's signed requests, over real HTTP on loopback: replays, requests sent under
another token, timestamps that never go stale, and joiners that try to skip the join queue."""

from __future__ import annotations

import math
from typing import Any

import pytest
from solders.keypair import Keypair

from client.join.auth import AuthClient, AuthError
from local_backend.auth.protocol import canonical
from tests.join.test_auth import client, serving


def resigned(sender: AuthClient, action: str, signer: Keypair | None = None, **changes: Any) -> dict[str, Any]:
    """``sender``'s request for ``action`` with ``changes``, signed again (by ``signer`` if given)."""
    request = {k: v for k, v in sender._signed(action, **({"role": "worker"} if action == "join" else {})).items()
               if k != "signature"}
    request.update(changes)
    key = signer or sender.keypair
    return {**request, "signature": bytes(key.sign_message(canonical(request))).hex()}


def refused(sender: AuthClient, path: str, request: dict[str, Any], token: str | None = None) -> AuthError:
    method = "PUT" if path == "/api/join" else "POST"
    headers = {"Authorization": f"Bearer {token}"} if token else None
    with pytest.raises(AuthError) as caught:
        sender._call(method, path, request, headers=headers)
    return caught.value


def test_a_captured_join_is_refused_under_another_token_and_when_replayed(fake_hub) -> None:
    with serving(fake_hub) as server:
        victim = client(server, token="tok-alice")
        captured = victim._signed("join", role="worker")
        # bob replays alice's join under his own (valid) token, to tie alice's key to his identity
        stolen = refused(victim, "/api/join", captured, token="tok-bob")
        assert stolen.code == "token_mismatch" and "signed for another Hugging Face token" in str(stolen)
        assert server.service.occupancy()["slots"] == 0

        assert victim._call("PUT", "/api/join", captured, headers={"Authorization": "Bearer tok-alice"})["grant"]
        again = refused(victim, "/api/join", captured, token="tok-alice")
        assert again.code == "replayed_request" and "already used" in str(again)
        occupancy = server.service.occupancy()
        assert (occupancy["slots"], occupancy["contributors"]) == (1, 1)


def test_a_captured_leave_is_accepted_once(fake_hub) -> None:
    with serving(fake_hub) as server:
        victim = client(server)
        victim.join("tok-alice")
        captured = victim._signed("leave")
        assert victim._call("POST", "/api/leave", captured) == {"ok": True}
        rejoined = victim.join("tok-alice")

        replay = refused(victim, "/api/leave", captured)  # replayed to throw the victim out again
        assert replay.code == "replayed_request"
        assert server.service.occupancy()["slots"] == 1
        assert victim.join("tok-alice").slot == rejoined.slot  # still holds the slot it rejoined with


def test_requests_of_other_actions_are_bound_to_the_slots_token(fake_hub) -> None:
    with serving(fake_hub) as server:
        victim = client(server)
        victim.join("tok-alice")
        # a request signed by the victim's key but over another token's hash (e.g. an old token's)
        other = refused(victim, "/api/leave", resigned(victim, "leave", token_sha256="0" * 64))
        assert other.code == "token_mismatch"
        assert server.service.occupancy()["slots"] == 1


@pytest.mark.parametrize("stamp", [math.nan, 10 ** 400], ids=["nan", "beyond-any-float"])
def test_a_time_that_never_goes_stale_is_refused(fake_hub, stamp: Any) -> None:
    with serving(fake_hub) as server:
        joiner = client(server, token="tok-alice")
        refusal = refused(joiner, "/api/join", resigned(joiner, "join", time=stamp), token="tok-alice")
        assert refusal.code == "bad_request" and "time must be a finite number" in str(refusal)
        assert server.service.occupancy()["slots"] == 0


def test_no_joiner_skips_the_queue_or_moves_another(fake_hub) -> None:
    with serving(fake_hub, max_integrating=1) as server:
        first, second, third = client(server), client(server), client(server)
        first.join("tok-alice")
        second.join("tok-bob")
        third.join("tok-carol")
        assert first.queue_status().admitted

        # A waiting joiner reports itself synced, to be counted integrated and skip the queue.
        with pytest.raises(AuthError, match=r"still waiting in the join queue \(position 1\)") as caught:
            second.synced()
        assert caught.value.code == "not_admitted"
        # A stranger reports the integrating peer synced, to free the queue for itself: it cannot sign for it.
        forged = refused(third, "/api/synced", resigned(third, "synced", peer=first._signed("queue")["peer"]))
        assert forged.code == "bad_signature"
        with pytest.raises(AuthError, match=r"position 2"):
            third.synced()

        # Nothing moved: the first still integrates, the others wait in join order.
        assert [(s.position, s.admitted, s.integrating) for s in (first.queue_status(), second.queue_status(),
                                                                   third.queue_status())] == [
            (0, True, 1), (1, False, 1), (2, False, 1)]
        first.synced()  # only the admitted peer's own report frees the queue
        assert second.queue_status().admitted and not third.queue_status().admitted
        second.synced()
        assert third.queue_status().admitted
