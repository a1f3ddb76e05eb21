"""The rule that credits a gradient round's weights with work (``client.averaging.work``), without the network:
what signed Backward headers prove, what drops a groupmate (a copy of another worker's headers included), how
shared samples and floods are treated."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from solders.keypair import Keypair

from client.averaging.membership import Declared
from client.averaging.work import WorkRule, evidence, proven_samples
from client.pipeline.admission import GradientRefused
from client.pipeline.compute import StageCompute, StageRequest
from client.pipeline.optim import OptimizerConfig
from client.pipeline.rpc import InvalidRequest
from client.receipts import ReceiptRound, SignedReceipt
from tests.averagers import signed_backwards
from tests.pipeline.conftest import TINY, signed_request

TRAINER, WORKER = Keypair(), Keypair()
TRAINERS = frozenset({bytes(TRAINER.pubkey())})
RULE = WorkRule("run", "body1", 16)


def proof(start: int, end: int, *, per: int = 2, trainer: Keypair = TRAINER, stage: str = "body1",
          kind: str = "backward", worker: Keypair = WORKER) -> list:
    return evidence(signed_backwards(trainer, "run", stage, start, end, per=per, kind=kind, worker=worker))


def proven(work: object, round_: int = 0, trainers: frozenset[bytes] = TRAINERS, worker: Keypair = WORKER) -> object:
    """What ``work``, declared by ``worker``, proves of round ``round_``."""
    return proven_samples(work, RULE, round_, trainers, bytes(worker.pubkey()))


def test_a_round_s_signed_backwards_prove_their_samples() -> None:
    assert proven(proof(16, 22), 1) == frozenset(range(16, 22))
    assert proven([], 1) == frozenset()


def test_a_weight_is_at_most_what_its_evidence_proves() -> None:
    body = {"round": 0, "weight": 16.0}
    assert Declared(b"k", body, frozenset(range(4))).weight == 4.0
    assert Declared(b"k", {**body, "weight": 3.0}, frozenset(range(4))).weight == 3.0  # it may claim less
    assert Declared(b"k", body).weight == 16.0  # no rule: the declared weight stands


def test_headers_that_prove_nothing_are_not_counted() -> None:
    """Signed by a key that is no trainer of the epoch, or for samples of another round: not counted, but not
    dropped (an honest worker may hold one)."""
    assert proven(proof(0, 8, trainer=Keypair())) == frozenset()
    assert proven(proof(16, 24)) == frozenset()  # round 1's samples in round 0
    assert proven(proof(14, 18, per=4)) == frozenset()  # straddling two rounds
    assert proven(proof(0, 4), trainers=frozenset()) == frozenset()  # an epoch without trainers


def test_headers_whose_signature_does_not_hold_drop_the_groupmate() -> None:
    altered = proof(0, 2)
    altered[0][3] = 8
    other_run = evidence(signed_backwards(TRAINER, "other", "body1", 0, 2, worker=WORKER))
    for work, why in [(proof(0, 2, stage="body2"), "not signed"), (proof(0, 2, kind="forward"), "not signed"),
                      (altered, "not signed"), (other_run, "not signed")]:
        found = proven(work)
        assert isinstance(found, str) and why in found, found


def test_a_header_copied_from_another_worker_drops_the_copier() -> None:
    """Every groupmate sees the others' evidence gathered. A copier declaring another worker's headers, alone or
    among headers signed for itself, is dropped like a forger: each copied header names the worker it was sent to,
    so its signature does not hold for the copier. (On the old code headers named no worker: the copy proved its
    samples, credited half to the copier and half to the worker it copied.)"""
    honest, copier = proof(0, 4), Keypair()
    assert proven(honest) == frozenset(range(4))  # its own worker proves it
    for work in (honest, [*proof(4, 6, worker=copier), *honest]):
        found = proven(work, worker=copier)
        assert isinstance(found, str) and "copied from another worker" in found, found


def test_a_flood_of_headers_is_refused_before_any_signature_is_checked() -> None:
    """More entries than the round has samples cannot all be honest: refused on their count alone (the entries
    here are not even well formed, so any signature check or parse would give another reason)."""
    found = proven([None] * 100_000)
    assert found == "its evidence lists 100000 Backwards, more than the round's 16 samples"


def test_an_entry_s_size_is_bounded() -> None:
    """The largest entry the form admits (ids of 128 characters, 8 digests) stays under 2 KiB as JSON, so a
    declaration's evidence is under 2 KiB x the round's samples."""
    largest = proof(0, 1)[0]
    largest[1], largest[4] = "m" * 128, "d" * 128
    largest[6] = {f"tensor{i:026d}": "ab" * 32 for i in range(8)}
    assert isinstance(proven([largest]), str)  # well formed, but no longer signed
    assert len(json.dumps(largest, separators=(",", ":"))) < 2048
    largest[6]["one-too-many"] = "ab" * 32
    assert "malformed tensor digests" in proven([largest])


def test_a_sample_two_replicas_differentiated_credits_each_in_full() -> None:
    """A checked microbatch's Backward runs on two replicas (and a retried one may run on two workers): the trainer
    signs a header for each, naming it, and each holds the sample in its gradient sum, so each proves it and is
    credited its whole work, as its declared weight says."""
    first, second = Keypair(), Keypair()
    samples = {key: proven([*proof(0, 4, worker=key), *proof(4 + 4 * i, 8 + 4 * i, worker=key)], worker=key)
               for i, key in enumerate((first, second))}
    assert samples == {first: frozenset(range(8)), second: frozenset(range(4)) | frozenset(range(8, 12))}
    body = {"round": 0, "weight": 8.0}
    assert [Declared(b"k", body, proved).weight for proved in samples.values()] == [8.0, 8.0]


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
                           lambda inner: st.lists(inner, max_size=9) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=9), max_leaves=40)


@given(json_values)
def test_any_evidence_is_proved_or_refused_with_a_reason(work: object) -> None:
    found = proven(work)
    assert found == frozenset() or isinstance(found, str)


@given(st.integers(0, 7), st.integers(0, 3), st.sampled_from(range(8)), st.text(min_size=1, max_size=4))
def test_a_changed_field_breaks_the_signature(start: int, length: int, field: int, junk: str) -> None:
    entry = proof(start, start + length + 1, per=length + 1)[0]
    original = entry[field]
    entry[field] = original + 1 if isinstance(original, int) else ({**original, "x": "ab" * 32} if isinstance(
        original, dict) else junk)
    if entry[field] != original:
        found = proven([entry])
        assert isinstance(found, str) or found == frozenset(), found


def test_a_worker_s_accumulated_backwards_are_its_evidence() -> None:
    """A real ``StageCompute`` keeps the signed header of each Backward it accumulated — not of one its gradient
    bound refused, nor of one signed for another worker, which it refuses before computing — until its step;
    declared as evidence, they prove exactly the samples it differentiated."""
    trainer, worker = Keypair(), Keypair()
    compute = StageCompute(TINY, "body1", OptimizerConfig(), uid="body1.0.0", run_id="run", max_batch_size=4,
                           signer=worker)
    x, g = torch.randn(2, TINY.seq_len, TINY.d_model), torch.randn(2, TINY.seq_len, TINY.d_model)

    def backward(start: int, scale: float = 1.0, to: Keypair = worker) -> StageRequest:
        return compute.parse(signed_request(trainer, "body1", "Backward", {"input": x, "grad_output": g * scale},
                                            run_id="run", start=start, worker=bytes(to.pubkey())), backward=True)

    for start in (0, 4):
        compute.backward(backward(start), lambda work: SignedReceipt.sign(worker, work, ReceiptRound("run", 0, 0)))
    with pytest.raises(GradientRefused):
        compute.backward(backward(8, 1e30), lambda work: SignedReceipt.sign(worker, work, ReceiptRound("run", 0, 0)))
    with pytest.raises(InvalidRequest, match="sent to worker"):
        backward(12, to=Keypair())
    rule = WorkRule("run", "body1", 16)
    trainers = frozenset({bytes(trainer.pubkey())})
    assert proven_samples(evidence(compute.work), rule, 0, trainers, bytes(worker.pubkey())) == {0, 1, 4, 5}
    compute.step()
    assert compute.work == []
