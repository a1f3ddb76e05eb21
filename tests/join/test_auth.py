"""Authorization and the join queue: a Hugging Face token for a contributor slot and a stage.

The service asks a local stand-in for the Hub (``fake_hub``) who owns a token, through huggingface_hub.
``serving`` and ``client`` are shared with the attacks on the service (tests/adversarial/test_auth_*.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from solders.keypair import Keypair

from client.identity import load_keypair
from client.join.auth import AuthClient, AuthError, Grant, confirmation_line, resolve_token
from local_backend.auth.app import AuthHTTPServer
from local_backend.auth.failures import AuthFailure
from local_backend.auth.identity import HubIdentity
from local_backend.auth.rules import AuthService
from local_backend.web.limits import WebLimits
from tests.fake_hub import FakeHub

RUN = "run-1"
TOKENS = {"tok-alice": "alice", "tok-bob": "bob", "tok-carol": "carol", "tok-dave": "dave"}


@contextmanager
def serving(hub: FakeHub, *, limits: WebLimits = WebLimits(), **settings: Any) -> Iterator[AuthHTTPServer]:
    """A real auth service on loopback (3 stages, 3 slots, a join queue of 1 unless ``settings`` say else)."""
    hub.users.update(TOKENS)
    service = AuthService(**{"run_id": RUN, "num_stages": 3, "capacity": 3, "identify": HubIdentity(hub.url),
                             "max_slots_per_token": 4, "db": ":memory:", "max_integrating": 1,
                             "tells_coordinator": False, **settings})
    server = AuthHTTPServer(service, limits=limits).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        service.close()


@pytest.fixture
def service(fake_hub) -> Iterator[AuthHTTPServer]:
    with serving(fake_hub, checkpoint={"repo": "swarm/run-1", "revision": "epoch-2"}) as server:
        yield server


def client(server: AuthHTTPServer, keypair: Keypair | None = None, token: str | None = None) -> AuthClient:
    return AuthClient(server.url, keypair or Keypair(), RUN, timeout=10, token=token)


def test_a_good_token_gets_a_signed_slot_and_stage(service: AuthHTTPServer) -> None:
    me = client(service)
    grant = me.join("tok-alice")
    assert (grant.contributor, grant.slot, grant.stage, grant.stage_name, grant.capacity) == ("alice", 0, 0, "head", 3)
    assert grant.verifies() and grant.checkpoint == {"repo": "swarm/run-1", "revision": "epoch-2"}
    assert confirmation_line(grant) == "[AUTH] Authorized as alice: slot 1 of 3 in run run-1, stage head"
    again = me.join("tok-alice")  # renewing keeps the slot and the stage
    assert (again.slot, again.stage) == (0, 0) and again.expires >= grant.expires
    assert service.service.occupancy()["slots"] == 1


def test_a_tampered_grant_is_refused(service: AuthHTTPServer) -> None:
    answer = service.service.join("tok-alice", client(service, token="tok-alice")._signed("join", role="worker"))
    assert Grant.from_answer(answer).stage == 0
    answer["grant"]["stage"] = 2  # a man in the middle moving the joiner to another stage
    with pytest.raises(AuthError, match="signature does not verify"):
        Grant.from_answer(answer)


def test_a_bad_token_is_rejected_clearly_and_takes_no_slot(service: AuthHTTPServer) -> None:
    with pytest.raises(AuthError, match="Hugging Face token was rejected.*HF_TOKEN") as caught:
        client(service).join("tok-mallory")
    assert caught.value.code == "invalid_token"
    assert service.service.occupancy()["slots"] == 0


def test_a_full_swarm_rejects_the_join(service: AuthHTTPServer) -> None:
    members = [client(service) for _ in range(3)]
    grants = [m.join(token) for m, token in zip(members, ("tok-alice", "tok-bob", "tok-carol"), strict=True)]
    assert [g.stage for g in grants] == [0, 1, 2]  # each to the least occupied stage
    with pytest.raises(AuthError, match="join rejected: the swarm of run run-1 is full: all 3") as caught:
        client(service).join("tok-dave")
    assert caught.value.code == "swarm_full"
    with pytest.raises(AuthError, match="is full"):
        client(service).join("tok-alice")  # another process of a member needs a slot of its own too
    assert service.service.occupancy()["slots"] == 3
    members[1].leave()
    late = client(service).join("tok-dave")
    assert (late.slot, late.stage) == (1, 1)  # the freed slot, in the stage that emptied


def test_a_slot_frees_itself_when_its_lease_ends() -> None:
    now = [time.time()]
    service = AuthService(run_id=RUN, num_stages=2, capacity=1, identify=lambda token: "alice",
                          max_slots_per_token=4, db=":memory:", lease_seconds=60, clock=lambda: now[0],
                          tells_coordinator=False)

    def request() -> dict:
        return AuthClient("http://unused", Keypair(), RUN, token="tok")._signed("join", role="worker")

    service.join("tok", request())
    with pytest.raises(AuthFailure, match="is full"):
        service.join("tok", request())
    now[0] += 61
    assert service.occupancy()["slots"] == 0
    assert service.join("tok", request())["grant"]["slot"] == 0


def test_two_processes_with_one_token_are_one_contributor(service: AuthHTTPServer) -> None:
    code = (
        "import json, sys; from solders.keypair import Keypair; from client.join.auth import AuthClient;"
        "g = AuthClient(sys.argv[1], Keypair(), 'run-1').join('tok-alice');"
        "print(json.dumps({'contributor': g.contributor, 'slot': g.slot, 'peer': g.peer, 'stage': g.stage}))"
    )
    outputs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code, service.url], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "HF_TOKEN": ""})
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert [o["contributor"] for o in outputs] == ["alice", "alice"]
    assert outputs[0]["peer"] != outputs[1]["peer"] and {o["slot"] for o in outputs} == {0, 1}
    assert {o["stage"] for o in outputs} == {0, 1}
    occupancy = service.service.occupancy()
    assert (occupancy["slots"], occupancy["contributors"]) == (2, 1)
    third = client(service).join("tok-alice")
    assert third.peers_of_contributor == 3
    assert confirmation_line(third).endswith("; 2 other process(es) under this identity")


def test_forged_stale_and_malformed_requests_are_refused(service: AuthHTTPServer) -> None:
    me = client(service, token="tok-alice")
    request = me._signed("join", role="worker")
    forged = {**request, "peer": bytes(Keypair().pubkey()).hex()}  # someone else's key: signature fails
    with pytest.raises(AuthError, match="signature does not verify"):
        me._call("PUT", "/api/join", forged, headers={"Authorization": "Bearer tok-alice"})
    stale = {**request, "time": time.time() - 3600}
    with pytest.raises(AuthError, match="clock"):
        me._call("PUT", "/api/join", stale, headers={"Authorization": "Bearer tok-alice"})
    with pytest.raises(AuthError, match="join first"):
        client(service).queue_status()  # a client signs over the hash of the token it joined with
    with pytest.raises(AuthError, match="serves run 'run-1', not 'other'"):
        AuthClient(service.url, Keypair(), "other").join("tok-alice")
    with pytest.raises(AuthError, match="no Hugging Face token"):
        me._call("PUT", "/api/join", request)
    for body, reason in ((b"{not json", "not JSON"), (b'{"run_id": "\xff"}', "not JSON"),
                         (b"[1, 2]", "must be a JSON object"), (b"", "must be 1..16384 bytes")):
        raw = urllib.request.Request(f"{service.url}/api/join", data=body, method="PUT",
                                     headers={"Authorization": "Bearer tok-alice"})
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(raw, timeout=10)
        answer = json.loads(caught.value.read())
        assert (caught.value.code, answer["error"], reason in answer["message"]) == (400, "bad_request", True)
    assert service.service.occupancy()["slots"] == 0  # nothing above took a slot


def test_an_unreachable_hub_or_service_is_a_clear_error(fake_hub) -> None:
    identity = HubIdentity("http://127.0.0.1:9")
    with pytest.raises(AuthFailure, match="cannot reach the Hugging Face Hub at http://127.0.0.1:9"):
        identity("tok")
    with pytest.raises(AuthError, match="cannot reach the auth service at http://127.0.0.1:9") as caught:
        AuthClient("http://127.0.0.1:9", Keypair(), RUN, timeout=5).join("tok")
    assert caught.value.code == "unreachable"


def test_whoami_answers_are_cached(fake_hub) -> None:
    fake_hub.users["tok-alice"] = "alice"
    identity = HubIdentity(fake_hub.url, ttl=60)
    assert [identity("tok-alice") for _ in range(3)] == ["alice"] * 3
    assert fake_hub.whoami_calls == 1


@pytest.mark.parametrize("name", ["a" * 97, "x" * 100_000, "x--y", "-x", "team/x", "ülrich", "a b", "a\nb"],
                         ids=["97", "100000", "double dash", "leading dash", "slash", "non-ascii", "space", "newline"])
def test_a_hub_user_name_outside_the_hub_s_own_rule_is_refused(service: AuthHTTPServer, fake_hub, name) -> None:
    """A Hub (``--hf-endpoint``) that answers whoami with a name no Hub user can have (too long: the Hub's
    namespaces are 1-96 characters; or characters a namespace never holds): the join is refused with a reason
    naming the length and the rule, and takes no slot; a 96-character name is a user's."""
    fake_hub.users["tok-odd"] = name
    with pytest.raises(AuthError, match=f"{len(name)} characters.*not a Hub user name") as caught:
        client(service).join("tok-odd")
    assert caught.value.code == "identity_unavailable" and len(str(caught.value)) < 400
    assert service.service.occupancy()["slots"] == 0
    fake_hub.users["tok-long"] = "a" * 96
    assert client(service).join("tok-long").contributor == "a" * 96


def test_the_queue_paces_joins_and_logs_the_position_once_a_minute(service: AuthHTTPServer) -> None:
    first, second = client(service), client(service)
    first.join("tok-alice")
    second.join("tok-bob")
    assert first.queue_status().admitted
    status = second.queue_status()
    assert (status.position, status.admitted, status.integrating) == (1, False, 1)

    said: list[str] = []
    clock = [0.0]
    polls = [0]

    def sleep(seconds: float) -> None:  # 20 s per poll; the first joiner finishes its sync at 140 s
        clock[0] += seconds
        polls[0] += 1
        if polls[0] == 7:
            first.synced()

    second.wait_turn(poll=20.0, say=said.append, clock=lambda: clock[0], sleep=sleep)
    queue_line = "[QUEUE] Position 1 in the join queue (1 of 1 joins integrating); keeping the downloaded state"
    # Said at 0, 60 and 120 s (not at every poll), then admitted at 140 s.
    assert said == [queue_line, queue_line, queue_line, "[QUEUE] Admitted: starting to synchronise with the swarm"]
    assert second.queue_status().admitted


def test_the_token_comes_from_the_flag_then_hf_token(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no stored login
    monkeypatch.setenv("HF_TOKEN", "tok-env")
    assert resolve_token("tok-flag") == "tok-flag"
    assert resolve_token(None) == "tok-env"
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(AuthError, match="pass --hf-token, set HF_TOKEN"):
        resolve_token(None)


@pytest.mark.slow
def test_the_auth_service_command_serves_joins(fake_hub, tmp_path) -> None:
    fake_hub.users["tok-alice"] = "alice"
    usage = subprocess.run([sys.executable, "-m", "client.cli", "auth-service", "--help"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "--max-slots-per-token" in usage and "[default: 4; x>=1]" in usage, usage
    process = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "auth-service", "--run-id", RUN, "--stages", "4", "--capacity", "2",
         "--hf-endpoint", fake_hub.url, "--db", str(tmp_path / "auth.sqlite"), "--server", "127.0.0.1:9"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert "auth service for run run-1 listening on http://127.0.0.1:" in line, line
        assert "at most 4 per contributor" in line and f"slots kept in {tmp_path / 'auth.sqlite'}" in line, line
        url = line.split("listening on ")[1].split()[0]
        grant = AuthClient(url, Keypair(), RUN).join("tok-alice")
        assert (grant.contributor, grant.num_stages, grant.capacity) == ("alice", 4, 2)
        # Its key is the run's join authority: kept next to --db (a restart keeps it), printed for serve/create-run.
        authority = load_keypair(tmp_path / "auth.join-authority.json").pubkey()
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert f"join authority {authority}" in line and f"--join-authority {authority}" in line, line
        assert grant.service == bytes(authority).hex()
    finally:
        process.terminate()
        process.wait(timeout=30)
