"""The auth service's contributor map (``GET /api/contributors?run_id=``), over real HTTP: every key started
under one token maps to that token's Hub user, and nothing about the tokens leaves."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from solders.keypair import Keypair

from client.join.auth import AuthError
from local_backend.auth.identity import HubIdentity
from tests.join.test_auth import RUN, TOKENS, client, serving


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_every_key_under_one_token_maps_to_its_contributor_and_no_token_leaves(fake_hub) -> None:
    with serving(fake_hub, capacity=5, max_integrating=0, publish_contributors=True) as server:
        alice = [Keypair() for _ in range(3)]
        for key in alice:
            client(server, key).join("tok-alice")
        bob = Keypair()
        client(server, bob).join("tok-bob")
        status, answer = get(f"{server.url}/api/contributors?run_id={RUN}")
        assert status == 200
        assert answer == {**{str(k.pubkey()): "alice" for k in alice}, str(bob.pubkey()): "bob"}
        served = json.dumps(answer)
        assert not any(token in served for token in TOKENS)
        assert "token" not in served and all(len(v) < 20 for v in answer.values())


def test_a_key_that_left_stays_mapped_and_another_run_gets_nothing(fake_hub) -> None:
    with serving(fake_hub, publish_contributors=True) as server:
        leaving = client(server)
        leaving.join("tok-alice")
        leaving.leave()  # its points outlive its slot: they still count for alice
        assert get(f"{server.url}/api/contributors?run_id={RUN}") == (200, {str(leaving.keypair.pubkey()): "alice"})
        assert get(f"{server.url}/api/contributors?run_id=another-run") == (200, {})


def test_the_map_keeps_only_the_keys_granted_last_and_survives_a_restart(fake_hub, tmp_path) -> None:
    keys = [Keypair() for _ in range(4)]
    with serving(fake_hub, db=tmp_path / "auth.sqlite", capacity=2, grants_kept=2, max_integrating=0) as server:
        for key in keys:  # each leaves, so that the next one finds a free slot
            me = client(server, key)
            me.join("tok-bob")
            me.leave()
    with serving(fake_hub, db=tmp_path / "auth.sqlite", capacity=2, grants_kept=2,
                 publish_contributors=True) as server:
        assert get(f"{server.url}/api/contributors?run_id={RUN}") == (
            200, {str(keys[2].pubkey()): "bob", str(keys[3].pubkey()): "bob"})


def test_a_query_without_exactly_one_run_id_is_a_bad_request(fake_hub) -> None:
    with serving(fake_hub) as server:
        for query in ("", "?run_id=a&run_id=b", "?" + "&".join(f"x{i}=1" for i in range(50))):
            status, answer = get(f"{server.url}/api/contributors{query}")
            assert (status, answer["error"]) == (400, "bad_request"), query
            assert "run_id" in answer["message"]


def test_the_map_is_private_unless_its_operator_publishes_it(fake_hub) -> None:
    """Issue 21, attack 7: the map tied every key to a Hub user name for anyone who asked."""
    with serving(fake_hub) as server:
        client(server).join("tok-alice")
        status, answer = get(f"{server.url}/api/contributors?run_id={RUN}")
        assert (status, answer["error"]) == (403, "contributors_private") and "alice" not in json.dumps(answer)
        assert "--publish-contributors" in answer["message"]


def test_made_up_tokens_cost_the_hub_a_bounded_number_of_calls(fake_hub) -> None:
    """Issue 21, attack 7: every join with a random token cost one Hub whoami call. Refusals are cached and unseen
    tokens are looked up at most ``lookups`` times a window; a known contributor is still served from the cache."""
    with serving(fake_hub, identify=HubIdentity(fake_hub.url, lookups=5)) as server:
        alice = client(server)
        alice.join("tok-alice")
        calls = fake_hub.whoami_calls
        codes = []
        for token in [f"made-up-{i}" for i in range(40)] + ["made-up-0"] * 10:
            try:
                client(server).join(token)
            except AuthError as refusal:
                codes.append(refusal.code)
        assert fake_hub.whoami_calls - calls <= 4  # the window's 5 lookups, one spent on alice
        assert set(codes) == {"invalid_token", "identity_busy"} and len(codes) == 50
        assert alice.join("tok-alice").contributor == "alice"
