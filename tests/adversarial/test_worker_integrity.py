"""Attacks on a stage worker's parameters over real gRPC on loopback: hostile gradients (overflowing, huge,
mixed among honest ones, first on a fresh worker, ratcheted, or zero to pull the bound down), Backwards
without their Forward or replayed (to the same worker or to another of the stage), requests unsigned, badly
signed, signed by a trainer the worker does not serve or for another run, and an optimizer step that would
leave the stage non-finite; and honest gradients the bound must not refuse (a loss spike, early training's
growth).

Each test drives a real ``StageWorker`` of the tiny model through its gRPC surface, as a trainer (honest or
not) would, and checks the stage's parameters and optimizer state afterwards. Where honest gradients must
survive an attack, a twin worker (same seed, so same initial parameters) receives the same honest
backwards without the hostile one, and both must end with identical parameters.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from solders.keypair import Keypair

from client.pipeline.admission import MAX_REQUEST_AGE, TrainerAllowed, any_signed_trainer, now_ms
from client.pipeline.messages import decode_message, encode_message
from client.pipeline.rpc import StageClient
from client.pipeline.worker import StageWorker
from tests.pipeline.conftest import TINY, signed_request

RUN = "integrity"
B, T, D = 2, TINY.seq_len, TINY.d_model
_generator = torch.Generator().manual_seed(11)
_microbatches = itertools.count()


def hidden(scale: float = 1.0) -> torch.Tensor:
    return torch.randn(B, T, D, generator=_generator) * scale


class Wire:
    """A trainer's side of one worker's gRPC connection, honest or not: requests signed with its keypair."""

    def __init__(self, worker: StageWorker, keypair: Keypair | None = None) -> None:
        self.worker = worker
        self.keypair = keypair or Keypair()
        self.client = StageClient(worker.address, max_message_bytes=64 << 20)

    def request(self, method: str, tensors: dict[str, torch.Tensor], **options: object) -> bytes:
        stage = self.worker.stage
        return signed_request(self.keypair, stage, method, tensors, run_id=RUN, worker=self.worker.pubkey,
                              **options)  # type: ignore[arg-type]

    def send(self, method: str, payload: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
        return decode_message(self.client.call(method, payload, timeout=30), max_elements=1 << 20)

    def refused(self, method: str, payload: bytes) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as raised:
            self.client.call(method, payload, timeout=30)
        return raised.value

    def forward(self, inputs: torch.Tensor, microbatch: str, start: int = 0) -> torch.Tensor:
        _, out = self.send("Forward", self.request("Forward", {"input": inputs}, microbatch=microbatch, start=start))
        return out["output"]

    def backward_request(self, inputs: torch.Tensor, grad: torch.Tensor, microbatch: str, start: int = 0) -> bytes:
        return self.request("Backward", {"input": inputs, "grad_output": grad}, microbatch=microbatch, start=start)

    def microbatch(self, inputs: torch.Tensor, grad: torch.Tensor) -> None:
        """Forward then Backward of one microbatch, as the trainer sends them."""
        name = f"mb{next(_microbatches)}"
        self.forward(inputs, name)
        self.send("Backward", self.backward_request(inputs, grad, name))

    def attack(self, inputs: torch.Tensor, grad: torch.Tensor) -> grpc.RpcError:
        """A Forward (a hostile trainer is a trainer), then a Backward with a hostile gradient: refused."""
        name = f"mb{next(_microbatches)}"
        self.forward(inputs, name)
        return self.refused("Backward", self.backward_request(inputs, grad, name))

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def start() -> Iterator[Callable[..., StageWorker]]:
    """Start body1 workers of run RUN on loopback (no DHT: only the RPC surface is attacked)."""
    started: list[StageWorker] = []

    def make(trainer_allowed: TrainerAllowed = any_signed_trainer, **options: object) -> StageWorker:
        worker = StageWorker(
            TINY, "body1", run_id=RUN, max_batch_size=4, trainer_allowed=trainer_allowed, **options  # type: ignore[arg-type]
        )
        started.append(worker.start())
        return worker

    yield make
    for worker in started:
        worker.stop(grace=0)


def snapshot(worker: StageWorker) -> list[torch.Tensor]:
    with worker.compute.lock:
        return [p.detach().clone() for p in worker.parameters()]


def all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def honest_batch(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, grad_output) pairs at the scale a real trainer sends (per-sample gradient norm about 0.25)."""
    return [(hidden(), hidden(0.01)) for _ in range(count)]


@pytest.mark.parametrize("scale", [3e38, 1e30, 1e18, 1e6], ids=["3e38", "1e30", "1e18", "1e6"])
def test_hostile_gradient_is_refused_and_the_honest_ones_of_the_step_apply(start, scale: float) -> None:
    """Honest backwards, then a hostile one whose grad_output is finite but huge: 3e38 overflows the
    parameter gradients to infinity (and, applied, left every parameter NaN); 1e18 and 1e30 make the fp32
    gradient norm infinite, so clipping zeroed the honest gradients too; 1e6 is merely far out of line. The
    hostile Backward is refused and the step applies exactly the honest gradients, as on a twin that never
    saw the attack; every later Forward is finite."""
    worker, twin = start(), start()
    honest, twin_honest, hostile = Wire(worker), Wire(twin), Wire(worker)
    batch = honest_batch(3)
    for inputs, grad in batch:
        honest.microbatch(inputs, grad)
        twin_honest.microbatch(inputs, grad)
    error = hostile.attack(hidden(), torch.full((B, T, D), scale))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Backward refused" in error.details()
    assert worker.compute.samples_accumulated == 3 * B
    assert len(worker.drain_receipts()) == 3  # no receipt for the refused contribution
    assert worker.step().applied and twin.step().applied
    after = snapshot(worker)
    assert all_finite(after)
    assert all(torch.equal(a, b) for a, b in zip(after, snapshot(twin), strict=True))
    output = honest.forward(hidden(), "later")
    assert bool(torch.isfinite(output).all())


def test_one_hostile_backward_among_eight_honest_ones_changes_nothing(start) -> None:
    """Eight honest backwards from four trainers, and in their midst one from a hostile trainer whose
    gradient is 10⁶ times theirs: refused, and the step equals the twin's, which saw only the honest eight."""
    worker, twin = start(), start()
    trainers = [(Wire(worker, key), Wire(twin, key)) for key in (Keypair() for _ in range(4))]
    hostile = Wire(worker)
    for position, (inputs, grad) in enumerate(honest_batch(8)):
        if position == 4:
            error = hostile.attack(inputs, grad * 1e6)
            assert "exceeds this stage's bound" in error.details()
        on_worker, on_twin = trainers[position % 4]
        on_worker.microbatch(inputs, grad)
        on_twin.microbatch(inputs, grad)
    assert worker.step().samples == twin.step().samples == 8 * B
    assert all(torch.equal(a, b) for a, b in zip(snapshot(worker), snapshot(twin), strict=True))


def test_hostile_first_request_cannot_poison_a_fresh_worker(start) -> None:
    """A fresh worker has no recent gradients to compare with: a hostile FIRST Backward (1e18) is refused by
    the fresh bound, and the honest backwards that follow train the stage as on the twin."""
    worker, twin = start(), start()
    error = Wire(worker).attack(hidden(), torch.full((B, T, D), 1e18))
    assert "no contribution accepted yet" in error.details()
    honest, twin_honest = Wire(worker), Wire(twin)
    for inputs, grad in honest_batch(3):
        honest.microbatch(inputs, grad)
        twin_honest.microbatch(inputs, grad)
    worker.step(), twin.step()
    assert all(torch.equal(a, b) for a, b in zip(snapshot(worker), snapshot(twin), strict=True))


def accumulated(worker: StageWorker) -> torch.Tensor:
    """The stage's accumulated parameter gradient, flattened (zeros where nothing was accumulated)."""
    with worker.compute.lock:
        params = worker.compute.optimizer.params
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def test_an_honest_loss_spike_of_one_of_two_trainers_is_accepted_at_a_bounded_weight(start) -> None:
    """Two honest trainers; then one's microbatch spikes 300-fold (a loss spike on its data). The rule before
    (refuse above 100 × the lower median, here the other trainer's norm) refused it on every retry; it is now
    accepted, scaled to 100 × the stage's reference per sample, and the step applies finite."""
    worker = start()
    first, second = Wire(worker), Wire(worker)
    for inputs, grad in honest_batch(3):
        first.microbatch(inputs, grad)
        second.microbatch(inputs, grad)
    reference, before = worker.compute.bound.reference(), accumulated(worker)
    inputs, grad = honest_batch(1)[0]
    first.microbatch(inputs, grad * 300)
    weight = float(torch.linalg.vector_norm(accumulated(worker) - before)) / B
    assert 99 * reference < weight < 101 * reference
    assert worker.compute.samples_accumulated == 7 * B and len(worker.drain_receipts()) == 7
    assert worker.info()["gradients_scaled"] == 1 and worker.info()["gradients_refused"] == 0
    assert worker.step().applied and all_finite(snapshot(worker))


def test_a_lone_trainer_s_early_training_growth_is_accepted(start) -> None:
    """One trainer whose gradients grow 200-fold from one step to the next (as the head's did early in
    bench_pipeline.py, where the rule before refused them): every Backward is accepted, the first ones at a
    bounded weight, and the reference follows within a window."""
    worker = start()
    trainer = Wire(worker)
    for inputs, grad in honest_batch(3):
        trainer.microbatch(inputs, grad)
    assert worker.step().applied
    reference = worker.compute.bound.reference()
    for inputs, grad in honest_batch(6):
        trainer.microbatch(inputs, grad * 200)
    assert worker.compute.samples_accumulated == 6 * B
    assert worker.info()["gradients_refused"] == 0 and worker.info()["gradients_scaled"] >= 1
    assert worker.compute.bound.reference() > 100 * reference
    assert worker.step().applied and all_finite(snapshot(worker))


def test_one_of_two_trainers_cannot_shut_the_other_out_with_zero_gradients(start) -> None:
    """With two trainers the reference is the smaller vote: a trainer sending zero gradients (its grad_output
    all zeros) pulled it to 0, and the rule before then refused every honest Backward. The honest trainer's
    Backwards are now accepted as they came."""
    worker = start()
    honest, hostile = Wire(worker), Wire(worker)
    honest.microbatch(hidden(), hidden(0.01))
    for _ in range(5):
        hostile.microbatch(hidden(), torch.zeros(B, T, D))
    assert worker.compute.bound.reference() == 0
    before = accumulated(worker)
    for inputs, grad in honest_batch(3):
        honest.microbatch(inputs, grad)
    assert worker.compute.samples_accumulated == 9 * B
    assert worker.info()["gradients_scaled"] == 0 and bool((accumulated(worker) != before).any())


def test_one_of_four_trainers_cannot_ratchet_its_way_to_a_sustained_huge_gradient(start) -> None:
    """Three honest trainers and one that climbs 10-fold per Backward up to 10⁴ × theirs: each climb is
    accepted only scaled to 100 × the honest reference, the reference does not move, and a sustained 10⁶-fold
    gradient is then refused on every try."""
    worker = start()
    honest = [Wire(worker) for _ in range(3)]
    hostile = Wire(worker)
    for inputs, grad in honest_batch(6):
        for trainer in honest:
            trainer.microbatch(inputs, grad)
    reference = worker.compute.bound.reference()
    for power in range(5):
        before = accumulated(worker)
        inputs, grad = honest_batch(1)[0]
        hostile.microbatch(inputs, grad * 10**power)
        assert float(torch.linalg.vector_norm(accumulated(worker) - before)) / B < 101 * reference
    assert worker.compute.bound.reference() == reference
    for _ in range(10):
        inputs, grad = honest_batch(1)[0]
        assert "exceeds this stage's bound" in hostile.attack(inputs, grad * 1e6).details()
    assert worker.info()["gradients_refused"] == 10


def test_backward_without_its_own_forward_is_refused(start) -> None:
    """No Forward at all; a Forward of other input or other samples; another trainer's Forward of the same
    microbatch id; and a Forward before the last step: no ticket, no Backward."""
    worker = start()
    trainer, other = Wire(worker), Wire(worker)
    inputs, grad = hidden(), hidden(0.01)
    cases = {
        "never": lambda: None,
        "other input": lambda: trainer.forward(hidden(), "other input"),
        "other samples": lambda: trainer.forward(inputs, "other samples", start=B),
        "other trainer": lambda: other.forward(inputs, "other trainer"),
        "before the step": lambda: (trainer.forward(inputs, "before the step"), worker.step()),
    }
    for name, prepare in cases.items():
        prepare()
        error = trainer.refused("Backward", trainer.backward_request(inputs, grad, name))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, name
        assert "Forward" in error.details(), (name, error.details())
    assert worker.compute.samples_accumulated == 0 and worker.drain_receipts() == []


def test_replayed_backward_is_refused(start) -> None:
    """A captured Backward sent again, alone or after its captured Forward, adds nothing: the first one
    consumed the ticket and claimed the microbatch. The same holds for the tail, which needs no ticket."""
    worker = start()
    trainer = Wire(worker)
    inputs, grad = hidden(), hidden(0.01)
    forward = trainer.request("Forward", {"input": inputs}, microbatch="once")
    backward = trainer.backward_request(inputs, grad, "once")
    trainer.send("Forward", forward)
    trainer.send("Backward", backward)
    assert "already differentiated" in trainer.refused("Backward", backward).details()
    trainer.send("Forward", forward)  # harmless by itself: it computes, and changes nothing
    assert "already differentiated" in trainer.refused("Backward", backward).details()
    assert worker.compute.samples_accumulated == B and len(worker.drain_receipts()) == 1

    tail = StageWorker(TINY, "tail", run_id=RUN, max_batch_size=4).start()
    try:
        to_tail = Wire(tail)
        targets = torch.randint(0, 256, (B, T), dtype=torch.uint8, generator=_generator)
        tail_backward = to_tail.request("Backward", {"input": inputs, "targets": targets}, microbatch="once")
        to_tail.send("Backward", tail_backward)
        assert "already differentiated" in to_tail.refused("Backward", tail_backward).details()
        assert tail.compute.samples_accumulated == B
    finally:
        tail.stop(grace=0)


def test_a_request_replayed_to_another_worker_of_the_stage_is_refused(start) -> None:
    """A trainer's Forward and Backward to one body1 worker, captured and sent to another body1 worker (before
    and after the first served them, and with the metadata's worker relabelled): the other worker computes
    nothing, accumulates nothing and signs no receipt, since each request names the worker it was signed for.
    (On the old code the replayed Forward was served and left a ticket, and the replayed Backward was accumulated
    and receipted by the second worker.)"""
    intended, other = start(), start()
    trainer = Wire(intended)
    inputs, grad = hidden(), hidden(0.01)
    forward = trainer.request("Forward", {"input": inputs}, microbatch="replayed")
    backward = trainer.backward_request(inputs, grad, "replayed")
    elsewhere = Wire(other, trainer.keypair)  # the attacker's connection to the other worker; it holds no key
    relabelled = {method: _altered(payload, worker=other.pubkey.hex())
                  for method, payload in (("Forward", forward), ("Backward", backward))}
    for served in (False, True):
        for method, payload in (("Forward", forward), ("Backward", backward)):
            error = elsewhere.refused(method, payload)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error.details())
            assert f"request for worker {intended.pubkey.hex()[:16]}" in error.details(), error.details()
            assert f"sent to worker {other.pubkey.hex()[:16]}" in error.details(), error.details()
            assert elsewhere.refused(method, relabelled[method]).code() == grpc.StatusCode.UNAUTHENTICATED, method
        if not served:
            trainer.send("Forward", forward)  # the worker it was signed for serves it, replays before or after
            trainer.send("Backward", backward)
    assert other.compute.samples_accumulated == 0 and other.compute.work == [] and other.drain_receipts() == []
    assert intended.compute.samples_accumulated == B and len(intended.drain_receipts()) == 1


def _meta(payload: bytes) -> dict:
    return decode_message(payload, max_elements=1 << 20)[0]


def _altered(payload: bytes, **changes: object) -> bytes:
    """``payload`` with metadata fields changed, its signature left as it was."""
    meta, tensors = decode_message(payload, max_elements=1 << 20)
    return encode_message({**meta, **changes}, tensors)  # type: ignore[dict-item]


def test_unsigned_or_badly_signed_requests_are_refused(start) -> None:
    """No signature, another key's signature, and a signed request altered in a tensor, in its samples or
    in its microbatch: UNAUTHENTICATED, nothing computed or accumulated."""
    worker = start()
    trainer, impostor = Wire(worker), Wire(worker)
    inputs, grad = hidden(), hidden(0.01)
    trainer.forward(inputs, "victim")
    genuine = trainer.backward_request(inputs, grad, "victim")
    meta, tensors = decode_message(genuine, max_elements=1 << 20)
    forged = impostor.backward_request(inputs, grad, "victim")
    attacks = {
        "unsigned": encode_message({k: v for k, v in meta.items() if k != "signature"}, tensors),
        "not hex": _altered(genuine, signature="zz" * 64),
        "another key": _altered(genuine, signature=_meta(forged)["signature"]),
        "altered gradient": encode_message(meta, {**tensors, "grad_output": tensors["grad_output"] * 1e6}),
        "altered samples": _altered(genuine, sample_start=10, sample_end=10 + B),
        "altered microbatch": _altered(genuine, microbatch="victim2"),
        "expired": trainer.request(
            "Backward",
            {"input": inputs, "grad_output": grad},
            microbatch="victim",
            issued_at=now_ms() - int(2 * MAX_REQUEST_AGE * 1000),
        ),
    }
    for name, payload in attacks.items():
        error = trainer.refused("Backward", payload)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (name, error.details())
    unsigned_forward = _altered(trainer.request("Forward", {"input": inputs}), signature="00" * 64)
    assert "not signed by trainer" in trainer.refused("Forward", unsigned_forward).details()
    assert worker.compute.samples_accumulated == 0
    trainer.send("Backward", genuine)  # the ticket survived every forgery
    assert worker.compute.samples_accumulated == B


def test_a_trainer_the_worker_does_not_serve_is_refused(start) -> None:
    """A worker of a coordinated run serves the epoch's trainers only: a validly signed request from any
    other key is refused, Forward and Backward alike, and its receipts never exist."""
    member, outsider = Keypair(), Keypair()
    worker = start(trainer_allowed=lambda pubkey: pubkey == bytes(member.pubkey()))
    allowed, stranger = Wire(worker, member), Wire(worker, outsider)
    inputs, grad = hidden(), hidden(0.01)
    for method, payload in [
        ("Forward", stranger.request("Forward", {"input": inputs})),
        ("Backward", stranger.backward_request(inputs, grad, "x")),
    ]:
        error = stranger.refused(method, payload)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert bytes(outsider.pubkey()).hex() in error.details()
    allowed.microbatch(inputs, grad)
    [receipt] = worker.drain_receipts()
    assert receipt.trainer_id == bytes(member.pubkey()).hex()
    assert (receipt.sample_start, receipt.sample_end) == (0, B)


def test_a_request_signed_for_another_run_is_refused(start) -> None:
    """Signed for run 'elsewhere': refused as such; relabelled with this run: its signature no longer holds."""
    worker = start()
    trainer = Wire(worker)
    inputs = hidden()
    elsewhere = signed_request(trainer.keypair, "body1", "Forward", {"input": inputs}, run_id="elsewhere",
                               worker=worker.pubkey)
    error = trainer.refused("Forward", elsewhere)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "run 'elsewhere'" in error.details()
    relabelled = trainer.refused("Forward", _altered(elsewhere, run=RUN))
    assert relabelled.code() == grpc.StatusCode.UNAUTHENTICATED
    # A Forward signed for another stage or as a Backward does not pass either.
    as_head = signed_request(trainer.keypair, "head", "Forward", {"input": inputs}, run_id=RUN, worker=worker.pubkey)
    moved = trainer.refused("Forward", _altered(as_head, stage="body1"))
    assert moved.code() == grpc.StatusCode.UNAUTHENTICATED


def _force_huge_learning_rate(worker: StageWorker) -> None:
    for group in worker.compute.optimizer.optimizer.param_groups:
        group["lr"] = 1e39  # the step size overflows float32: torch raises half-way through the parameters


def _plant_huge_momentum(worker: StageWorker) -> None:
    state = worker.compute.optimizer.optimizer.state
    first = worker.compute.optimizer.params[0]
    state[first]["exp_avg"][0] = 3e38  # finite, but divided by a tiny second moment it makes the update infinite


@pytest.mark.parametrize("force", [_force_huge_learning_rate, _plant_huge_momentum], ids=["lr", "state"])
def test_a_step_that_would_be_non_finite_is_not_applied(start, caplog, force) -> None:
    """One good step, then honest gradients stepped with a learning rate of 1e39 (torch fails mid-update),
    or with a momentum of 3e38 planted in the optimizer state (the update is infinite). The step is not
    applied: parameters and optimizer state stay those from before it, a warning says so, Forwards stay
    finite, and once the learning rate is sane again the next step applies."""
    worker = start()
    trainer = Wire(worker)
    for inputs, grad in honest_batch(2):
        trainer.microbatch(inputs, grad)
    assert worker.step().applied
    for inputs, grad in honest_batch(2):
        trainer.microbatch(inputs, grad)
    optimizer = worker.compute.optimizer.optimizer
    force(worker)
    before, state_before = snapshot(worker), copy.deepcopy(optimizer.state_dict())
    with caplog.at_level(logging.WARNING, logger="client.pipeline.optim"):
        stats = worker.step()
    assert not stats.applied and stats.samples == 2 * B
    assert "not applied" in caplog.text and "last good state" in caplog.text
    after = snapshot(worker)
    assert all_finite(after) and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    state = optimizer.state_dict()["state"]
    assert state.keys() == state_before["state"].keys()
    for key, values in state_before["state"].items():
        assert all(torch.equal(values[name], state[key][name]) for name in values)
    assert worker.compute.steps == 1
    assert bool(torch.isfinite(trainer.forward(hidden(), "after")).all())
    if force is _force_huge_learning_rate:
        for group in optimizer.param_groups:
            group["lr"] = 3e-3
        trainer.microbatch(hidden(), hidden(0.01))
        assert worker.step().applied
        assert not all(torch.equal(a, b) for a, b in zip(snapshot(worker), before, strict=True))
