"""SPARTA slices in int8 or int4 as changes since their anchor (``client.averaging.anchored``), with real hivemind
averagers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hivemind.compression import CompressionInfo
from hivemind.proto import averaging_pb2

from client.averaging import sparta
from client.averaging.anchored import AnchoredAverager
from client.averaging.audit import make_statement
from client.averaging.runner import RobustRunner
from client.averaging.sparta import AveragingStatus, SpartaAverager
from client.averaging.values import INT4_LEVELS, LEVELS, GradValues, codec, decode
from tests.averagers import average_together


def tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [("layers.0.fc.weight", torch.randn(64, 40, generator=generator) * 0.02),
            ("layers.0.fc.bias", torch.randn(64, generator=generator) * 0.02)]


def nudge(named: list[tuple[str, torch.Tensor]], seed: int, size: float = 1e-3) -> None:
    """A few optimizer steps' worth of change, different on each peer."""
    generator = torch.Generator().manual_seed(seed)
    for _, t in named:
        t.add_(torch.randn(t.shape, generator=generator) * size)


def mean(peers: list[list[tuple[str, torch.Tensor]]]) -> list[torch.Tensor]:
    return [(a + b) / 2 for (_, a), (_, b) in zip(*peers, strict=True)]


def error(peers: list[list[tuple[str, torch.Tensor]]], expected: list[torch.Tensor],
          indices: list[torch.Tensor] | None = None) -> float:
    """The largest distance of any peer's values from ``expected`` (at ``indices``: one partition's elements)."""
    return max(float((t.reshape(-1) - e.reshape(-1))[slice(None) if indices is None else idx].abs().max())
               for named in peers
               for (_, t), e, idx in zip(named, expected, indices or [None] * len(expected), strict=True))


def sent(averager: SpartaAverager, values: GradValues = GradValues.FLOAT32) -> int:
    """The bytes of ``averager``'s slices in ``values``, computed from the codec itself."""
    return sum(len(codec(values).compress(torch.zeros(size), CompressionInfo.from_tensor(torch.zeros(size))).buffer)
               for size in averager.masks.slice_sizes)


@pytest.mark.parametrize(("values", "levels"), [(GradValues.INT8, LEVELS), (GradValues.INT4, INT4_LEVELS)],
                         ids=["int8", "int4"])
def test_changes_travel_in_the_codec_and_every_anchor_ends_bit_identical(make_averager, values: GradValues,
                                                                         levels: int) -> None:
    peers = [tensors(1), tensors(2)]
    averagers = [make_averager(p, partitions=2, values=values) for p in peers]
    assert [a._averager.declared_anchor(0) for a in averagers] == ["", ""]  # no anchor before a complete round

    first = averagers[0].masks.indices(0)
    expected = mean(peers)
    results = average_together(averagers, 0, [1.0, 1.0])
    assert {r.status for r in results} == {AveragingStatus.AVERAGED}
    assert error(peers, expected, first) < 1e-7, "without anchors the values themselves are averaged, in float32"
    assert {(r.payload_values, r.payload_bytes) for r in results} == {(GradValues.FLOAT32, sent(averagers[0]))}
    digests = {a._averager.declared_anchor(0) for a in averagers}
    assert len(digests) == 1 and "" not in digests
    assert [a._averager.declared_anchor(1) for a in averagers] == ["", ""]  # partition 1 was not averaged

    for i, named in enumerate(peers):
        nudge(named, 10 + i)
    expected = mean(peers)
    results = average_together(averagers, 2, [1.0, 1.0])  # partition 0 again: both hold its anchor
    assert {r.status for r in results} == {AveragingStatus.AVERAGED}
    assert {(r.payload_values, r.payload_bytes) for r in results} == {(values, sent(averagers[0], values))}
    assert sent(averagers[0], values) < sent(averagers[0]) / 3  # int8 about a quarter, int4 about a seventh
    new = {a._averager.declared_anchor(0) for a in averagers}
    assert len(new) == 1 and new != digests, "every peer added the same decoded average to the same anchor"
    # (the values differ from the anchor by float rounding at most: SPARTA adds the change to the live values)
    assert all(torch.allclose(a.reshape(-1)[idx], b.reshape(-1)[idx], rtol=0, atol=1e-8)
               for (_, a), (_, b), idx in zip(*peers, first, strict=True))
    # Within the codec's rounding of the changes (a few × 1e-3, half a level each, twice: sent, then returned)...
    assert 0 < error(peers, expected, first) <= 2 * 5e-3 / levels
    # ...where the codec of the values themselves (up to 4 × 0.02) could be off by up to half a level of those.
    assert error(peers, expected, first) < 4 * 0.02 / (2 * levels) / 4


class ForeignAnchor(SpartaAverager):
    """Declares an anchor no one else holds."""

    def _step(self, averaging_index: int, weight: float) -> Any:
        declared = self._averager.declared_anchor

        def forged(index: int) -> str:
            return "00" * 32 if declared(index) else ""

        self._averager.declared_anchor = forged  # type: ignore[method-assign]
        try:
            return super()._step(averaging_index, weight)
        finally:
            self._averager.declared_anchor = declared  # type: ignore[method-assign]


def test_a_foreign_anchor_makes_the_group_average_values_in_float32_and_resyncs_the_anchors(make_averager) -> None:
    peers = [tensors(3), tensors(4)]
    averagers = [make_averager(peers[0], values=GradValues.INT8),
                 make_averager(peers[1], values=GradValues.INT8, cls=ForeignAnchor)]
    average_together(averagers, 0, [1.0, 1.0])
    for i, named in enumerate(peers):
        nudge(named, 20 + i)
    expected = mean(peers)
    results = average_together(averagers, 1, [1.0, 1.0])
    assert {r.status for r in results} == {AveragingStatus.AVERAGED}
    assert error(peers, expected) < 1e-7, "a disagreement on anchors is settled by averaging the values"
    assert averagers[0]._averager.declared_anchor(0) == averagers[1]._averager.declared_anchor(0) != ""


def test_an_anchor_differing_in_one_value_is_not_trusted(make_averager) -> None:
    peers = [tensors(5), tensors(6)]
    averagers = [make_averager(p, values=GradValues.INT8) for p in peers]
    average_together(averagers, 0, [1.0, 1.0])
    averagers[1]._averager._anchor[0][7] += 1e-6  # shared with its averaging process, as a lost update would leave it
    assert averagers[0]._averager.declared_anchor(0) != averagers[1]._averager.declared_anchor(0)
    for i, named in enumerate(peers):
        nudge(named, 30 + i)
    expected = mean(peers)
    average_together(averagers, 1, [1.0, 1.0])
    assert error(peers, expected) < 1e-7
    assert averagers[0]._averager.declared_anchor(0) == averagers[1]._averager.declared_anchor(0) != ""


def test_a_float32_peer_among_int8_ones_averages_values_with_them(make_averager) -> None:
    peers = [tensors(7), tensors(8)]
    averagers = [make_averager(peers[0], values=GradValues.INT8), make_averager(peers[1])]
    for index in range(2):
        nudge(peers[0], 40 + index)
        expected = mean(peers)
        results = average_together(averagers, index, [1.0, 1.0])
        assert {r.status for r in results} == {AveragingStatus.AVERAGED}
        assert error(peers, expected) < 1e-7


class _Equivocating(RobustRunner):
    """A reducer that, in a round of changes, answers one sender with another average than the one it keeps and
    sends the others: one value moved by 1e-3, in the run's codec, under a statement it signs for that result."""

    async def _accumulate_parts_streaming(self, stream: Any, sender_index: int) -> Any:
        victim = min(i for i, peer in enumerate(self.sender_peer_ids) if peer != self.peer_id)
        part_index = 0
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            if sender_index == victim and self.values != GradValues.FLOAT32:
                _, result, statement = self._answer(part_index, torch.zeros(0))
                other = result.clone()
                other.view(-1)[0] += 1e-3
                wire = self.tensor_part_container.compression.compress(other, None)
                other = decode(wire, self.values)
                lie = make_statement(self.signer, self.place(self.peer_id, part_index), statement.entries, other,
                                     self.values)
                message = averaging_pb2.AveragingData(code=message.code, tensor_part=wire, peer_id=lie.to_bytes())
            part_index += 1
            yield message


def test_a_reducer_that_equivocates_splits_the_anchors_for_one_round_only(make_averager, monkeypatch) -> None:
    """A reducer that sends one groupmate another average than the rest leaves that peer's anchor apart from the
    group's; the next round of the partition finds the digests apart, averages the values in float32, and every
    peer holds the same values and one anchor again: an equivocation in a round of changes costs the group one
    float32 round, and does not outlast it."""
    peers = [tensors(9), tensors(10), tensors(11)]
    averagers = [make_averager(p, values=GradValues.INT8) for p in peers[:2]]
    liar_class = type("AnchoredAverager", (AnchoredAverager,), {"runner_class": _Equivocating})
    monkeypatch.setattr(sparta, "AnchoredAverager", liar_class)  # the same name: hivemind routes by class name
    averagers.append(make_averager(peers[2], values=GradValues.INT8))
    monkeypatch.undo()

    average_together(averagers, 0, [1.0] * 3)  # no anchors yet: values, in float32
    # hivemind gives these two small tensors to two reducers, in an order drawn each round: the liar lies only in a
    # round where it reduces one, so rounds of changes go on until it has (each round, 2 chances in 3).
    for attempt in range(8):
        for i, named in enumerate(peers):
            nudge(named, 50 + 10 * attempt + i)
        results = average_together(averagers, 0, [1.0] * 3)
        assert {r.status for r in results} == {AveragingStatus.AVERAGED}
        digests = [a._averager.declared_anchor(0) for a in averagers]
        assert "" not in digests
        if len(set(digests)) == 2:
            break  # one peer was answered apart, and holds another anchor
        assert len(set(digests)) == 1, "an honest round of changes leaves one anchor"
    else:
        raise AssertionError("the equivocating reducer reduced no part in 8 rounds")

    for i, named in enumerate(peers):
        nudge(named, 200 + i)
    results = average_together(averagers, 0, [1.0] * 3)  # the digests differ: values, in float32
    assert {r.status for r in results} == {AveragingStatus.AVERAGED}
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for other in peers[1:]  # the same values everywhere
               for (_, a), (_, b) in zip(peers[0], other, strict=True))
    digests = [a._averager.declared_anchor(0) for a in averagers]
    assert "" not in digests and len(set(digests)) == 1, "one anchor again, the same everywhere"
