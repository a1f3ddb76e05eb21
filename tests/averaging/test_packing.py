"""A phase's tensors cut once per reducer land whole, one piece on each, in hivemind's own partitioner."""

from __future__ import annotations

import torch
from hivemind.averaging.partition import TensorPartContainer
from hypothesis import given, settings
from hypothesis import strategies as st

from client.averaging.packing import laid_end_to_end, piece_sizes, put_back
from client.averaging.stage_averager import PART_BYTES
from client.averaging.values import GradValues, codec

fractions = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8).filter(lambda f: sum(f) > 0.01)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 40_000), fractions=fractions)
def test_each_piece_is_one_reducers_whole_share(total: int, fractions: list[float]) -> None:
    sizes = piece_sizes(total, fractions)
    assert sum(sizes) == total and all(size > 0 for size in sizes)
    pieces = list(torch.zeros(total).split(sizes))
    container = TensorPartContainer(pieces, fractions, compression=codec(GradValues.INT8), part_size_bytes=PART_BYTES)
    by_peer = [[len(part) for part in container.get_raw_input_parts(peer)] for peer in range(len(fractions))]
    assert [parts for parts in by_peer if parts] == [[size] for size in sizes]  # one part each, in order


def test_a_phase_of_many_small_tensors_is_one_message_per_reducer() -> None:
    factors = [torch.randn(48, 3) for _ in range(110)]  # a tiny Llama's P factors at rank 3, in number
    flat = laid_end_to_end(factors)
    pieces = list(flat.split(piece_sizes(flat.numel(), [1.0, 1.0])))
    packed = TensorPartContainer(pieces, (1.0, 1.0), part_size_bytes=PART_BYTES)
    loose = TensorPartContainer(factors, (1.0, 1.0), part_size_bytes=PART_BYTES)
    assert packed.num_parts_by_peer == (1, 1)
    assert sum(loose.num_parts_by_peer) == 110


def test_put_back_restores_every_tensor_in_place() -> None:
    tensors = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    before = [t.clone() for t in tensors]
    flat = laid_end_to_end(tensors)
    for t in tensors:
        t.zero_()
    put_back(flat * 2, tensors)
    assert all(torch.equal(t, 2 * b) for t, b in zip(tensors, before, strict=True))
