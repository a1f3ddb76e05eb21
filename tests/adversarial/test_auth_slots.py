"""Attacks on the auth service's slots, over real HTTP on loopback: one token filling the swarm, and a
restart (the process killed) that would forget every contributor and every spent nonce."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.join.auth import AuthClient, AuthError
from local_backend.auth.identity import HubIdentity
from local_backend.auth.rules import AuthService
from local_backend.store import StoreError
from tests.join.test_auth import RUN, TOKENS, client, serving


def test_one_token_cannot_take_every_slot(fake_hub) -> None:
    with serving(fake_hub, capacity=8, max_slots_per_token=4) as server:
        alice = [client(server) for _ in range(8)]  # one contributor, a fresh keypair per process
        answers: list[object] = []
        for process in alice:
            try:
                answers.append(process.join("tok-alice"))
            except AuthError as exc:
                answers.append(exc)
        refusals = [a for a in answers[4:] if isinstance(a, AuthError)]
        assert not any(isinstance(a, AuthError) for a in answers[:4]) and len(refusals) == 4
        assert {r.code for r in refusals} == {"contributor_full"}
        assert str(refusals[0]).startswith("join rejected: alice already holds 4 slots in run run-1")
        assert "(max 4 per token)" in str(refusals[0])

        fake_hub.users["tok-alice-2"] = "alice"  # a second token of the same Hub user buys no more slots
        with pytest.raises(AuthError, match="alice already holds 4 slots"):
            client(server).join("tok-alice-2")
        bob = client(server).join("tok-bob")
        assert (bob.contributor, bob.peers_of_contributor) == ("bob", 1)
        occupancy = server.service.occupancy()
        assert (occupancy["slots"], occupancy["contributors"]) == (5, 2)

        alice[0].leave()  # a process of hers that leaves makes room for another of hers
        assert alice[4].join("tok-alice").peers_of_contributor == 4


def start_service(hub_url: str, db: Path) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "auth-service", "--run-id", RUN, "--stages", "3", "--capacity", "4",
         "--hf-endpoint", hub_url, "--db", str(db), "--server", "127.0.0.1:9"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_TOKEN": ""})
    line = process.stdout.readline()  # type: ignore[union-attr]
    if " listening on " not in line:
        process.kill()
        pytest.fail(f"the auth service did not start: {line}{process.communicate(timeout=30)[1]}")
    return process, line.split(" listening on ")[1].split()[0]


def test_slots_queue_and_spent_nonces_survive_a_killed_service(fake_hub, tmp_path) -> None:
    fake_hub.users.update(TOKENS)
    db = tmp_path / "auth.sqlite"
    alice, bob = Keypair(), Keypair()
    process, url = start_service(fake_hub.url, db)
    try:
        first = AuthClient(url, alice, RUN, timeout=10).join("tok-alice")
        AuthClient(url, bob, RUN, timeout=10).join("tok-bob")
        captured = AuthClient(url, alice, RUN, token="tok-alice")._signed("queue")
        assert AuthClient(url, alice, RUN)._call("POST", "/api/queue", captured)["admitted"]  # alice integrates
    finally:
        process.send_signal(signal.SIGKILL)  # no chance to save anything on the way out
        process.wait(timeout=30)

    process, url = start_service(fake_hub.url, db)
    try:
        with urllib.request.urlopen(f"{url}/api/occupancy", timeout=10) as answer:
            occupancy = json.loads(answer.read())
        assert (occupancy["slots"], occupancy["contributors"], occupancy["stages"]) == (2, 2, [1, 1, 0])
        again = AuthClient(url, alice, RUN, timeout=10).join("tok-alice")
        assert (again.slot, again.stage) == (first.slot, first.stage)
        queue = [AuthClient(url, key, RUN, token=token).queue_status() for key, token in
                 ((alice, "tok-alice"), (bob, "tok-bob"))]
        assert [(q.position, q.admitted) for q in queue] == [(0, True), (1, False)]  # the queue kept its order
        with pytest.raises(AuthError, match="already used") as caught:  # answered before the restart
            AuthClient(url, alice, RUN)._call("POST", "/api/queue", captured)
        assert caught.value.code == "replayed_request"
        assert AuthClient(url, Keypair(), RUN, timeout=10).join("tok-carol").slot == 2  # 0 and 1 are still held
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_database_of_another_run_is_refused(tmp_path) -> None:
    db = tmp_path / "auth.sqlite"
    AuthService(run_id=RUN, num_stages=3, capacity=3, identify=HubIdentity("http://127.0.0.1:9"),
                max_slots_per_token=4, db=db).close()
    with pytest.raises(StoreError, match="holds the auth service of run 'run-1', not 'other': use another --db"):
        AuthService(run_id="other", num_stages=3, capacity=3, identify=HubIdentity("http://127.0.0.1:9"),
                    max_slots_per_token=4, db=db)


def test_a_database_that_cannot_take_a_write_answers_503_and_loses_nothing(fake_hub, tmp_path) -> None:
    with serving(fake_hub, db=tmp_path / "auth.sqlite") as server:
        alice = client(server)
        held = alice.join("tok-alice")
        store = server.service._store
        store.db.execute("PRAGMA query_only = ON")  # as a full disk or a file turned read-only would
        try:
            with pytest.raises(AuthError, match="could not save the request; try again") as caught:
                client(server).join("tok-bob")
            assert caught.value.code == "storage_unavailable"
            with pytest.raises(AuthError) as caught:
                alice.leave()
            assert caught.value.code == "storage_unavailable"
        finally:
            store.db.execute("PRAGMA query_only = OFF")
        occupancy = server.service.occupancy()
        assert (occupancy["slots"], occupancy["contributors"]) == (1, 1)  # alice's slot is kept, bob's never was
        assert alice.join("tok-alice").slot == held.slot
        assert client(server).join("tok-bob").slot != held.slot
