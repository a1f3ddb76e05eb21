"""Checked data: a trainer that sends tokens other than the run's dataset at the samples it signed for is refused by
the real gRPC head (or tail) worker, which keeps its signed request; that evidence convicts it in every witness's
proof (the real judge, the real dataset), so it earns nothing and the coordinator's health check removes it (the
real specification). No evidence convicts an honest trainer, whoever builds it."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from solders.keypair import Keypair

from client.contributor.accusing import Convictions
from client.contributor.context import ClientContext, RunnerOptions
from client.data import open_byte_dataset
from client.pipeline.admission import read_header
from client.pipeline.compute import MAX_ID_CHARS
from client.pipeline.datacheck import DataCheck, WrongData, proven
from client.pipeline.discovery import WorkerDirectory
from client.pipeline.messages import decode_message
from client.pipeline.router import PipelineError
from client.pipeline.rpc import StageClient
from client.pipeline.trainer import PipelineTrainer
from client.pipeline.worker import StageWorker
from client.witness.data_accusations import CONVICTED, DataAccusation, convict
from client.witness.judge import judge_round, unhealthy_clients
from client.witness.records import Presence
from coordinator_program.spec import derived, rules
from coordinator_program.spec.state import Role
from tests.adversarial.hostile import OtherText
from tests.pipeline.conftest import TINY, signed_request
from tests.spec.scenario import SMALL, finish_round
from tests.witness.rounds import honest_round, run_with_keys, shares

RUN = "checked-data"
DATASET = open_byte_dataset(["stdlib"], TINY.seq_len)


def windows(start: int, end: int) -> torch.Tensor:
    return DATASET.batch(list(range(start, end)))


def call(client: StageClient, method: str, payload: bytes) -> bytes:
    return client.call(method, payload, timeout=30)


@pytest.fixture(scope="module")
def stages():
    """A real head and tail, each checking the tokens it receives against the stdlib dataset."""
    workers = {s: StageWorker(TINY, s, run_id=RUN, data_check=DataCheck(DATASET, TINY.vocab, s)).start()
               for s in ("head", "tail")}
    clients = {s: StageClient(w.address, max_message_bytes=64 << 20) for s, w in workers.items()}
    yield workers, clients
    for client in clients.values():
        client.close()
    for worker in workers.values():
        worker.stop(grace=0)


def test_the_head_refuses_other_tokens_and_keeps_evidence_anyone_can_check(stages) -> None:
    """The hostile trainer sends real text, another sample's, under samples 40-42: plausible but not the run's."""
    workers, clients = stages
    honest, hostile = Keypair(), Keypair()
    right, other = windows(40, 42)[:, :-1], windows(90, 92)[:, :-1]
    for encoding in (torch.uint8, torch.int64):  # both encodings a trainer may send tokens in
        payload = signed_request(honest, "head", "Forward", {"input": right.to(encoding)}, run_id=RUN, start=40,
                                 worker=workers["head"].pubkey)
        assert decode_message(call(clients["head"], "Forward", payload), max_elements=1 << 20)[1]["output"].shape \
            == (2, TINY.seq_len, TINY.d_model)
    assert workers["head"].drain_accusations() == []

    payload = signed_request(hostile, "head", "Forward", {"input": other.to(torch.uint8)}, run_id=RUN, start=40,
                             worker=workers["head"].pubkey)
    with pytest.raises(grpc.RpcError) as refused:
        call(clients["head"], "Forward", payload)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input of samples 40-42 is not the run's dataset" in refused.value.details()
    [evidence] = workers["head"].drain_accusations()
    assert proven(evidence, DATASET, TINY.vocab, RUN) == bytes(hostile.pubkey())
    assert proven(evidence, DATASET, TINY.vocab, "another-run") is None, "evidence counts in its own run only"


def test_the_tail_refuses_other_targets(stages) -> None:
    workers, clients = stages
    hostile = Keypair()
    hidden = torch.randn(2, TINY.seq_len, TINY.d_model)
    targets = windows(7, 9)[:, 1:].flip(1).to(torch.uint8)  # the right bytes, backwards
    payload = signed_request(hostile, "tail", "Backward", {"input": hidden, "targets": targets}, run_id=RUN, start=7,
                             worker=workers["tail"].pubkey)
    with pytest.raises(grpc.RpcError, match="targets of samples 7-9 is not the run's dataset"):
        call(clients["tail"], "Backward", payload)
    [evidence] = workers["tail"].drain_accusations()
    assert proven(evidence, DATASET, TINY.vocab, RUN) == bytes(hostile.pubkey())
    assert workers["tail"].compute.samples_accumulated == 0, "nothing was computed for it"


def honest_evidence(stage: str = "head", start: int = 40) -> WrongData:
    """What a worker holds of an honest trainer's request: its signed header and signature."""
    tensors = {"input": windows(start, start + 2)[:, :-1].to(torch.uint8)}
    if stage != "head":
        tensors = {"input": torch.randn(2, TINY.seq_len, TINY.d_model), "targets": windows(start, start + 2)[:, 1:]}
    meta, sent = decode_message(signed_request(Keypair(), stage, "Forward", tensors, run_id=RUN, start=start,
                                               worker=bytes(Keypair().pubkey())), max_elements=1 << 20)
    header = read_header(meta, sent, "forward", MAX_ID_CHARS)  # as the worker reads it
    return WrongData(header.message().decode(), str(meta["signature"]))


def test_no_evidence_convicts_an_honest_trainer() -> None:
    """A hostile worker quotes an honest request, edits it, or makes one up: none proves anything."""
    for stage in ("head", "tail"):
        evidence = honest_evidence(stage)
        assert evidence.signed(), "the quoted request is the trainer's own"
        assert proven(evidence, DATASET, TINY.vocab, RUN) is None
    evidence = honest_evidence()
    fields = json.loads(evidence.request)
    fields["digests"]["input"] = "0" * 64  # a wrong digest the trainer never signed
    edited = WrongData(json.dumps(fields, sort_keys=True, separators=(",", ":")), evidence.signature)
    assert not edited.signed() and proven(edited, DATASET, TINY.vocab, RUN) is None
    fields = json.loads(evidence.request)
    fields["stage"] = "body1"
    assert proven(WrongData(json.dumps(fields), evidence.signature), DATASET, TINY.vocab, RUN) is None
    for junk in ("", "{", "[]", json.dumps({"domain": "x"}), evidence.request + " "):
        assert proven(WrongData(junk, evidence.signature), DATASET, TINY.vocab, RUN) is None
    assert proven(dataclasses.replace(evidence, signature="zz"), DATASET, TINY.vocab, RUN) is None


def client_context() -> ClientContext:
    """What a witness's ``Convictions`` reads: its options (where the dataset is, how much it may fetch)."""
    return ClientContext(backend=None, keypair=Keypair(), options=RunnerOptions(role=Role.Worker, initial_peers=[]),
                         tasks=None)  # type: ignore[arg-type]


async def witnesses_prove(state, keys, commitments, reports, presences, accusations) -> dict[bytes, object]:
    """Every elected witness judges the round with the real judge and convicts with the real dataset, then sends
    its proof to the specification; returns each witness's evidence."""
    found = {}
    for witness in derived.witnesses(state):
        evidence = judge_round(state, commitments, reports, presences)
        convict(evidence, await Convictions(client_context()).convicted(state, accusations))
        [(participants, batches)] = evidence.filters(state)
        rules.witness(state, witness, state.round.height, participants, batches)
        found[witness] = evidence
    return found


def test_a_convicted_trainer_earns_nothing_and_the_health_check_removes_it() -> None:
    """The hostile trainer publishes a presence each round (which alone keeps a stalled trainer in the run) and
    sends the real head worker another sample's text for its first microbatch; the head's accusation convicts it."""
    state, keys = run_with_keys()
    honest, hostile = shares(state)
    commitments, reports = honest_round(state, keys)
    del commitments[hostile.client.hex()]  # the head refused it: its share never completed
    presences = {s.client.hex(): Presence.create(keys[s.client], run_id=state.run_id, epoch=state.epoch,
                                                 round=state.round.height) for s in (honest, hostile)}
    seq_len = state.model.seq_len
    dataset = open_byte_dataset(["stdlib"], seq_len)
    config = dataclasses.replace(TINY, seq_len=seq_len)
    head_key = next(keys[c.id] for c in state.clients if c.role == Role.Worker and c.stage == 0)
    run = derived.run_instance(state)
    head = StageWorker(config, "head", run_id=run, data_check=DataCheck(dataset, config.vocab, "head")).start()
    client = StageClient(head.address, max_message_bytes=64 << 20)
    try:
        start = hostile.start
        other = dataset.batch([start + 5, start + 6])[:, :-1].to(torch.uint8)
        payload = signed_request(keys[hostile.client], "head", "Forward", {"input": other}, run_id=run, start=start,
                                 worker=head.pubkey)
        with pytest.raises(grpc.RpcError, match="not the run's dataset"):
            client.call("Forward", payload, timeout=30)
        evidence = head.drain_accusations()
    finally:
        client.close()
        head.stop(grace=0)
    accusation = DataAccusation.create(head_key, run_id=state.run_id, epoch=state.epoch, round=state.round.height,
                                   evidence=tuple({"request": e.request, "signature": e.signature} for e in evidence))
    accusations = {accusation.author: DataAccusation.from_value(accusation.to_value())}  # as read back from the DHT

    proofs = asyncio.run(witnesses_prove(state, keys, commitments, reports, presences, accusations))
    for evidence_ in proofs.values():
        assert hostile.client not in evidence_.participants and evidence_.why_missing[hostile.client] == CONVICTED
        assert honest.client in evidence_.computed and evidence_.complete, "nothing waits for the convicted share"
    now = SMALL.warmup_time
    rules.tick(state, now, 7)  # the quorum of proofs ends the round's training
    now += SMALL.round_witness_time
    rules.tick(state, now, 7)
    points = {e.id: e.total for e in state.ledger}
    assert points.get(hostile.client, 0) == 0 and points[honest.client] > 0
    assert unhealthy_clients(state) == [hostile.client], "a quorum of proofs left it out"
    rules.health_check(state, derived.witnesses(state)[0], hostile.client)
    finish_round(state, now, 8, members=[c.id for c in state.clients if c.id != hostile.client])
    assert hostile.client not in {c.id for c in state.clients} and honest.client in {c.id for c in state.clients}


def test_an_honest_trainer_is_never_refused_and_a_hostile_one_never_served(dht, run_id: str) -> None:
    """The real trainer through three real workers, the head and the tail checking: the honest trainer's
    microbatches all complete with no accusation; the hostile one's first call fails at the head, accused."""
    checks = {"head": DataCheck(DATASET, TINY.vocab, "head"), "tail": DataCheck(DATASET, TINY.vocab, "tail")}
    workers = [StageWorker(TINY, s, dht=dht, run_id=run_id, data_check=checks.get(s)).start()
               for s in ("head", "body1", "tail")]
    directory = WorkerDirectory(dht, run_id, TINY.fingerprint())
    trainers = [PipelineTrainer(TINY, data, directory, run_id=run_id, stall_timeout=30.0, refresh_period=0.5,
                                max_attempts=2) for data in (DATASET, OtherText(DATASET))]
    try:
        result = trainers[0].train(list(range(0, 8)), 2)
        assert len(result.microbatches) == 4 and workers[0].compute.samples_accumulated == 8
        assert all(w.drain_accusations() == [] for w in workers), "no honest request is refused"
        with pytest.raises(PipelineError, match="not the run's dataset"):
            trainers[1].train([8, 9], 2)
        [evidence] = workers[0].drain_accusations()
        assert proven(evidence, DATASET, TINY.vocab, run_id) == bytes(trainers[1].keypair.pubkey())
        assert workers[0].compute.samples_accumulated == 8, "nothing of the hostile trainer's was computed"
    finally:
        for trainer in trainers:
            trainer.close()
        for worker in workers:
            worker.stop(grace=0)


def test_a_trainer_cannot_claim_another_trainers_samples_first() -> None:
    """Samples outside the claimer's share of the round, even with the dataset's own tokens, are refused (and not
    accused: a worker that has not yet seen the round open refuses an honest trainer the same way, for a retry), so
    a trainer cannot take another's samples first and have that trainer's Backward of them refused as a repeat."""
    victim, thief = Keypair(), Keypair()
    tail = StageWorker(TINY, "tail", run_id=RUN, data_check=DataCheck(DATASET, TINY.vocab, "tail")).start()
    client = StageClient(tail.address, max_message_bytes=64 << 20)
    tail.ledger.expect_samples(100, 110, {bytes(victim.pubkey()).hex(): (100, 105),
                                          bytes(thief.pubkey()).hex(): (105, 110)})

    def backward(trainer: Keypair, start: int) -> bytes:
        tensors = {"input": torch.randn(2, TINY.seq_len, TINY.d_model),
                   "targets": windows(start, start + 2)[:, 1:].to(torch.uint8)}
        return call(client, "Backward", signed_request(trainer, "tail", "Backward", tensors, run_id=RUN, start=start,
                                                       worker=tail.pubkey))

    try:
        with pytest.raises(grpc.RpcError, match="not this trainer's share of the round") as refused:
            backward(thief, 100)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        backward(victim, 100)  # the victim's own samples are still its to train
        backward(thief, 105)
        assert tail.drain_accusations() == [] and tail.compute.samples_accumulated == 4
    finally:
        client.close()
        tail.stop(grace=0)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


SIGNER = Keypair()


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(["domain", "run_id", "stage", "kind", "microbatch_id", "sample_start",
                                                "sample_end", "dtype", "issued_at", "digests"]), JSON, max_size=4))
def test_no_quoted_request_makes_a_witness_fail(changes: dict) -> None:
    """Whatever a trainer signs and someone quotes as evidence (here a trainer accusing itself with a header of its
    own making, to stop the witnesses), checking it returns a verdict, never an error that would stop a witness
    from sending its proof."""
    fields = {**json.loads(honest_evidence().request), "trainer": bytes(SIGNER.pubkey()).hex(), **changes}
    request = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    signature = bytes(SIGNER.sign_message(request.encode())).hex()
    assert proven(WrongData(request, signature), DATASET, TINY.vocab, RUN) in (None, bytes(SIGNER.pubkey()))
