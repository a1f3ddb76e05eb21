"""How averaged values travel (``client.averaging.values``): each codec's stated error, the refusal of parts in
another codec or malformed, audits that allow a codec's rounding and no more, and real hivemind averagers over
loopback in int8 (full and DeMo), with a sender in another codec among them."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch
from hivemind.compression import CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2
from solders.keypair import Keypair

from client.averaging.audit import (
    Place,
    evidence,
    false_block,
    make_statement,
    proven_liar,
    reduce_blocks,
    signed_entry,
    statement_refusal,
)
from client.averaging.gradients import GradAveraging, GradientSettings
from client.averaging.sparta import AveragingStatus
from client.averaging.values import (
    BLOCK,
    GradValues,
    codec,
    decode,
    encoded_bytes,
    norm_bound,
    norm_error,
    round_trip,
    value_error,
)
from tests.averaging.test_attacks import TRIO, gradient_pairs, gradient_round, shared_gradient
from tests.averaging.test_audit import averager_class, lies_after
from tests.averaging.test_demo import alike, demo_average, demo_settings
from tests.averaging.test_gradients import grads, together

INT8, INT4, FLOAT16, FLOAT32 = GradValues.INT8, GradValues.INT4, GradValues.FLOAT16, GradValues.FLOAT32
PLACE = Place("run.body1.grad", b"group-id", b"reducer-peer", 0)


def kinds() -> dict[str, torch.Tensor]:
    """Vectors a codec must carry within its stated error: ordinary, heavy-tailed, with one outlier, all zero,
    exactly one block, and one that ends in a short block."""
    generator = torch.Generator().manual_seed(3)
    outlier = torch.randn(2 * BLOCK, generator=generator) * 1e-3
    outlier[700] = 50.0
    return {"gaussian": torch.randn(5 * BLOCK, generator=generator),
            "heavy": torch.randn(3 * BLOCK, generator=generator) * torch.rand(3 * BLOCK, generator=generator) ** 6,
            "outlier": outlier, "zeros": torch.zeros(BLOCK), "one block": torch.randn(BLOCK, generator=generator),
            "short end": torch.randn(BLOCK + 37, generator=generator) * 1e-6}


# ----- the codecs -----

@pytest.mark.parametrize("values", list(GradValues))
@pytest.mark.parametrize("kind", list(kinds()))
def test_each_codec_moves_a_value_and_a_norm_at_most_as_far_as_it_states(values: GradValues, kind: str) -> None:
    x = kinds()[kind]
    y = round_trip(x, values)
    assert y.dtype == torch.float32 and y.shape == x.shape
    for start in range(0, x.numel(), BLOCK):
        block, moved = x[start:start + BLOCK], (y - x)[start:start + BLOCK]
        assert float(moved.abs().max()) <= value_error(values, float(block.abs().max())) + 1e-12
    norm = float(x.norm())
    assert float((y - x).norm()) <= norm_error(values, norm, x.numel()) + 1e-12
    assert float(y.norm()) <= norm_bound(values, norm, x.numel())
    if values == FLOAT32:
        assert torch.equal(y, x)


def test_int8_sends_one_byte_a_value_and_a_scale_a_block() -> None:
    x = kinds()["short end"]
    wire = codec(INT8).compress(x, None)
    assert len(wire.buffer) == x.numel() + 4 * 2
    assert len(codec(FLOAT16).compress(x, None).buffer) == 2 * x.numel()
    assert torch.equal(decode(wire, INT8), round_trip(x, INT8))  # the same values wherever decoded


def test_int4_sends_half_a_byte_a_value_and_a_scale_every_64() -> None:
    x = kinds()["short end"]  # 549 values: 9 blocks of 64, the last short, and an odd count
    wire = codec(INT4).compress(x, None)
    assert len(wire.buffer) == 4 * 9 + 275
    assert torch.equal(decode(wire, INT4), round_trip(x, INT4))
    assert len(codec(INT4).compress(torch.randn(2 * BLOCK), None).buffer) == 4 * 16 + BLOCK  # a ninth of float32's


@pytest.mark.parametrize("values", list(GradValues), ids=lambda v: v.value)
def test_encoded_bytes_is_the_length_of_a_part_in_the_codec(values: GradValues) -> None:
    """What a SPARTA round reports it sent (``AveragingResult.payload_bytes``) is what the codec makes."""
    for count in (1, 2, 63, 64, 65, 511, 512, 513, 1031):
        x = torch.randn(count, generator=torch.Generator().manual_seed(count))
        assert encoded_bytes(values, count) == len(codec(values).compress(x, CompressionInfo.from_tensor(x)).buffer)


def test_int4_refuses_a_nibble_that_is_no_level_and_a_claim_to_its_pad() -> None:
    """Levels are stored 1..15, so a 0 nibble among the values is refused, and an odd count's pad nibble (0) cannot
    be read as a value by a part claiming one value more: the same bytes would otherwise stand for two sizes."""
    wire = codec(INT4).compress(torch.randn(65), None)
    zeroed = runtime_pb2.Tensor()
    zeroed.CopyFrom(wire)
    zeroed.buffer = wire.buffer[:-2] + bytes([wire.buffer[-2] & 0xF0]) + wire.buffer[-1:]
    with pytest.raises(ValueError, match="nibble of 0"):
        decode(zeroed, INT4)
    longer = runtime_pb2.Tensor()
    longer.CopyFrom(wire)
    del longer.size[:]
    longer.size.append(66)
    with pytest.raises(ValueError, match="nibble of 0"):
        decode(longer, INT4)
    padded = runtime_pb2.Tensor()
    padded.CopyFrom(wire)
    padded.buffer = wire.buffer[:-1] + bytes([wire.buffer[-1] | 0x80])
    with pytest.raises(ValueError, match="pad nibble"):
        decode(padded, INT4)


def test_a_part_in_another_codec_than_the_run_s_is_refused_naming_both() -> None:
    x = torch.randn(100)
    with pytest.raises(ValueError, match="sent as NONE, where the run's grad_values is int8"):
        decode(NoCompression().compress(x, None), INT8)
    with pytest.raises(ValueError, match="sent as BLOCKWISE_8BIT, where the run's grad_values is float32"):
        decode(codec(INT8).compress(x, None), FLOAT32)


def malformed(values: GradValues) -> list[tuple[runtime_pb2.Tensor, str]]:
    """Parts in ``values`` that a peer could send and no codec may read, each with what is wrong."""
    good = codec(values).compress(torch.randn(BLOCK + 1), None)

    def changed(**fields: object) -> runtime_pb2.Tensor:
        part = runtime_pb2.Tensor()
        part.CopyFrom(good)
        for name, value in fields.items():
            if name == "size":
                del part.size[:]
                part.size.extend(value)  # type: ignore[arg-type]
            else:
                setattr(part, name, value)
        return part

    return [(changed(buffer=good.buffer[:-1]), "truncated"), (changed(size=[BLOCK + 2]), "larger than its bytes"),
            (changed(dtype="float64"), "another dtype"), (changed(dtype="no such type"), "an unknown dtype"),
            (changed(size=[1] * 9 + [BLOCK + 1]), "too many dimensions")]


@pytest.mark.parametrize("values", list(GradValues))
@pytest.mark.parametrize("what", ["truncated", "larger than its bytes", "another dtype", "an unknown dtype",
                                  "too many dimensions"])
def test_a_malformed_part_is_refused_never_read(values: GradValues, what: str) -> None:
    part = dict((name, part) for part, name in malformed(values))[what]
    with pytest.raises(ValueError):
        decode(part, values)


@pytest.mark.parametrize("values", [INT8, INT4, FLOAT16])
def test_fuzzed_parts_decode_to_their_declared_float32_values_or_are_refused(values: GradValues) -> None:
    """Random bytes, sizes and dtypes: ``decode`` returns float32 values of the declared size or raises
    ``ValueError``, never anything else."""
    draw = random.Random(11)
    good = codec(values).compress(torch.randn(700), None)
    read = 0
    for _ in range(400):
        part = runtime_pb2.Tensor()
        part.CopyFrom(good)
        cut = draw.randrange(len(good.buffer) + 8)
        part.buffer = bytes(draw.getrandbits(8) for _ in range(cut)) if draw.random() < 0.5 else good.buffer[:cut]
        if draw.random() < 0.3:
            del part.size[:]
            part.size.extend(draw.randrange(0, 900) for _ in range(draw.randrange(0, 4)))
        if draw.random() < 0.2:
            part.dtype = draw.choice(["float32", "float16", "int8", "bfloat16", "", "x"])
        try:
            tensor = decode(part, values)
        except ValueError:
            continue
        read += 1
        assert tensor.dtype == torch.float32 and tensor.numel() == math.prod(part.size)
    assert read > 0  # some of the draws were well formed


# ----- audits in a codec -----

def blockwise_reduction(shift: float, rounded: bool = True, values: GradValues = INT8
                        ) -> tuple[Keypair, Any, list[torch.Tensor], torch.Tensor]:
    """Three senders' signed inputs in ``values`` and a reducer's statement in ``values`` of their blockwise robust
    mean (rounded in that codec, as an honest reducer returns it, or exact), with ``shift`` added to one value of
    the second block."""
    reducer, senders = Keypair(), [Keypair() for _ in range(3)]
    generator = torch.Generator().manual_seed(5)
    inputs = [round_trip(torch.randn(3 * BLOCK, generator=generator), values) for _ in senders]
    entries = [signed_entry(k, PLACE, p, 4.0) for k, p in zip(senders, inputs, strict=True)]
    exact = reduce_blocks(inputs, [4.0] * 3)
    result = round_trip(exact, values) if rounded else exact.clone()
    result[BLOCK + 9] += shift
    return reducer, make_statement(reducer, PLACE, entries, result, values), inputs, result


@pytest.mark.parametrize("values", [INT8, INT4])
def test_an_honest_blockwise_reduction_convicts_no_one(values: GradValues) -> None:
    reducer, statement, inputs, result = blockwise_reduction(0.0, values=values)
    key = bytes(reducer.pubkey())
    assert not torch.equal(result, reduce_blocks(inputs, [4.0] * 3))  # rounded: not the exact robust mean
    assert false_block(statement, inputs, result) is None
    assert all(proven_liar(evidence(PLACE, key, statement, inputs, result, b)) is None for b in range(3))


@pytest.mark.parametrize("values", [INT8, INT4])
def test_a_blockwise_reduction_is_convicted_exactly_beyond_half_a_level_of_the_robust_mean(values: GradValues
                                                                                           ) -> None:
    """Evidence allows a value half a level (int8: 1/254 of its audit block's largest; int4: 1/14) from the exact
    robust mean, the most the codec's rounding moves it, and convicts beyond: all a lying reducer can move a value
    unseen."""
    _, _, inputs, exact = blockwise_reduction(0.0, rounded=False, values=values)
    half_level = value_error(values, float(exact[BLOCK:2 * BLOCK].abs().max()))
    _, within, _, nudged = blockwise_reduction(0.95 * half_level, rounded=False, values=values)
    reducer, beyond, _, shifted = blockwise_reduction(1.05 * half_level, rounded=False, values=values)
    assert false_block(within, inputs, nudged) is None
    assert false_block(beyond, inputs, shifted) == 1
    key = bytes(reducer.pubkey())
    assert proven_liar(evidence(PLACE, key, beyond, inputs, shifted, 1)) == (key, PLACE.prefix)
    assert proven_liar(evidence(PLACE, key, beyond, inputs, shifted, 0)) is None  # a true block proves nothing


def test_a_statement_naming_another_codec_than_the_run_s_is_refused() -> None:
    """A reducer that names int8 where the run sends float32 would widen what its evidence allows: no sender
    takes its part."""
    reducer, statement, _, result = blockwise_reduction(0.0)
    own = statement.entries[0]
    assert statement_refusal(statement, PLACE, bytes(reducer.pubkey()), result, own, INT8) == ""
    assert "names the codec int8, not the run's float32" in statement_refusal(
        statement, PLACE, bytes(reducer.pubkey()), result, own, FLOAT32)


# ----- real averagers -----

def int8_trio(make_grad_averager, codecs: tuple[GradValues, ...]) -> tuple[list, list, list[list[torch.Tensor]]]:
    """Three workers averaging a 384 × 256 gradient (several parts each) with audits at every round, in
    ``codecs`` (one each)."""
    shared = shared_gradient(384, 256)
    pairs = [gradient_pairs(i, shared) for i in (1, 2, 3)]
    averagers = [make_grad_averager(p, GradientSettings(GradAveraging.FULL, timeouts=TRIO, max_weight=16.0,
                                                        values=v), cls=averager_class())
                 for p, v in zip(pairs, codecs, strict=True)]
    values = [[t.clone() for _, t in p] for p in pairs]
    return averagers, gradient_round(averagers, values, [4.0, 4.0, 4.0]), values


def test_an_int8_group_ends_bit_identical_near_the_float32_average_and_its_audits_convict_no_one(
        make_grad_averager) -> None:
    averagers, results, values = int8_trio(make_grad_averager, (INT8, INT8, INT8))
    assert all(r is not None and r.complete and r.group_size == 3 and r.samples == 12 for r in results), results
    assert all(torch.equal(a, b) for v in values[1:] for a, b in zip(values[0], v, strict=True))
    assert lies_after(averagers, expected=1, wait=6.0) == []  # every reducer audited by both others
    pairs = [gradient_pairs(i, shared_gradient(384, 256)) for i in (1, 2, 3)]
    exact = [torch.stack([p[i][1] for p in pairs]).mean(0) for i in range(2)]  # alike peers: robust = mean
    for got, want in zip(values[0], exact, strict=True):
        inputs = float(max(p[i][1].abs().max() for p in pairs for i in range(2)))
        assert float((got - want).abs().max()) <= 2 * value_error(INT8, inputs)  # a sender's and a reducer's rounding


def test_a_sender_in_another_codec_is_refused_by_every_reducer_and_the_others_average(make_grad_averager) -> None:
    """A member sending float32 in an int8 run: each honest reducer bans it, and it takes no int8 result back. The
    honest two count their own samples only, and hold, value by value, either the same average of their two
    gradients (its values in none) or, where a shard did not come back in time, each its own gradient (a reducer
    waiting for the refused member's parts is as late as one waiting for a silent member)."""
    _, results, values = int8_trio(make_grad_averager, (INT8, INT8, FLOAT32))
    honest = results[:2]
    assert all(r is not None and r.status == AveragingStatus.AVERAGED and not r.complete for r in honest), results
    assert [r.samples for r in honest] == [8, 8]
    own = [[t for _, t in gradient_pairs(i, shared_gradient(384, 256))] for i in (1, 2, 3)]
    a, b = (torch.cat([t.reshape(-1) for t in v]) for v in values[:2])
    mine, theirs, refused = (torch.cat([t.reshape(-1) for t in v]) for v in own)
    alike, kept = a == b, (a == mine) & (b == theirs)
    assert bool((alike | kept).all())
    pair, trio = (mine + theirs) / 2, (mine + theirs + refused) / 3
    error = 2 * value_error(INT8, float(torch.stack([mine, theirs]).abs().max()))
    assert bool(((a - pair).abs()[alike] <= error).all())
    assert not bool(alike.any()) or float((a - trio).abs()[alike].max()) > 10 * error  # the refused part is in none


def test_demo_in_int8_steps_on_the_float32_signs_but_where_rounding_tips_a_near_zero_value(make_grad_averager) -> None:
    pairs = [alike(seed) for seed in (1, 2)]
    values = [grads(p) for p in pairs]
    expected, _ = demo_average([grads(p) for p in pairs])
    settings = dataclasses.replace(demo_settings(), values=INT8)
    averagers = [make_grad_averager(p, settings) for p in pairs]
    results = together(averagers, values, 0, [1.0, 1.0])
    assert [(r.status, r.complete) for r in results] == [(AveragingStatus.AVERAGED, True)] * 2
    assert all(torch.equal(a, b) for a, b in zip(values[0], values[1], strict=True))
    agree = float((values[0][0] == expected[0]).float().mean())
    assert agree > 0.95, agree
