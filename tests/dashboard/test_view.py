"""The dashboard's JSON, built by pure functions from real specification states and real DHT record types."""

from __future__ import annotations

import pytest
from solders.keypair import Keypair

from client.dashboard.view import (
    checkpoint,
    contributor_map,
    key_text,
    leaderboard,
    occupancy,
    progress,
    snapshot,
    witnesses,
)
from client.pipeline.discovery import WorkerRecord
from coordinator_program.spec import derived, limits, rules
from coordinator_program.spec.bloom import build_filter
from coordinator_program.spec.config import Checkpoint, CheckpointKind
from coordinator_program.spec.state import LedgerEntry
from tests.spec.scenario import full_filter, ident, join_pipeline, new_run, start_training


def training_state():
    state = new_run()
    join_pipeline(state)
    now = start_training(state, 100)
    return state, now


def record(stage: str, sync_phase: int) -> WorkerRecord:
    return WorkerRecord(run_id="test-run", stage=stage, uid=f"{stage}.0.{sync_phase}", address="127.0.0.1:1",
                        sync_phase=sync_phase, load=0, throughput=1.0, model="m", pubkey="00" * 32, expires=0.0,
                        state="ready")


def test_progress_counts_down_the_phase_by_its_configured_duration() -> None:
    state, now = training_state()
    shown = progress(state, now + 7)
    assert (shown["phase"], shown["epoch"], shown["round"], shown["step"]) == ("RoundTrain", 0, 1, 0)
    assert (shown["phase_elapsed"], shown["phase_left"]) == (7, state.config.max_round_train_time - 7)
    assert progress(state, now + 10_000)["phase_left"] == 0
    waiting = new_run()
    assert (progress(waiting, 50)["phase_left"], progress(waiting, 50)["round"]) == (None, None)


def test_occupancy_splits_each_stage_by_the_sync_phase_its_workers_announce() -> None:
    state, _ = training_state()
    assert [(s["name"], s["members"], s["active"]) for s in occupancy(state, None)["stages"]] == [
        ("head", 1, None), ("body1", 1, None), ("tail", 1, None)]
    announced = {"head": [record("head", 0), record("head", 1)], "body1": [record("body1", 2)]}
    shown = occupancy(state, announced)
    assert [(s["active"], s["sync1"], s["sync2"]) for s in shown["stages"]] == [(1, 1, 0), (0, 0, 1), (0, 0, 0)]
    assert shown["trainers"] == 1


def test_witnesses_show_who_proved_the_round() -> None:
    state, _ = training_state()
    elected = derived.witnesses(state)
    shown = witnesses(state)
    assert [w["key"] for w in shown["elected"]] == [key_text(w) for w in elected]
    assert (shown["received"], shown["quorum"]) == (0, derived.quorum(state))
    rules.witness(state, elected[1], state.round.height, full_filter(state), build_filter(state.config, []))
    shown = witnesses(state)
    assert [w["proved"] for w in shown["elected"]] == [False, True, False] and shown["received"] == 1
    assert witnesses(new_run()) == {"elected": [], "received": 0, "quorum": None}


def test_the_checkpoint_names_each_stages_place() -> None:
    state, _ = training_state()
    state.checkpoints[:3] = [Checkpoint(CheckpointKind.Hub, "org/model", "epoch-1"), Checkpoint(CheckpointKind.P2P),
                             Checkpoint(CheckpointKind.Hub, "org/model", "epoch-1")]
    assert checkpoint(state) == {
        "stages": [{"stage": "head", "kind": "Hub", "repo": "org/model", "revision": "epoch-1"},
                   {"stage": "body1", "kind": "P2P", "repo": "", "revision": ""},
                   {"stage": "tail", "kind": "Hub", "repo": "org/model", "revision": "epoch-1"}],
        "text": "Hub hub:org/model@epoch-1: head, tail; from peers (P2P): body1 (2 of 3 stages saved)"}


def test_the_leaderboard_sums_a_contributors_keys_and_keeps_unknown_keys_apart() -> None:
    a1, a2, b, stranger = ident(1), ident(2), ident(3), ident(4)
    ledger = [LedgerEntry(a1, 3, 10), LedgerEntry(a2, 2, 5), LedgerEntry(b, 4, 40), LedgerEntry(stranger, 1, 0)]
    names = {key_text(a1): "alice", key_text(a2): "alice", key_text(b): "bob",
             key_text(ident(9)): key_text(stranger)}  # a name spelled like another's key absorbs nothing
    rows = leaderboard(ledger, names)
    assert [(r["name"], r["keys"], r["presence"], r["compute"], r["total"]) for r in rows] == [
        ("bob", 1, 4, 40, 44), ("alice", 2, 5, 15, 20), (key_text(stranger), 1, 1, 0, 1)]
    assert [r["contributor"] for r in rows] == [True, True, False]
    assert [r["name"] for r in leaderboard(ledger, {})] == [key_text(b), key_text(a1), key_text(a2),
                                                            key_text(stranger)]


def test_a_snapshot_of_a_real_state_is_plain_json() -> None:
    import json

    state, now = training_state()
    state.ledger = [LedgerEntry(ident(1), 1, 2)]
    view = snapshot(state, now, contributors={key_text(ident(1)): "<img src=x onerror=alert(1)>"})
    assert json.loads(json.dumps(view)) == view
    assert view["leaderboard"][0]["name"] == "<img src=x onerror=alert(1)>"  # the page writes it as text


@pytest.mark.parametrize(("answer", "fault"), [
    ([], "not a JSON object"),
    ({"not-a-key": "alice"}, "not a base58 public key"),
    ({str(Keypair().pubkey()): ""}, "1..96 characters"),
    ({str(Keypair().pubkey()): "x" * 97}, "1..96 characters"),
    ({str(Keypair().pubkey()): 7}, "1..96 characters"),
    ({str(Keypair().pubkey()): "a" for _ in range(4 * limits.MAX_CLIENTS + 1)},
     "more than a run can hold"),
])
def test_a_lying_auth_services_contributor_map_is_refused(answer, fault) -> None:
    with pytest.raises(ValueError, match=fault):
        contributor_map(answer)
