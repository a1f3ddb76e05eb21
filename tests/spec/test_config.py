"""Run configs: every rule names its field, state.toml errors are clear, and the parser survives fuzzing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from client.cli import app
from coordinator_program.spec import rules
from coordinator_program.spec.config import (
    Checkpoint,
    CheckpointKind,
    Config,
    GradAveraging,
    GradValues,
    Model,
    Schedule,
    Tokenizer,
    WireCodec,
    load_run_spec,
    parse_run_spec,
    validate_config,
    validate_model,
)
from coordinator_program.spec.errors import InvalidConfig
from coordinator_program.spec.filter_sizing import bloom_params, largest_max_clients
from coordinator_program.spec.state import ACCOUNT_SIZE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "state.toml"
GOOD = Config()


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("num_stages", 1, "between 2 and 16"),
    ("num_stages", 17, "between 2 and 16"),
    ("max_clients", 0, "between 1 and 1024"),
    ("max_clients", 1025, "between 1 and 1024"),
    ("min_clients", 3, "num_stages + 1"),
    ("min_clients", 65, "must not exceed max_clients"),
    ("witness_nodes", 0, "between 1 and 32"),
    ("witness_nodes", 33, "between 1 and 32"),
    ("witness_nodes", 5, "must not exceed min_clients"),
    ("witness_quorum", 0, "strict majority of the 3 witness_nodes, at least 2 and at most 3"),
    ("witness_quorum", 1, "strict majority of the 3 witness_nodes, at least 2 and at most 3"),
    ("witness_quorum", 4, "strict majority of the 3 witness_nodes, at least 2 and at most 3"),
    ("warmup_time", 0, "at least 1"),
    ("max_round_train_time", 0, "at least 1"),
    ("round_witness_time", 0, "at least 1"),
    ("cooldown_time", 0, "at least 1"),
    ("rounds_per_epoch", 0, "at least 1"),
    ("total_steps", 0, "at least 1"),
    ("global_batch_size", 0, "at least 1"),
    ("bloom_slices", 10, "SHA-256"),
    ("bloom_slices", 17, "SHA-256"),
    ("bloom_bits_per_slice", 0, "between 1 and 32767"),
    ("bloom_bits_per_slice", 400, "exceeds 480"),
])
def test_config_rule_names_the_field(field: str, value: int, fragment: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        validate_config(dataclasses.replace(GOOD, **{field: value}))
    assert info.value.detail.startswith(f"{field}:") and fragment in info.value.detail


@pytest.mark.parametrize(("nodes", "quorum"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (32, 17), (32, 32)])
def test_every_strict_majority_quorum_is_accepted(nodes: int, quorum: int) -> None:
    validate_config(dataclasses.replace(GOOD, min_clients=32, witness_nodes=nodes, witness_quorum=quorum))


@pytest.mark.parametrize(("nodes", "quorum"), [(2, 1), (4, 2), (32, 16)])
def test_a_quorum_of_half_the_witnesses_is_refused(nodes: int, quorum: int) -> None:
    """Half is not enough: that many lying witnesses would match the honest ones proof for proof."""
    with pytest.raises(InvalidConfig, match="witness_quorum: must be a strict majority"):
        validate_config(dataclasses.replace(GOOD, min_clients=32, witness_nodes=nodes, witness_quorum=quorum))


@pytest.mark.parametrize(("field", "value"), [
    ("n_layers", 2), ("n_heads", 0), ("d_model", 130), ("seq_len", 1), ("microbatch_size", 0),
    ("learning_rate_micros", 0), ("sparta_every", 0), ("sparta_partitions", 0), ("dataset", ""),
    ("dataset", "caf\u00e9"),
])
def test_model_rule_names_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidConfig, match=f"^InvalidConfig: {field}:"):
        validate_model(dataclasses.replace(Model(), **{field: value}), GOOD)


def test_example_state_toml_loads() -> None:
    spec = load_run_spec(EXAMPLE)
    assert spec.run_id == "demo" and spec.config.num_stages == 3
    assert spec.model.learning_rate_micros == 1000
    # The participant filter is sized for 2 keys per client (presence and compute) of its 16 clients.
    assert (spec.config.bloom_slices, spec.config.bloom_bits_per_slice) == bloom_params(32, 0.0009) == (11, 43)


@pytest.mark.parametrize(("doc", "fragment"), [
    ({"run_id": "x y"}, "run_id"),
    ({"run_id": "ok", "extra": 1}, "extra: unknown top-level key"),
    ({"run_id": "ok", "config": {"min_client": 4}}, "did you mean 'min_clients'"),
    ({"run_id": "ok", "config": {"min_clients": "4"}}, "min_clients: must be an integer"),
    ({"run_id": "ok", "config": {"bloom_slices": 12}}, "bloom_slices: unknown key"),
    ({"run_id": "ok", "config": {"bloom_error_rate": 0.01}}, "between 2^-16 and 2^-10"),
    ({"run_id": "ok", "config": {"bloom_error_rate": 2}}, "bloom_error_rate: must be between 0 and 1"),
    ({"run_id": "ok", "config": 3}, "[config] must be a table"),
    ({"run_id": "ok", "model": {"learning_rate": 1e-9}}, "learning_rate"),
    ({"run_id": "ok", "model": {"dataset": 5}}, "dataset: must be a string"),
    ({"run_id": "ok", "checkpoint": {"kind": "p2p"}}, "kind: must be one of"),
    ({"run_id": "ok", "checkpoint": {"kind": "hub"}}, "[checkpoint]"),
])
def test_state_toml_errors_name_the_key(doc: dict, fragment: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        parse_run_spec(doc)
    assert fragment in info.value.detail


def test_hub_checkpoint_is_every_stages_starting_place() -> None:
    spec = parse_run_spec({"run_id": "ok", "checkpoint": {"kind": "hub", "repo": "org/m", "revision": "main"}})
    assert spec.checkpoint == Checkpoint(CheckpointKind.Hub, "org/m", "main")
    state = rules.init_coordinator("ok", bytes(32), bytes(32), now=0)
    rules.update(state, bytes(32), spec.config, spec.model, spec.checkpoint)
    assert state.checkpoints[:spec.config.num_stages] == [spec.checkpoint] * spec.config.num_stages


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="no such file"):
        load_run_spec(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("run_id = [")
    with pytest.raises(InvalidConfig, match="not a readable TOML"):
        load_run_spec(bad)


toml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=8,
)
known_keys = st.sampled_from(["min_clients", "max_clients", "num_stages", "witness_nodes", "bloom_error_rate",
                              "n_layers", "d_model", "learning_rate", "kind", "repo", "dataset",
                              "grad_averaging", "demo_chunk", "demo_beta"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["run_id", "config", "model", "checkpoint", "x"]),
                       toml_values | st.dictionaries(known_keys, toml_values, max_size=4), max_size=4))
def test_fuzzed_documents_fail_only_with_invalid_config(doc: dict) -> None:
    try:
        spec = parse_run_spec(doc)
    except InvalidConfig as exc:
        assert exc.detail
        return
    validate_config(spec.config)


def test_validate_config_cli_prints_the_derived_facts(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["validate-config", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert f"coordinator account: {ACCOUNT_SIZE:,} bytes" in result.output
    assert "witness proof: 1 part(s)" in result.output and "config OK" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text('run_id = "demo"\n[config]\nwitness_nodes = 40\n')
    result = CliRunner().invoke(app, ["validate-config", str(bad)])
    assert result.exit_code == 1 and "witness_nodes: must be between 1 and 32" in result.output
    bad.write_text('run_id = "demo"\n[config]\nwitness_nodes = 2\nwitness_quorum = 1\n')  # the old example's
    result = CliRunner().invoke(app, ["validate-config", str(bad)])
    assert result.exit_code == 1 and "witness_quorum: must be a strict majority" in result.output


# --- the model's on-chain description (issue 13) -----------------------------------------------------------

DIGEST = bytes(range(32))
DEMO = {"grad_averaging": GradAveraging.DeMo, "demo_chunk": 64, "demo_topk": 4, "demo_beta_permille": 900}
LLAMA = Model(n_layers=4, architecture="llama", source="HuggingFaceTB/SmolLM2-135M", source_revision="main",
              config_sha256=DIGEST, tokenizer=Tokenizer.Model, tokenizer_sha256=bytes(range(1, 33)))


@pytest.mark.parametrize("model", [
    LLAMA,
    dataclasses.replace(LLAMA, source="./models/tiny", source_revision=""),
    dataclasses.replace(LLAMA, source="~/m", tokenizer=Tokenizer.Bytes, tokenizer_sha256=bytes(32)),
    dataclasses.replace(LLAMA, architecture="qwen2", source="/abs/dir with spaces"),
    Model(lr_schedule=Schedule.LinearWarmup, warmup_steps=GOOD.total_steps),
    Model(lr_schedule=Schedule.WarmupCosine, warmup_steps=GOOD.total_steps - 1, lr_floor_micros=1000),
    Model(lr_schedule=Schedule.WarmupCosine, warmup_steps=0, lr_floor_micros=0),
    Model(grad_averaging=GradAveraging.PowerSGD, powersgd_rank=64, wire_codec=WireCodec.Int8Block),
    Model(grad_averaging=GradAveraging.Full, wire_codec=WireCodec.BFloat16),
    Model(grad_averaging=GradAveraging.DeMo, demo_chunk=2, demo_topk=1, demo_beta_permille=0),
    Model(grad_averaging=GradAveraging.DeMo, demo_chunk=128, demo_topk=127, demo_beta_permille=999),
    Model(grad_averaging=GradAveraging.DeMo, demo_chunk=64, demo_topk=4, demo_beta_permille=900),
    Model(grad_averaging=GradAveraging.Full, grad_values=GradValues.Float16),
    Model(grad_averaging=GradAveraging.Full, grad_values=GradValues.Int8),
    Model(grad_averaging=GradAveraging.PowerSGD, powersgd_rank=4, grad_values=GradValues.Float16),
    Model(grad_averaging=GradAveraging.PowerSGD, powersgd_rank=4, grad_values=GradValues.Int8),
    Model(grad_averaging=GradAveraging.DeMo, demo_chunk=64, demo_topk=4, grad_values=GradValues.Float16),
    Model(grad_averaging=GradAveraging.DeMo, demo_chunk=64, demo_topk=4, grad_values=GradValues.Int8),
    Model(grad_values=GradValues.Int8),  # without gradient averaging: SPARTA's parameter changes travel in int8
    Model(grad_values=GradValues.Int4),
    Model(grad_values=GradValues.Float16),
])
def test_valid_model_descriptions_are_accepted(model: Model) -> None:
    validate_model(model, GOOD)


@pytest.mark.parametrize(("field", "changes"), [
    ("architecture", {"architecture": ""}),
    ("architecture", {"architecture": "Llama"}),
    ("architecture", {"architecture": "llama-2"}),
    ("source", {"source": "org/name"}),  # psyswarm needs nothing from outside
    ("source_revision", {"source_revision": "main"}),
    ("config_sha256", {"config_sha256": DIGEST}),
    ("tokenizer", {"tokenizer": Tokenizer.Model, "tokenizer_sha256": DIGEST}),
    ("tokenizer_sha256", {"tokenizer_sha256": DIGEST}),
    ("warmup_steps", {"warmup_steps": 1}),
    ("lr_floor_micros", {"lr_floor_micros": 1}),
    ("warmup_steps", {"lr_schedule": Schedule.LinearWarmup, "warmup_steps": 0}),
    ("warmup_steps", {"lr_schedule": Schedule.LinearWarmup, "warmup_steps": GOOD.total_steps + 1}),
    ("lr_floor_micros", {"lr_schedule": Schedule.LinearWarmup, "warmup_steps": 1, "lr_floor_micros": 5}),
    ("warmup_steps", {"lr_schedule": Schedule.WarmupCosine, "warmup_steps": GOOD.total_steps}),
    ("lr_floor_micros", {"lr_schedule": Schedule.WarmupCosine, "lr_floor_micros": 1001}),
    ("powersgd_rank", {"grad_averaging": GradAveraging.PowerSGD}),
    ("powersgd_rank", {"grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": 65}),
    ("powersgd_rank", {"grad_averaging": GradAveraging.Full, "powersgd_rank": 4}),
    ("powersgd_rank", {**DEMO, "powersgd_rank": 4}),
    ("demo_chunk", {**DEMO, "demo_chunk": 0}),
    ("demo_chunk", {**DEMO, "demo_chunk": 1, "demo_topk": 1}),
    ("demo_chunk", {**DEMO, "demo_chunk": 129}),
    ("demo_topk", {**DEMO, "demo_topk": 0}),
    ("demo_topk", {**DEMO, "demo_topk": 64}),
    ("demo_topk", {**DEMO, "demo_chunk": 2, "demo_topk": 2}),
    ("demo_beta_permille", {**DEMO, "demo_beta_permille": 1000}),
    ("demo_beta_permille", {**DEMO, "demo_beta_permille": -1}),
    ("demo_chunk", {"grad_averaging": GradAveraging.Full, "demo_chunk": 64}),
    ("demo_topk", {"grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": 4, "demo_topk": 4}),
    ("demo_beta_permille", {"demo_beta_permille": 900}),
    ("demo_chunk", {**DEMO, "grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": 4}),
    ("gossip_rank", {"gossip_rank": 65}),
    ("gossip_rank", {"gossip_rank": -1}),
    ("gossip_rank", {"gossip_rank": 4, "grad_averaging": GradAveraging.Full}),
    ("gossip_rank", {"gossip_rank": 4, "grad_averaging": GradAveraging.PowerSGD, "powersgd_rank": 4}),
    ("grad_values", {"gossip_rank": 4, "grad_values": GradValues.Int4}),
])
def test_model_description_rule_names_the_field(field: str, changes: dict) -> None:
    with pytest.raises(InvalidConfig, match=f"^InvalidConfig: {field}:"):
        validate_model(dataclasses.replace(Model(), **changes), GOOD)


@pytest.mark.parametrize(("field", "changes"), [
    ("source", {"source": ""}),
    ("source", {"source": "name-only"}),
    ("source", {"source": "org/name/extra"}),
    ("source", {"source": "org/na me"}),
    ("source", {"source": "/caf\u00e9"}),
    ("source_revision", {"source_revision": "tab\there"}),
    ("config_sha256", {"config_sha256": bytes(32)}),
    ("tokenizer_sha256", {"tokenizer_sha256": bytes(32)}),
    ("tokenizer_sha256", {"tokenizer": Tokenizer.Bytes}),
])
def test_hf_model_rule_names_the_field(field: str, changes: dict) -> None:
    with pytest.raises(InvalidConfig, match=f"^InvalidConfig: {field}:"):
        validate_model(dataclasses.replace(LLAMA, **changes), GOOD)


HF_TOML = {
    "architecture": "llama", "source": "org/tiny", "source_revision": "v1", "config_sha256": "ab" * 32,
    "tokenizer": "model", "tokenizer_sha256": "cd" * 32, "lr_schedule": "warmup_cosine", "warmup_steps": 5,
    "learning_rate": 0.0003, "lr_floor": 0.00003, "grad_averaging": "powersgd", "powersgd_rank": 4,
    "wire_codec": "bfloat16", "n_layers": 4,
}


def test_state_toml_model_keys() -> None:
    model = parse_run_spec({"run_id": "ok", "model": HF_TOML}).model
    assert (model.architecture, model.source, model.source_revision) == ("llama", "org/tiny", "v1")
    assert model.config_sha256 == b"\xab" * 32 and model.tokenizer_sha256 == b"\xcd" * 32
    assert model.tokenizer == Tokenizer.Model and model.lr_schedule == Schedule.WarmupCosine
    assert (model.warmup_steps, model.learning_rate_micros, model.lr_floor_micros) == (5, 300, 30)
    assert (model.grad_averaging, model.powersgd_rank, model.wire_codec) == (GradAveraging.PowerSGD, 4,
                                                                             WireCodec.BFloat16)
    pinned = {**HF_TOML, "dataset": "hf:org/data", "dataset_sha256": "ef" * 32}
    assert parse_run_spec({"run_id": "ok", "model": pinned}).model.dataset_sha256 == b"\xef" * 32
    local = {**HF_TOML, "dataset": "./tokens"}  # a local path: token files (pinned) or text (not)
    assert parse_run_spec({"run_id": "ok", "model": local}).model.dataset_sha256 == bytes(32)
    for name, codec in (("float32", WireCodec.Float32), ("float16", WireCodec.Float16), ("int8", WireCodec.Int8Block)):
        assert parse_run_spec({"run_id": "ok", "model": {"wire_codec": name}}).model.wire_codec == codec


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"config_sha256": "AB" * 32}, "config_sha256: must be 64 lowercase hex"),
    ({"config_sha256": "ab" * 31}, "config_sha256: must be 64 lowercase hex"),
    ({"tokenizer_sha256": 5}, "tokenizer_sha256: must be 64 lowercase hex"),
    ({"tokenizer": "bpe"}, "tokenizer: must be one of bytes, model"),
    ({"lr_schedule": "cosine"}, "lr_schedule: must be one of constant, linear_warmup, warmup_cosine"),
    ({"grad_averaging": True}, "grad_averaging: must be one of off, full, powersgd, demo"),
    ({"wire_codec": "int4"}, "wire_codec: must be one of float32, float16, bfloat16, int8"),
    ({"lr_floor": -0.1}, "lr_floor: must be a number"),
    ({"lr_floor": 1e-9}, "lr_floor: 1e-09 is not a whole number of millionths"),
    ({"lr_floor_micros": 3}, "lr_floor_micros: unknown key"),
    ({"lr_floor": 0.001}, "lr_floor_micros: must not exceed learning_rate"),
    ({"warmup_steps": 100}, "warmup_steps: must be at most total_steps - 1 (99)"),
    ({"architecture": "Llama"}, "architecture: must be non-empty and only lowercase"),
    ({"source": "bad id"}, "source: must be a Hub repo id"),
    ({"config_sha256": "00" * 32}, "config_sha256: must be the sha256 of the llama model's config.json"),
    ({"dataset_sha256": "ab" * 16}, "dataset_sha256: must be 64 lowercase hex"),
    ({"dataset_sha256": "ab" * 32}, "dataset_sha256: must be all zero for the stdlib dataset"),
    ({"dataset": "hf:org/data"}, "dataset_sha256: must be the sha256 of the remote dataset's dataset.json"),
    ({"dataset": "https://host/data", "dataset_sha256": "00" * 32}, "dataset_sha256: must be the sha256 of the"),
])
def test_state_toml_model_errors_name_the_key(changes: dict, fragment: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        parse_run_spec({"run_id": "ok", "model": {**HF_TOML, **changes}})
    assert fragment in info.value.detail


DEMO_TOML = {"grad_averaging": "demo", "demo_chunk": 64, "demo_topk": 4, "demo_beta": 0.999}


@pytest.mark.parametrize(("changes", "settings"), [
    ({}, (64, 4, 999)),
    ({"demo_beta": 0}, (64, 4, 0)),  # a β of 0 written down stays 0
    ({"demo_beta": 0.9}, (64, 4, 900)),
    ({"demo_beta": None}, (64, 4, 900)),  # left out: the client's default
    ({"demo_chunk": 128, "demo_topk": 127, "demo_beta": 0.001}, (128, 127, 1)),
])
def test_state_toml_demo_keys(changes: dict, settings: tuple[int, int, int]) -> None:
    table = {key: value for key, value in {**DEMO_TOML, **changes}.items() if value is not None}
    model = parse_run_spec({"run_id": "ok", "model": table}).model
    assert model.grad_averaging == GradAveraging.DeMo
    assert (model.demo_chunk, model.demo_topk, model.demo_beta_permille) == settings
    assert model.powersgd_rank == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"demo_beta": 1}, "demo_beta: must be a number in [0, 1), got 1"),
    ({"demo_beta": 1.5}, "demo_beta: must be a number in [0, 1), got 1.5"),
    ({"demo_beta": -0.1}, "demo_beta: must be a number in [0, 1), got -0.1"),
    ({"demo_beta": True}, "demo_beta: must be a number in [0, 1), got True"),
    ({"demo_beta": "0.9"}, "demo_beta: must be a number in [0, 1), got '0.9'"),
    ({"demo_beta": float("nan")}, "demo_beta: must be a number in [0, 1), got nan"),
    ({"demo_beta": 0.9995}, "demo_beta: 0.9995 is not a whole number of thousandths"),
    ({"demo_beta": 0.0001}, "demo_beta: 0.0001 is not a whole number of thousandths"),
    ({"demo_beta_permille": 900}, "demo_beta_permille: unknown key in [model]; did you mean 'demo_beta'?"),
    ({"demo_chunk": "64"}, "demo_chunk: must be an integer, got '64'"),
    ({"demo_topk": 4.0}, "demo_topk: must be an integer, got 4.0"),
    ({"demo_chunk": False}, "demo_chunk: must be an integer, got False"),
    ({"demo_chunk": 1}, "demo_chunk: must be between 2 and 128 with demo gradient averaging"),
    ({"demo_chunk": 129}, "demo_chunk: must be between 2 and 128 with demo gradient averaging"),
    ({"demo_topk": 0}, "demo_topk: must be between 1 and demo_chunk - 1 (63) with demo gradient averaging"),
    ({"demo_topk": 64}, "demo_topk: must be between 1 and demo_chunk - 1 (63) with demo gradient averaging"),
    ({"grad_averaging": "full"}, "demo_chunk: must be 0 unless grad_averaging is demo (leave demo_chunk, "
                                 "demo_topk and demo_beta out)"),
    ({"grad_averaging": "full", "demo_chunk": 0, "demo_topk": 0}, "demo_beta_permille: must be 0 unless"),
    ({"grad_averaging": "powersgd", "powersgd_rank": 4, "demo_chunk": 0}, "demo_topk: must be 0 unless"),
    ({"powersgd_rank": 4}, "powersgd_rank: must be 0 unless grad_averaging is powersgd"),
])
def test_state_toml_demo_errors_are_one_line_and_name_the_key(changes: dict, message: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        parse_run_spec({"run_id": "ok", "model": {**DEMO_TOML, **changes}})
    assert info.value.detail.startswith(message) and "\n" not in info.value.detail


@pytest.mark.parametrize("mode", [{"grad_averaging": "off"}, {"grad_averaging": "full"},
                                  {"grad_averaging": "powersgd", "powersgd_rank": 4}, DEMO_TOML])
@pytest.mark.parametrize(("name", "values"), [("float32", GradValues.Float32), ("float16", GradValues.Float16),
                                              ("int8", GradValues.Int8)])
def test_state_toml_grad_values(mode: dict, name: str, values: GradValues) -> None:
    """How averaged values travel is a run setting, by name, with any averaging mode."""
    model = parse_run_spec({"run_id": "ok", "model": {**mode, "grad_values": name}}).model
    assert model.grad_values == values and model.grad_averaging.name.lower() == mode["grad_averaging"]


def test_int4_carries_sparta_s_slices_and_no_gradients() -> None:
    assert parse_run_spec({"run_id": "ok", "model": {"grad_values": "int4"}}).model.grad_values == GradValues.Int4
    for mode in ({"grad_averaging": "full"}, {"grad_averaging": "powersgd", "powersgd_rank": 4}, DEMO_TOML):
        with pytest.raises(InvalidConfig) as info:
            parse_run_spec({"run_id": "ok", "model": {**mode, "grad_values": "int4"}})
        assert info.value.detail == (f"grad_values: int4 carries SPARTA's slices only; with grad_averaging "
                                     f"{mode['grad_averaging']} choose float32, float16 or int8")


def test_grad_values_default_to_float32() -> None:
    assert Model().grad_values == GradValues.Float32
    for mode in ({}, {"grad_averaging": "full"}, DEMO_TOML):
        assert parse_run_spec({"run_id": "ok", "model": mode}).model.grad_values == GradValues.Float32


def test_the_audit_rate_is_the_run_s_in_thousandths() -> None:
    assert Model().audit_permille == 250
    for rate, permille in ((0, 0), (0.05, 50), (0.25, 250), (1, 1000), (1.0, 1000)):
        assert parse_run_spec({"run_id": "ok", "model": {"audit_rate": rate}}).model.audit_permille == permille
    outside = "must be a number in [0, 1], got"
    for rate, message in ((1.5, f"{outside} 1.5"), (-0.1, f"{outside} -0.1"), (True, f"{outside} True"),
                          ("0.2", f"{outside} '0.2'"), (0.0005, "0.0005 is not a whole number of thousandths")):
        with pytest.raises(InvalidConfig) as info:
            parse_run_spec({"run_id": "ok", "model": {"audit_rate": rate}})
        assert info.value.detail == f"audit_rate: {message}"
    with pytest.raises(InvalidConfig, match="must be at most 1000"):
        validate_model(Model(audit_permille=1001), GOOD)


def test_a_run_may_mix_its_replicas_by_powergossip_in_place_of_sparta_s_slices() -> None:
    assert Model().gossip_rank == 0
    model = parse_run_spec({"run_id": "ok", "model": {"gossip_rank": 4, "grad_values": "int8"}}).model
    assert (model.gossip_rank, model.grad_values) == (4, GradValues.Int8)
    with pytest.raises(InvalidConfig) as info:
        parse_run_spec({"run_id": "ok", "model": {"gossip_rank": 4, "grad_averaging": "full"}})
    assert info.value.detail == ("gossip_rank: applies only with grad_averaging off: with full the replicas step on "
                                 "one averaged gradient and hold one model")
    with pytest.raises(InvalidConfig, match="gossip_rank: must be an integer"):
        parse_run_spec({"run_id": "ok", "model": {"gossip_rank": "4"}})


def test_the_example_s_commented_powergossip_lines_make_a_valid_run(tmp_path: Path) -> None:
    """``examples/state.toml`` offers PowerGossip in commented lines after SPARTA's; uncommented (and SPARTA's own
    settings taken out), they describe a run the coordinator takes."""
    lines = EXAMPLE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "(PowerGossip," in line)
    block = [i for i in range(start, len(lines)) if lines[i].startswith("# ") and " = " in lines[i]][:3]
    for i in block:
        lines[i] = lines[i].removeprefix("# ")
    kept = [line for line in lines if not line.startswith(("sparta_every = 20", "sparta_partitions"))]
    path = tmp_path / "state.toml"
    path.write_text("\n".join(kept) + "\n")
    model = load_run_spec(path).model
    assert (model.gossip_rank, model.sparta_every, model.grad_values) == (4, 1, GradValues.Int8)


def test_each_replica_may_step_on_the_whole_batch_s_second_moment_with_gradient_averaging_off() -> None:
    assert not Model().whole_batch_moment
    model = parse_run_spec({"run_id": "ok", "model": {"whole_batch_moment": True, "grad_values": "int4"}}).model
    assert model.whole_batch_moment and model.grad_values == GradValues.Int4
    assert not parse_run_spec({"run_id": "ok", "model": {"whole_batch_moment": False}}).model.whole_batch_moment
    for mode in ({"grad_averaging": "full"}, {"grad_averaging": "powersgd", "powersgd_rank": 4}, DEMO_TOML):
        with pytest.raises(InvalidConfig) as info:
            parse_run_spec({"run_id": "ok", "model": {**mode, "whole_batch_moment": True}})
        assert info.value.detail == (f"whole_batch_moment: applies only with grad_averaging off: with "
                                     f"{mode['grad_averaging']} every replica already steps on the whole batch's "
                                     "gradient")
    for value in (1, 0, "true", None, 1.0):
        with pytest.raises(InvalidConfig) as info:
            parse_run_spec({"run_id": "ok", "model": {"whole_batch_moment": value}})
        assert info.value.detail == f"whole_batch_moment: must be true or false, got {value!r}"


@pytest.mark.parametrize(("table", "message"), [
    ({"grad_averaging": "full", "grad_values": "int2"}, "grad_values: must be one of float32, float16, int8, int4, "
                                                        "got 'int2'"),
    ({"grad_averaging": "full", "grad_values": 2}, "grad_values: must be one of float32, float16, int8, int4, got 2"),
    ({"grad_values": "int16"}, "grad_values: must be one of float32, float16, int8, int4, got 'int16'"),
    ({"grad_value": "int8"}, "grad_value: unknown key in [model]; did you mean 'grad_values'?"),
])
def test_state_toml_grad_values_errors_are_one_line_and_name_the_key(table: dict, message: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        parse_run_spec({"run_id": "ok", "model": table})
    assert info.value.detail.startswith(message) and "\n" not in info.value.detail


def test_resolve_model_fills_the_digests_before_validation() -> None:
    """The CLI reads the digests from the model's source (client side) through ``resolve_model``; the
    description is validated only once they are filled, and a resolver that leaves one out is refused."""
    bare = {k: v for k, v in HF_TOML.items() if not k.endswith("sha256")}
    with pytest.raises(InvalidConfig, match="config_sha256"):
        parse_run_spec({"run_id": "ok", "model": bare})
    seen: list[Model] = []

    def resolve(model: Model) -> Model:
        seen.append(model)
        return dataclasses.replace(model, config_sha256=b"\x01" * 32, tokenizer_sha256=b"\x02" * 32)

    spec = parse_run_spec({"run_id": "ok", "model": bare}, resolve_model=resolve)
    assert seen[0].config_sha256 == bytes(32) and spec.model.config_sha256 == b"\x01" * 32
    with pytest.raises(InvalidConfig, match="tokenizer_sha256"):
        parse_run_spec({"run_id": "ok", "model": bare},
                       resolve_model=lambda m: dataclasses.replace(m, config_sha256=b"\x01" * 32))


def test_participant_filter_sized_for_two_keys_per_client_of_a_part_and_a_clear_error_when_too_big() -> None:
    spec = parse_run_spec({"run_id": "ok", "config": {"max_clients": 100}})
    assert (spec.config.bloom_slices, spec.config.bloom_bits_per_slice) == bloom_params(200, 0.0009)
    full = parse_run_spec({"run_id": "ok", "config": {"max_clients": 1024}}).config
    assert (full.bloom_slices, full.bloom_bits_per_slice) == bloom_params(2 * 128, 0.0009), "sized for one part"
    assert largest_max_clients(0.0009) == 1024 and full.bloom_bytes <= 480
    largest = largest_max_clients(0.0003)
    assert largest < 128
    doc = {"run_id": "ok", "config": {"max_clients": largest, "bloom_error_rate": 0.0003}}
    assert parse_run_spec(doc).config.bloom_bytes <= 480
    with pytest.raises(InvalidConfig) as info:
        parse_run_spec({"run_id": "ok", "config": {"max_clients": largest + 1, "bloom_error_rate": 0.0003}})
    assert info.value.detail.startswith(f"max_clients: a participant filter for {largest + 1} clients holds "
                                        f"{2 * (largest + 1)} keys")
    assert f"lower max_clients to {largest}" in info.value.detail
    with pytest.raises(InvalidConfig, match="more than the 480"):
        parse_run_spec({"run_id": "ok", "config": {"max_clients": 1024, "min_clients": 32,
                                                   "bloom_error_rate": 0.0003}})
