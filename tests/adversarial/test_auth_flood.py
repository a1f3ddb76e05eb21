"""An outsider flooding the auth service (issue 21, attack 2), over real HTTP against the real service and its
SQLite store. The old service spent a nonce for every signed request before it looked anything up (a slot-less
leave was even answered ok), and past its nonce capacity raised a floor to the newest forgotten nonce: a flood
dated +115 s (inside the allowed skew) pushed the floor past real time, and every honest renewal, queue poll and
join was refused as stale. Now a request that can change nothing spends nothing, the nonces a token or an address
may hold are bounded (quotas, small here so the flood reaches them), and no floor exists: the honest contributors
are served during and after the flood, and the store stays bounded."""

from __future__ import annotations

import http.client
import json
import secrets
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

import pytest
from solders.keypair import Keypair

from client.join.auth import AuthClient, AuthError
from local_backend.auth.app import AuthHTTPServer
from local_backend.auth.identity import HubIdentity
from local_backend.auth.protocol import canonical, token_sha256
from tests.join.test_auth import RUN, client, serving

PER_TOKEN, PER_ADDRESS = 60, 150
FLOOD = 1200  # requests, more than both quotas many times over


def signed(keypair: Keypair, action: str, token: str, ahead: float, **fields: Any) -> dict[str, Any]:
    """A request as a client signs it, dated ``ahead`` seconds from now."""
    request = {"run_id": RUN, "action": action, "peer": bytes(keypair.pubkey()).hex(), "time": time.time() + ahead,
               "nonce": secrets.token_hex(16), "token_sha256": token_sha256(token), **fields}
    return {**request, "signature": bytes(keypair.sign_message(canonical(request))).hex()}


def send(server: AuthHTTPServer, method: str, path: str, body: dict[str, Any], token: str | None = None,
         source: str = "127.0.0.1") -> tuple[int, dict[str, Any]]:
    """One request from ``source`` (another loopback address is another client address)."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30, source_address=(source, 0))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        connection.request(method, path, json.dumps(body), headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def flood_request(server: AuthHTTPServer, i: int) -> int:
    """Mallory's: joins under her one valid token with a fresh key each, and slot-less leaves and queue polls
    under made-up tokens, all dated +115 s."""
    kind = i % 3
    if kind == 0:
        return send(server, "PUT", "/api/join", signed(Keypair(), "join", "tok-mallory", 115, role="worker"),
                    token="tok-mallory")[0]
    action = "leave" if kind == 1 else "queue"
    return send(server, "POST", f"/api/{action}", signed(Keypair(), action, secrets.token_hex(8), 115))[0]


def test_honest_requests_are_served_during_and_after_a_nonce_flood(fake_hub, tmp_path) -> None:
    fake_hub.users["tok-mallory"] = "mallory"
    db = tmp_path / "auth.sqlite"
    with serving(fake_hub, capacity=8, max_slots_per_token=2, db=db, nonces_per_token=PER_TOKEN,
                 nonces_per_address=PER_ADDRESS) as server:
        alice = client(server)
        alice.join("tok-alice")
        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(lambda i: flood_request(server, i), range(FLOOD // 2)))
            rest = pool.map(lambda i: flood_request(server, i), range(FLOOD // 2, FLOOD))
            during = []
            for _ in range(5):  # Alice polls and renews while the flood runs; Bob joins from his own address
                during.append(alice.queue_status().admitted)
                during.append(alice.join("tok-alice").contributor == "alice")
            bob = Keypair()
            status, answer = send(server, "PUT", "/api/join", signed(bob, "join", "tok-bob", 0, role="worker"),
                                  token="tok-bob", source="127.0.0.2")
            statuses += list(rest)
        assert all(during) and status == 200 and answer["grant"]["contributor"] == "bob", answer
        joins = statuses[::3]  # past her token's quota, Mallory's joins are refused before they spend anything
        assert joins.count(429) >= len(joins) - PER_TOKEN, joins
        # After the flood: Alice renews, polls and leaves; Carol joins.
        assert alice.join("tok-alice").contributor == "alice" and alice.queue_status().admitted
        assert AuthClient(server.url, Keypair(), RUN, timeout=10).join("tok-carol").contributor == "carol"
        alice.leave()
        with closing(sqlite3.connect(db)) as reader:
            (stored,) = reader.execute("SELECT COUNT(*) FROM nonces").fetchone()
        assert stored <= PER_TOKEN + PER_ADDRESS + 20, stored  # Mallory's flood left at most her quotas behind


def test_requests_that_can_change_nothing_spend_nothing(fake_hub, tmp_path) -> None:
    db = tmp_path / "auth.sqlite"
    with serving(fake_hub, db=db) as server:
        stranger = Keypair()
        assert send(server, "POST", "/api/leave", signed(stranger, "leave", "tok-x", 0)) == (200, {"ok": True})
        assert send(server, "POST", "/api/queue", signed(stranger, "queue", "tok-x", 0))[1]["error"] == "no_slot"
        with closing(sqlite3.connect(db)) as reader:
            assert reader.execute("SELECT COUNT(*) FROM nonces").fetchone() == (0,)


def test_a_request_signed_before_a_slot_was_granted_does_not_act_on_it(fake_hub) -> None:
    """A leave answered while the peer held no slot spent nothing; replayed once the peer holds a slot again, it
    must not end that slot."""
    with serving(fake_hub) as server:
        me = Keypair()
        captured = signed(me, "leave", "tok-alice", -1)
        assert send(server, "POST", "/api/leave", captured) == (200, {"ok": True})
        AuthClient(server.url, me, RUN, timeout=10).join("tok-alice")
        status, answer = send(server, "POST", "/api/leave", captured)
        assert (status, answer["error"]) == (400, "stale_request")
        assert server.service.occupancy()["slots"] == 1


def test_a_flood_of_made_up_tokens_never_stops_a_known_contributor_renewing(fake_hub) -> None:
    """Mallory sends joins under made-up tokens, enough to spend the Hub lookups of every window. The old service
    counted the re-check of a token it already knew (its cached answer ``ttl`` old, as it is at a renewal every few
    minutes) against the same bound, so Alice's renewals were refused ``identity_busy`` for as long as the flood
    lasted, until her lease lapsed. A known token is re-checked outside the bound, and still re-checked: once
    the Hub refuses it, it is refused here too."""
    hub_clock = [0.0]
    identity = HubIdentity(fake_hub.url, ttl=300.0, lookups=5, clock=lambda: hub_clock[0])
    with serving(fake_hub, identify=identity) as server:
        alice = client(server)
        alice.join("tok-alice")

        def flood() -> set[str]:
            codes = set()
            for _ in range(10):
                try:
                    client(server).join(secrets.token_hex(8))
                except AuthError as refusal:
                    codes.add(refusal.code)
            return codes

        for _ in range(3):  # a window's flood, then past the cache's ttl with the next window's flood at once
            hub_clock[0] += 301.0
            assert flood() == {"invalid_token", "identity_busy"}
            calls = fake_hub.whoami_calls
            assert alice.join("tok-alice").contributor == "alice"
            assert fake_hub.whoami_calls == calls + 1, "her token is re-checked with the Hub"
        with pytest.raises(AuthError) as busy:  # an unseen token waits for the next window
            client(server).join("tok-bob")
        assert busy.value.code == "identity_busy"
        del fake_hub.users["tok-alice"]  # she revokes her token
        hub_clock[0] += 301.0
        flood()
        with pytest.raises(AuthError, match="does not recognise this token"):
            alice.join("tok-alice")
