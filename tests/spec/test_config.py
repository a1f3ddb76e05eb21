"""Run configs: every rule names its field, state.toml errors are clear, and the parser survives fuzzing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from client.cli import app
from coordinator_program.config import (
    Config,
    Model,
    load_run_spec,
    parse_run_spec,
    validate_config,
    validate_model,
)
from coordinator_program.errors import InvalidConfig
from coordinator_program.state import ACCOUNT_SIZE

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "state.toml"
GOOD = Config()


@pytest.mark.parametrize(("field", "value", "fragment"), [
    ("num_stages", 1, "between 2 and 16"),
    ("num_stages", 17, "between 2 and 16"),
    ("max_clients", 0, "between 1 and 256"),
    ("max_clients", 257, "between 1 and 256"),
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
    assert (spec.config.bloom_slices, spec.config.bloom_bits_per_slice) == (11, 22)


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


def test_hub_checkpoint_holds_every_stage() -> None:
    spec = parse_run_spec({"run_id": "ok", "checkpoint": {"kind": "hub", "repo": "org/m", "revision": "main"}})
    assert spec.checkpoint.stages_done == 0b111


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
                              "n_layers", "d_model", "learning_rate", "kind", "repo", "dataset"])


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
    assert "witness instruction:" in result.output and "config OK" in result.output
    bad = tmp_path / "bad.toml"
    bad.write_text('run_id = "demo"\n[config]\nwitness_nodes = 40\n')
    result = CliRunner().invoke(app, ["validate-config", str(bad)])
    assert result.exit_code == 1 and "witness_nodes: must be between 1 and 32" in result.output
    bad.write_text('run_id = "demo"\n[config]\nwitness_nodes = 2\nwitness_quorum = 1\n')  # the old example's
    result = CliRunner().invoke(app, ["validate-config", str(bad)])
    assert result.exit_code == 1 and "witness_quorum: must be a strict majority" in result.output
