"""A server restarted with an edited state.toml: the coordinator's rules change when no epoch holds clients, and a
change to what the parameters were built from is refused with the difference named (the real server, SQLite
store and, for the command line, real processes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.backends.tcp import TcpBackend
from coordinator_program.spec import rules
from coordinator_program.spec.config import RunSpec, parse_run_spec
from coordinator_program.spec.instructions import SetPaused, Update, decode_instruction
from coordinator_program.spec.state import Phase, decode_state, encode_state
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore, StoreError
from tests.local_backend.test_persistence import free_port, start_server
from tests.local_backend.test_server import pipeline

TABLES = {
    "run_id": "reconf",
    "config": {"min_clients": 4, "max_clients": 8, "warmup_time": 1, "max_round_train_time": 30,
               "round_witness_time": 1, "cooldown_time": 1, "rounds_per_epoch": 10},
    "model": {"n_layers": 3, "d_model": 16, "n_heads": 2, "seq_len": 8},
}
SPEC = parse_run_spec(TABLES)


def edited(config: dict | None = None, model: dict | None = None) -> RunSpec:
    return parse_run_spec({**TABLES, "config": {**TABLES["config"], **(config or {})},
                           "model": {**TABLES["model"], **(model or {})}})


class Clock:
    """The server's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def server(tmp_path: Path, spec: RunSpec, authority: Keypair, clock: Clock = Clock()) -> CoordinatorServer:
    return CoordinatorServer(spec, RunStore(tmp_path / "run.sqlite"), authority, clock,
                             join_authority=rules.NO_AUTHORITY)


def stored(tmp_path: Path):
    store = RunStore(tmp_path / "run.sqlite")
    try:
        return decode_state(store.load("reconf")), store.operations()
    finally:
        store.close()


def test_changed_rules_apply_at_once_while_the_run_waits_for_members(tmp_path: Path) -> None:
    authority = Keypair()
    asyncio.run(server(tmp_path, SPEC, authority).stop())
    before, _ = stored(tmp_path)
    assert before.phase == Phase.WaitingForMembers and before.config.rounds_per_epoch == 10

    new = edited({"rounds_per_epoch": 5, "max_round_train_time": 20})
    restarted = server(tmp_path, new, authority)
    asyncio.run(restarted.stop())
    after, log = stored(tmp_path)
    assert after.config == new.config and after.phase == Phase.WaitingForMembers and not after.pause_requested
    assert after.model == before.model and after.epoch == before.epoch
    assert any(isinstance(decode_instruction(row[2]), Update) and decode_instruction(row[2]).config == new.config
               for row in log), "the change is in the run's log, as the update rule the authority could send"


def test_an_operators_pause_survives_a_config_change(tmp_path: Path) -> None:
    authority = Keypair()
    first = server(tmp_path, SPEC, authority)

    async def pause() -> None:
        await first.submit(bytes(authority.pubkey()), SetPaused(True).encode())
        await first.stop()

    asyncio.run(pause())
    assert stored(tmp_path)[0].phase == Phase.Paused
    asyncio.run(server(tmp_path, edited({"total_steps": 50}), authority).stop())
    after, _ = stored(tmp_path)
    assert after.phase == Phase.Paused and after.pause_requested and after.config.total_steps == 50


def test_changed_rules_wait_for_the_epoch_to_end(tmp_path: Path) -> None:
    """A run restarted mid-epoch keeps its rules until the epoch's clients are gone, then takes the new ones."""
    authority, clock = Keypair(), Clock()

    async def fill() -> None:
        first = server(tmp_path, SPEC, authority, clock)
        port = await first.start(port=0)
        clients = await pipeline(f"127.0.0.1:{port}")
        await clients[0].wait_for(lambda s: s.phase == Phase.Warmup, 10)
        await first.stop()  # the clients stay in the epoch, as after a crash
        for c in clients:
            await c.close()

    asyncio.run(fill())
    new = edited({"rounds_per_epoch": 5})

    async def resume() -> None:
        restarted = server(tmp_path, new, authority, clock)
        assert restarted.state.phase == Phase.Warmup
        assert restarted.state.config == SPEC.config, "an epoch in flight keeps the rules it started with"
        seen = []
        for _ in range(20):  # warmup ends, the unproven round empties the epoch, cooldown, waiting for members
            clock.now += 60
            await restarted.tick_once()
            seen.append((restarted.state.phase, restarted.state.config.rounds_per_epoch))
            if restarted.state.config == new.config:
                break
        await restarted.stop()
        assert (Phase.RoundTrain, 10) in seen and seen[-1] == (Phase.WaitingForMembers, 5), seen

    asyncio.run(resume())
    assert stored(tmp_path)[0].config == new.config, "the change is stored"


@pytest.mark.parametrize(("change", "named"), [
    ({"model": {"n_layers": 4}}, "model.n_layers: 3 -> 4"),
    ({"model": {"dataset": "other"}}, "model.dataset: 'stdlib' -> 'other'"),
    ({"config": {"num_stages": 2, "min_clients": 3}}, "config.num_stages: 3 -> 2"),
])
def test_a_change_to_what_the_parameters_were_built_from_is_refused(tmp_path: Path, change, named) -> None:
    authority = Keypair()
    asyncio.run(server(tmp_path, SPEC, authority).stop())
    before = stored(tmp_path)
    with pytest.raises(StoreError, match=named.replace("(", r"\(")):
        server(tmp_path, edited(change.get("config"), change.get("model")), authority)
    assert stored(tmp_path) == before, "a refused restart changes nothing"


def test_a_finished_runs_rules_are_fixed(tmp_path: Path) -> None:
    authority = Keypair()
    asyncio.run(server(tmp_path, SPEC, authority).stop())
    store = RunStore(tmp_path / "run.sqlite")
    state = decode_state(store.load("reconf"))
    state.phase, state.nonce = Phase.Finished, state.nonce + 1  # as the last epoch's cooldown leaves it
    store.save("reconf", state.nonce, encode_state(state), bytes(32), b"test: the run finished")
    store.close()
    with pytest.raises(StoreError, match="finished.*config.total_steps: 100 -> 200"):
        server(tmp_path, edited({"total_steps": 200}), authority)


def test_serve_restarted_with_an_edited_state_toml_reports_and_applies_it(tmp_path: Path) -> None:
    """The issue's case, with the command line: rounds_per_epoch 10 -> 5 while the run waits for members."""
    config, db, port = tmp_path / "state.toml", tmp_path / "run.sqlite", free_port()
    toml = ('run_id = "reconf"\n[config]\nmin_clients = 4\nrounds_per_epoch = 10\n'
            '[model]\nn_layers = 3\nd_model = 16\nn_heads = 2\nseq_len = 8\n')
    config.write_text(toml)
    proc = start_server(config, db, port)
    proc.terminate()
    proc.wait(10)
    config.write_text(toml.replace("rounds_per_epoch = 10", "rounds_per_epoch = 5"))
    proc = start_server(config, db, port)
    try:
        async def read() -> int:
            watcher = TcpBackend(f"127.0.0.1:{port}", Keypair())
            await watcher.connect()
            try:
                return watcher.state.config.rounds_per_epoch
            finally:
                await watcher.close()

        assert asyncio.run(read()) == 5
    finally:
        proc.terminate()
        out = proc.startup_log + proc.communicate(timeout=10)[0].decode()
    assert "config.rounds_per_epoch: 10 -> 5" in out and "applied now" in out, out

    config.write_text(toml.replace("n_layers = 3", "n_layers = 4"))
    refused = subprocess.run([sys.executable, "-m", "client.cli", "serve", "--config", str(config), "--db", str(db),
                              "--port", str(port), "--permissionless"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "model.n_layers: 3 -> 4" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
