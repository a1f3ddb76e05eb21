"""A contributor of a run whose model source no longer serves the config the run names stops with the reason,
as a worker and as a trainer, before it serves or trains anything."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from solders.keypair import Keypair

from client.contributor.context import RunnerOptions
from client.contributor.errors import CannotContribute
from client.contributor.runner import Contributor
from client.models import config_digest
from coordinator_program.spec.state import Role
from tests.witness.rounds import run_with_keys

from .conftest import tiny_config


def contributor_of(role: Role, source: Path, pinned: bytes, dht):
    state, _ = run_with_keys()
    state.model = dataclasses.replace(state.model, architecture="llama", source=str(source), config_sha256=pinned,
                                      seq_len=16)
    contributor = Contributor(None, Keypair(), RunnerOptions(role=role, initial_peers=[]))  # type: ignore[arg-type]
    contributor.context.dht = dht
    return contributor, state


@pytest.mark.parametrize("role", [Role.Worker, Role.Trainer])
def test_a_contributor_refuses_a_source_whose_config_changed(role: Role, tmp_path: Path, dht) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("llama")))
    pinned = config_digest(tiny_config("llama", num_hidden_layers=4))  # what the run named before the change
    contributor, state = contributor_of(role, tmp_path, pinned, dht)
    with pytest.raises(CannotContribute, match="cannot build the run's model: .* refusing to train another model"):
        contributor.role.prepare(state, 1)
    assert (contributor.role.replica if role == Role.Worker else contributor.role.trainer) is None
