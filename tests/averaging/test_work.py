"""The rule that credits a gradient round's weights with work (``client.averaging.work``), without the network:
what signed Backward headers prove, what drops a groupmate, how shared samples and floods are treated."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from solders.keypair import Keypair

from client.averaging.membership import Declared
from client.averaging.work import WorkRule, evidence, proven_samples, share_out
from client.pipeline.admission import GradientRefused
from client.pipeline.compute import StageCompute
from client.pipeline.optim import OptimizerConfig
from client.receipts import ReceiptRound, SignedReceipt
from tests.averagers import signed_backwards
from tests.pipeline.conftest import TINY, signed_request

TRAINER = Keypair()
TRAINERS = frozenset({bytes(TRAINER.pubkey())})
RULE = WorkRule("run", "body1", 16)


def proof(start: int, end: int, *, per: int = 2, trainer: Keypair = TRAINER, stage: str = "body1",
          kind: str = "backward") -> list:
    return evidence(signed_backwards(trainer, "run", stage, start, end, per=per, kind=kind))


def test_a_round_s_signed_backwards_prove_their_samples() -> None:
    assert proven_samples(proof(16, 22), RULE, 1, TRAINERS) == frozenset(range(16, 22))
    assert proven_samples([], RULE, 1, TRAINERS) == frozenset()


def test_a_weight_is_at_most_what_its_evidence_proves() -> None:
    body = {"round": 0, "weight": 16.0}
    assert Declared(b"k", body, frozenset(range(4))).weight == 4.0
    assert Declared(b"k", {**body, "weight": 3.0}, frozenset(range(4))).weight == 3.0  # it may claim less
    assert Declared(b"k", body).weight == 16.0  # no rule: the declared weight stands


def test_headers_that_prove_nothing_are_not_counted() -> None:
    """Signed by a key that is no trainer of the epoch, or for samples of another round: not counted, but not
    dropped (an honest worker may hold one)."""
    assert proven_samples(proof(0, 8, trainer=Keypair()), RULE, 0, TRAINERS) == frozenset()
    assert proven_samples(proof(16, 24), RULE, 0, TRAINERS) == frozenset()  # round 1's samples in round 0
    assert proven_samples(proof(14, 18, per=4), RULE, 0, TRAINERS) == frozenset()  # straddling two rounds
    assert proven_samples(proof(0, 4), RULE, 0, frozenset()) == frozenset()  # an epoch without trainers


def test_headers_whose_signature_does_not_hold_drop_the_groupmate() -> None:
    altered = proof(0, 2)
    altered[0][3] = 8
    other_run = evidence(signed_backwards(TRAINER, "other", "body1", 0, 2))
    for work, why in [(proof(0, 2, stage="body2"), "not signed"), (proof(0, 2, kind="forward"), "not signed"),
                      (altered, "not signed"), (other_run, "not signed")]:
        found = proven_samples(work, RULE, 0, TRAINERS)
        assert isinstance(found, str) and why in found, found


def test_a_flood_of_headers_is_refused_before_any_signature_is_checked() -> None:
    """More entries than the round has samples cannot all be honest: refused on their count alone (the entries
    here are not even well formed, so any signature check or parse would give another reason)."""
    found = proven_samples([None] * 100_000, RULE, 0, TRAINERS)
    assert found == "its evidence lists 100000 Backwards, more than the round's 16 samples"


def test_an_entry_s_size_is_bounded() -> None:
    """The largest entry the form admits (ids of 128 characters, 8 digests) stays under 2 KiB as JSON, so a
    declaration's evidence is under 2 KiB x the round's samples."""
    largest = proof(0, 1)[0]
    largest[1], largest[4] = "m" * 128, "d" * 128
    largest[6] = {f"tensor{i:026d}": "ab" * 32 for i in range(8)}
    assert isinstance(proven_samples([largest], RULE, 0, TRAINERS), str)  # well formed, but no longer signed
    assert len(json.dumps(largest, separators=(",", ":"))) < 2048
    largest[6]["one-too-many"] = "ab" * 32
    assert "malformed tensor digests" in proven_samples([largest], RULE, 0, TRAINERS)


def test_a_sample_k_groupmates_prove_credits_each_1_over_k() -> None:
    """A checked microbatch's Backward runs on two replicas: each is credited half its samples, and the group's
    credits total the distinct samples proved."""
    shared = share_out({"a": frozenset(range(0, 6)), "b": frozenset(range(4, 8)), "c": frozenset({5, 9})})
    assert shared == {"a": 4 + 1 / 2 + 1 / 3, "b": 2 + 1 / 2 + 1 / 3, "c": 1 + 1 / 3}
    assert sum(shared.values()) == len(set(range(0, 8)) | {9})
    body = {"round": 0, "weight": 16.0}
    assert Declared(b"k", body, frozenset(range(6)), credit=shared["a"]).weight == shared["a"]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
                           lambda inner: st.lists(inner, max_size=9) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=9), max_leaves=40)


@given(json_values)
def test_any_evidence_is_proved_or_refused_with_a_reason(work: object) -> None:
    found = proven_samples(work, RULE, 0, TRAINERS)
    assert found == frozenset() or isinstance(found, str)


@given(st.integers(0, 7), st.integers(0, 3), st.sampled_from(range(8)), st.text(min_size=1, max_size=4))
def test_a_changed_field_breaks_the_signature(start: int, length: int, field: int, junk: str) -> None:
    entry = proof(start, start + length + 1, per=length + 1)[0]
    original = entry[field]
    entry[field] = original + 1 if isinstance(original, int) else ({**original, "x": "ab" * 32} if isinstance(
        original, dict) else junk)
    if entry[field] != original:
        found = proven_samples([entry], RULE, 0, TRAINERS)
        assert isinstance(found, str) or found == frozenset(), found


def test_a_worker_s_accumulated_backwards_are_its_evidence() -> None:
    """A real ``StageCompute`` keeps the signed header of each Backward it accumulated — not of one its gradient
    bound refused — until its step; declared as evidence, they prove exactly the samples it differentiated."""
    trainer = Keypair()
    compute = StageCompute(TINY, "body1", OptimizerConfig(), uid="body1.0.0", run_id="run", max_batch_size=4)
    x, g = torch.randn(2, TINY.seq_len, TINY.d_model), torch.randn(2, TINY.seq_len, TINY.d_model)
    for start in (0, 4):
        request = compute.parse(signed_request(trainer, "body1", "Backward", {"input": x, "grad_output": g},
                                               run_id="run", start=start), backward=True)
        compute.backward(request, lambda work: SignedReceipt.sign(trainer, work, ReceiptRound("run", 0, 0)))
    refused = compute.parse(signed_request(trainer, "body1", "Backward", {"input": x, "grad_output": g * 1e30},
                                           run_id="run", start=8), backward=True)
    with pytest.raises(GradientRefused):
        compute.backward(refused, lambda work: SignedReceipt.sign(trainer, work, ReceiptRound("run", 0, 0)))
    rule = WorkRule("run", "body1", 16)
    assert proven_samples(evidence(compute.work), rule, 0, frozenset({bytes(trainer.pubkey())})) == {0, 1, 4, 5}
    compute.step()
    assert compute.work == []
