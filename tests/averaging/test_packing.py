"""A phase's tensors cut once per reducer land whole, one piece on each, in hivemind's own partitioner; a real
PowerSGD round sends that and puts every tensor's values back in its place."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch
from hivemind.averaging.partition import TensorPartContainer
from hypothesis import given, settings
from hypothesis import strategies as st

from client.averaging.gradients import GradAveraging, GradientAverager, GradientProcess, GradientSettings
from client.averaging.packing import laid_end_to_end, piece_sizes, put_back
from client.averaging.runner import RobustRunner
from client.averaging.sparta import AveragingStatus
from client.averaging.stage_averager import PART_BYTES
from client.averaging.values import GradValues, codec
from tests.averaging.test_gradients import QUICK, together

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


PARTS_SENT = mp.Value("i", 0)  # input parts the test's all-reduce runners cut: shared with the processes they fork


class _CountingRunner(RobustRunner):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with PARTS_SENT.get_lock():
            PARTS_SENT.value += sum(self.tensor_part_container.num_parts_by_peer)


def test_a_powersgd_round_of_many_tensors_sends_a_part_per_reducer_and_puts_each_back(make_grad_averager) -> None:
    """Twelve layers' matrices and vectors: each phase is one part per reducer, four a peer in all, where one per
    tensor would be 12 (P) and 24 (Q); both peers end with the same result, each vector (sent in full) the mean."""
    generator = torch.Generator().manual_seed(3)
    models = [[(f"layers.{i}.{kind}", torch.randn(*shape, generator=generator)) for i in range(12)
               for kind, shape in (("weight", (24, 32)), ("bias", (24,)))] for _ in range(2)]
    process = type("GradientProcess", (GradientProcess,), {"runner_class": _CountingRunner})
    counting = type("GradientAverager", (GradientAverager,), {"process_class": process})
    settings = GradientSettings(GradAveraging.POWERSGD, rank=2, timeouts=QUICK)
    averagers = [make_grad_averager(pairs, settings, cls=counting) for pairs in models]
    values = [[t.clone() for _, t in pairs] for pairs in models]
    PARTS_SENT.value = 0
    results = together(averagers, values, 0, [1.0, 1.0])
    assert [(r.status, r.complete) for r in results] == [(AveragingStatus.AVERAGED, True)] * 2
    assert PARTS_SENT.value == 2 * 2 * 2  # two peers, two phases, a piece for each reducer
    assert all(torch.equal(a, b) for a, b in zip(*values, strict=True))
    for i in range(1, 24, 2):
        torch.testing.assert_close(values[0][i], (models[0][i][1] + models[1][i][1]) / 2)
    assert all(torch.linalg.matrix_rank(values[0][i]) <= 2 for i in range(0, 24, 2))
