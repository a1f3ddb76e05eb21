"""The run store keeps a snapshot and the byte ranges each change wrote (issue 22): whatever sequence of changes,
reopenings and snapshots, a reopened store loads exactly the last account it committed, and a change is stored as
the bytes it wrote, not the whole account."""

from __future__ import annotations

import contextlib
import sqlite3
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from local_backend import store as store_module
from local_backend.store import RunStore, StoreError

SIZE = 4096
RUN = "store-test"

writes = st.lists(st.tuples(st.integers(16, SIZE - 1), st.binary(min_size=1, max_size=300)), min_size=1, max_size=4)
steps = st.lists(st.one_of(writes, st.just("reopen")), min_size=1, max_size=40)


def changed(account: bytes, nonce: int, ranges: list[tuple[int, bytes]]) -> bytes:
    """``account`` with ``ranges`` written over it (clipped to its size) and its nonce set."""
    out = bytearray(account)
    out[8:16] = nonce.to_bytes(8, "little")
    for offset, data in ranges:
        data = data[:SIZE - offset]
        out[offset:offset + len(data)] = data
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(steps=steps, snapshot_after=st.sampled_from([200, 1000, 256 << 10]))
def test_a_reopened_store_loads_the_last_committed_account(steps: list, snapshot_after: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(store_module, "SNAPSHOT_AFTER", snapshot_after):
        path = Path(tmp) / "run.sqlite"
        store = RunStore(path)
        account, nonce = changed(bytes(SIZE), 1, []), 1
        store.save(RUN, nonce, account, bytes(32), b"first")
        for step in steps:
            if step == "reopen":
                store.close()
                store = RunStore(path)
                assert store.load(RUN) == account
            else:
                nonce += 1
                account = changed(account, nonce, step)
                store.save(RUN, nonce, account, bytes(32), b"change")
        store.close()
        reopened = RunStore(path)
        assert reopened.load(RUN) == account
        assert [row[3] for row in reopened.operations()] == list(range(1, nonce + 1))
        reopened.close()


def test_a_change_is_stored_as_the_bytes_it_wrote(tmp_path: Path) -> None:
    """Before: every change stored the whole account (120 KB at 1,024 clients) and synced it."""
    store = RunStore(tmp_path / "run.sqlite")
    account = changed(bytes(120_000), 1, [])
    store.load(RUN)
    store.save(RUN, 1, account, bytes(32), b"first")
    store.save(RUN, 2, changed(account, 2, [(5000, b"joined")]), bytes(32), b"change")
    with contextlib.closing(sqlite3.connect(tmp_path / "run.sqlite")) as reader:
        (size,) = reader.execute("SELECT sum(length(patch)) FROM patches").fetchone()
    assert size < 200, size
    store.close()


def test_a_failed_write_leaves_the_next_patch_based_on_what_is_stored(tmp_path: Path) -> None:
    """A write that fails must not move what the store makes its next patch from: else the next change would be
    stored as a patch from a state the database never held."""
    path = tmp_path / "run.sqlite"
    store = RunStore(path, busy_timeout=0.1)
    first = changed(bytes(SIZE), 1, [])
    store.save(RUN, 1, first, bytes(32), b"first")
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as locker:
        locker.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreError, match="locked"):
            store.save(RUN, 2, changed(first, 2, [(100, b"lost")]), bytes(32), b"lost")
        locker.execute("ROLLBACK")
    second = changed(first, 2, [(200, b"kept")])
    store.save(RUN, 2, second, bytes(32), b"kept")
    store.close()
    assert RunStore(path).load(RUN) == second
