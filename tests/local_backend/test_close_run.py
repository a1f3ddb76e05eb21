"""The TCP server refuses close_run: a run it holds has no rent to return, so closing is for on-chain runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from solders.keypair import Keypair

from coordinator_program.spec import errors
from coordinator_program.spec.instructions import CloseRun, SetPaused
from coordinator_program.spec.rules import NO_AUTHORITY
from coordinator_program.spec.state import Phase, encode_state
from local_backend.server import CoordinatorServer
from local_backend.store import RunStore
from tests.local_backend.test_server import SPEC


def test_close_run_is_refused_even_from_the_authority_of_a_paused_run(tmp_path: Path) -> None:
    authority = Keypair()
    server = CoordinatorServer(SPEC, RunStore(tmp_path / "run.sqlite"), authority, join_authority=NO_AUTHORITY)
    me = bytes(authority.pubkey())
    asyncio.run(server.submit(me, SetPaused(True).encode()))
    assert server.state.phase == Phase.Paused  # halted: the specification would let the authority close it
    before = encode_state(server.state)
    with pytest.raises(errors.MalformedInstruction, match="no rent to return"):
        asyncio.run(server.submit(me, CloseRun().encode()))
    assert encode_state(server.state) == before
    server.store.close()
    assert RunStore(tmp_path / "run.sqlite").load(SPEC.run_id) == before  # nothing new was persisted
