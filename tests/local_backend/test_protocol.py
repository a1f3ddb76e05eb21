"""The wire protocol: messages round-trip, state patches rebuild the state, and garbage fails cleanly."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from local_backend import protocol as p

SAMPLES = [
    p.Challenge(b"\x01" * 32, "run"),
    p.Hello(b"\x02" * 32, b"\x03" * 64),
    p.Welcome(),
    p.FullState.of(7, b"\x00" * 1000 + b"abc"),
    p.StatePatch(1, 2, ((0, b"xy"), (40, b"z" * 33))),
    p.Request(9, b"ix-bytes", b"\x04" * 64),
    p.Request(10, b"ix", b"\x05" * 64, b"\x06" * 32, b"\x07" * 64),
    p.Reply(9, 6001, "WrongRunId: nope"),
    p.Fatal("bye"),
    p.Ping(),
    p.Pong(),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(message: p.Message) -> None:
    assert p.decode(message.encode()) == message


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_payloads_fail_with_protocol_errors(data: bytes) -> None:
    try:
        message = p.decode(data)
    except p.ProtocolError:
        return
    assert p.decode(message.encode()) == message


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_messages_fail_cleanly(message: p.Message, data: st.DataObject) -> None:
    raw = bytearray(message.encode())
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    try:
        p.decode(bytes(raw[:cut]))
    except p.ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=400), st.data())
def test_patches_rebuild_the_new_state(old: bytes, data: st.DataObject) -> None:
    new = bytearray(old)
    for _ in range(data.draw(st.integers(0, 8))):
        new[data.draw(st.integers(0, len(new) - 1))] = data.draw(st.integers(0, 255))
    patch = p.StatePatch(1, 2, p.diff(old, bytes(new)))
    assert p.decode(patch.encode()).apply(old) == bytes(new)
    assert sum(len(d) for _, d in patch.patches) <= len(old)


def test_a_patch_outside_the_state_and_a_bomb_are_refused() -> None:
    with pytest.raises(p.ProtocolError, match="beyond"):
        p.StatePatch(1, 2, ((10, b"abc"),)).apply(b"\x00" * 11)
    bomb = p.FullState(1, zlib.compress(b"\x00" * (p.MAX_STATE_BYTES + 1)))
    with pytest.raises(p.ProtocolError, match="more than"):
        bomb.account()
    with pytest.raises(p.ProtocolError, match="not zlib"):
        p.FullState(1, b"nope").account()
