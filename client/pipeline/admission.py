"""What a stage worker admits, and on whose word: signed requests, forward tickets and gradient bounds.

Forward and Backward requests come from the network, and a Backward changes the stage's parameters. So a
worker serves a request only if

1. a trainer signed it with its ed25519 keypair (the Solana keypair it runs with) over everything that gives
   the request its meaning: the run, the stage, the kind (forward or backward), the worker it is sent to (that
   worker's public key, from the signed DHT record the trainer routed by), the microbatch, the samples it covers,
   the wire dtype, when it was issued and the digest of every tensor it carries. Nothing in it can be altered,
   moved to another run, stage, method or worker, or kept and replayed later (``RequestHeader``). Naming the
   worker is what makes a header evidence of *its* work: a groupmate that copies it into its own declaration
   proves nothing with it (``client.averaging.work``), and a request captured on its way to one replica of a
   stage is refused by every other;
2. the signer is a trainer the worker serves (``trainer_allowed``: in a coordinated run, a Trainer of the
   current epoch; standalone, any signer: ``any_signed_trainer``);
3. a Backward follows a Forward this worker ran for the same trainer, microbatch, samples and input (a ticket,
   consumed by the Backward), its microbatch has not been differentiated already, and its samples belong to the
   step the worker accumulates (a coordinated run's current round) and are not already in it (``MicrobatchLedger``);
4. its parameter gradients are finite and not wildly out of line with the stage's recent ones
   (``GradientBound``), checked before they are added to the stage's accumulated gradient.

The gradient bound
------------------
A contribution's per-sample norm (its parameter gradient's L2 norm over its sample count) is compared with the
stage's *reference*: the lower median, one vote per trainer seen in the last two steps, of each trainer's median
over its last 8 accepted contributions. Then, with ``clip`` the stage's clip threshold (``optim.max_grad_norm``):

- non-finite, or above ``max(1e5 × reference, 1000 × clip)``: **refused**, nothing accumulated;
- above ``max(100 × reference, clip)``: **accepted, scaled down** to that norm;
- otherwise accepted as it came. Before any contribution was accepted, only ``1000 × clip`` applies (refused above).

Why. Honest per-sample norms move by large factors: 4–60 × clip on freshly initialised models (d_model 32–256),
a 200-fold rise within a few steps of early training (the head of ``bench_pipeline.py``), loss spikes of 10⁴ × the
median measured once; a single microbatch of unusual text is an outlier that no statistic can tell from an
attacker's. A bound that refuses what it does not expect therefore refuses honest work (the earlier rule,
refusing above 100 × the reference, refused the head's Backwards three times in a ``psyswarm demo`` run, at the
loss spike of its sixth round, and with two trainers refused a loss spike on every retry, its lower median being
the other trainer's norm). So a contribution that is
merely out of line is *scaled*, not refused: it keeps its samples and its direction, and its weight in the step
is at most ``max(100 × reference, clip)`` per sample it claims, whatever it sent. That is the whole influence
the bound concedes to a liar: 100 honest samples' worth per sample, or no more than a full step's clip (the
step clips the mean gradient to ``clip``, so such a contribution moves it by at most its share of the samples).
Refusal is kept for what no honest run produces: non-finite values, the 10¹⁸–3·10³⁸ gradients that overflow the
accumulated sum or its norm (they would make the step clip every honest gradient to nothing), and anything
10⁵ times the reference (ten times the largest honest spike measured) and above 1000 × clip, the fresh bound.
The fresh bound also serves as the warm-up: whatever the reference, a contribution within it is never refused,
so early training and a reference pulled down by a trainer's tiny gradients (with two trainers the lower median
is the smaller vote) never cost honest samples.

Why a trainer cannot move it for the others. Only accepted contributions vote, so a trainer cannot ratchet
its vote with refusals; each trainer has one vote however many requests it sends, so with three or more
trainers one trainer cannot move the reference out of the range of the others' votes (the median), and with
two the lower median takes the smaller vote, which an attacker can only lower, never raise (lowering it refuses
no honest contribution within the fresh bound, though it scales down those above the clip threshold). A
sustained 10⁶-fold gradient is therefore refused on every try. A trainer alone is compared only with itself,
and a standalone worker, which serves any signer, counts any key as a trainer.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
import torch
from solders.keypair import Keypair

from client.identity import verify
from client.pipeline.messages import MetaValue, encode_message, tensor_digest
from client.pipeline.optim import gradient_norm
from client.pipeline.rpc import InvalidRequest, RequestRejected

DOMAIN = "psyswarm/stage-request/v1"
MAX_REQUEST_AGE = 600.0
"""Seconds a signed request stays valid, either way of the worker's clock (so clocks must agree within it)."""

TrainerAllowed = Callable[[bytes], bool]


def any_signed_trainer(pubkey: bytes) -> bool:
    """The policy of a worker run without a coordinator: every trainer that signs its requests is served."""
    return True


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _hex(value: object, size: int) -> bool:
    return isinstance(value, str) and len(value) == 2 * size and all(c in "0123456789abcdef" for c in value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


@dataclass(frozen=True)
class RequestHeader:
    """What a trainer signs for one Forward or Backward. ``digests`` maps each tensor's name to the sha256
    of its wire form (``messages.tensor_digest``), which the worker recomputes from what it received."""

    run_id: str
    stage: str
    kind: str
    trainer: str  # the signer's public key, 64 lowercase hex characters
    worker: str  # the public key of the worker it is sent to (its DHT record's), 64 lowercase hex characters
    microbatch_id: str
    sample_start: int
    sample_end: int
    dtype: str
    issued_at: int  # unix time in milliseconds
    digests: dict[str, str]

    def message(self) -> bytes:
        """The canonical bytes signed: JSON with sorted keys, under a domain tag no other signed record uses."""
        fields = {"domain": DOMAIN, **dataclasses.asdict(self)}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @property
    def pubkey(self) -> bytes:
        return bytes.fromhex(self.trainer)


# Wire metadata field of each signed header field; ``kind`` is the method called and ``digests`` are the tensors.
_WIRE = {
    "run_id": "run",
    "stage": "stage",
    "trainer": "trainer",
    "worker": "worker",
    "microbatch_id": "microbatch",
    "sample_start": "sample_start",
    "sample_end": "sample_end",
    "dtype": "dtype",
    "issued_at": "issued_at",
}


def encode_request(keypair: Keypair, header: RequestHeader, tensors: dict[str, torch.Tensor]) -> bytes:
    """A signed request message: the header's fields and the signature as metadata, then the tensors."""
    if header.trainer != bytes(keypair.pubkey()).hex():
        raise ValueError("the header names another trainer than the keypair that signs it")
    meta: dict[str, MetaValue] = {wire: getattr(header, name) for name, wire in _WIRE.items()}
    meta["signature"] = bytes(keypair.sign_message(header.message())).hex()
    return encode_message(meta, tensors)


def read_header(
    meta: dict[str, MetaValue], tensors: dict[str, torch.Tensor], kind: str, max_id_chars: int
) -> RequestHeader:
    """The header a request claims, each field checked for form, with the digests of the tensors it carries;
    raises ``InvalidRequest`` naming the field."""
    for name in ("run", "stage", "microbatch", "dtype"):
        value = meta.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= max_id_chars or not value.isprintable():
            raise InvalidRequest(f"field {name!r} must be a string of 1..{max_id_chars} printable characters")
    for name in ("trainer", "worker"):
        if not _hex(meta.get(name), 32):
            raise InvalidRequest(f"field {name!r} must be the {name}'s public key as 64 lowercase hex characters")
    for name in ("sample_start", "sample_end", "issued_at"):
        if not _integer(meta.get(name)):
            raise InvalidRequest(f"field {name!r} must be a non-negative integer")
    fields = {name: meta[wire] for name, wire in _WIRE.items()}
    digests = {name: tensor_digest(tensor) for name, tensor in tensors.items()}
    return RequestHeader(kind=kind, digests=digests, **fields)  # type: ignore[arg-type]


def authenticate(header: RequestHeader, signature: MetaValue, *, run_id: str, worker: str) -> None:
    """Refuse a request for another run or another worker than ``worker`` (this one's public key, hex), too old or
    too far ahead of this clock, or not signed by its trainer."""
    if header.run_id != run_id:
        raise InvalidRequest(f"request for run {header.run_id!r} sent to a worker of run {run_id!r}")
    if header.worker != worker:
        raise InvalidRequest(
            f"request for worker {header.worker[:16]}… sent to worker {worker[:16]}…: a trainer signs each request "
            "for the worker it routes it to (a request replayed to another worker of the stage, or an address "
            "that now serves another key)"
        )
    age = (now_ms() - header.issued_at) / 1000
    if abs(age) > MAX_REQUEST_AGE:
        raise RequestRejected(
            f"request issued {age:.0f} s ago by this worker's clock; requests are valid for {MAX_REQUEST_AGE:.0f} s "
            "either way (a replay, or clocks that disagree)",
            grpc.StatusCode.UNAUTHENTICATED,
        )
    if not signed_by_trainer(header, signature):
        raise RequestRejected(
            f"request is not signed by trainer {header.trainer[:16]}… (missing or bad signature, or altered)",
            grpc.StatusCode.UNAUTHENTICATED,
        )


def signed_by_trainer(header: RequestHeader, signature: MetaValue) -> bool:
    """Whether ``signature`` (hex) is the header's trainer's over exactly this header: what a worker checks of a
    request, and what a stage's groupmates check of the Backwards a worker says it accumulated
    (``client.averaging.work``)."""
    return _hex(signature, 64) and verify(header.pubkey, header.message(), bytes.fromhex(signature))  # type: ignore[arg-type]


# ----- forward tickets and differentiated microbatches -----


@dataclass(frozen=True)
class Ticket:
    """A Forward this worker ran: the Backward of the same microbatch must carry the same samples and input."""

    input_digest: str
    sample_start: int
    sample_end: int


class MicrobatchLedger:
    """Which Backwards a worker may still accept; thread-safe.

    A head or body Backward carries a ``grad_output`` the worker cannot check against anything but its own
    forward: so it needs the ticket its Forward left (same trainer, microbatch, samples and input digest), and
    consumes it. Tickets are bounded per trainer (its oldest goes first) and in all (the oldest goes first),
    and all are dropped at the optimizer step: a Backward differentiates the parameters its Forward used.

    Every Backward, the tail's included, claims its (trainer, microbatch) once: a replayed Backward, or a
    replayed Forward followed by its replayed Backward, is refused while the claim is remembered, which is
    for ``2 * MAX_REQUEST_AGE`` (afterwards the signature itself has expired); at most ``max_claims`` are kept,
    the oldest forgotten first.

    Once the worker is told which samples its next step accumulates (``expect_samples``: a coordinated run's
    round), every Backward also claims its samples for the step: only those, and each once. A microbatch of a
    round that ended (a trainer stalled by a stage that emptied, finishing when a worker returns) or sent again
    under a new id would otherwise count in a step that is not its own, or twice. A standalone worker, which
    steps by sample count, takes any samples. In a coordinated run each trainer may claim only samples of its own
    share of the round (``expect_samples``'s ``shares``, from the round's seed): otherwise a trainer could claim
    another's samples first, with the right tokens, and have the honest trainer's Backward of them refused here.
    """

    def __init__(self, *, tickets_per_trainer: int = 64, max_tickets: int = 4096, max_claims: int = 1 << 16) -> None:
        self.tickets_per_trainer = tickets_per_trainer
        self.max_tickets = max_tickets
        self.max_claims = max_claims
        self._tickets: collections.OrderedDict[tuple[str, str], Ticket] = collections.OrderedDict()
        self._held: collections.Counter[str] = collections.Counter()
        self._claims: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()
        self._window: tuple[int, int] | None = None  # the samples the next step accumulates; None: any
        self._shares: dict[str, tuple[int, int]] | None = None  # each trainer's part of the window; None: any
        self._stepped: dict[tuple[str, str], tuple[int, int]] = {}  # samples claimed since the last step
        self._lock = threading.Lock()

    def expect_samples(self, start: int, end: int, shares: Mapping[str, tuple[int, int]] | None = None) -> None:
        """The next step accumulates samples ``[start, end)`` only (the coordinator's round); with ``shares``, each
        trainer (public key, hex) only samples within its own share of them, and a trainer without one none."""
        with self._lock:
            self._window = (start, end)
            self._shares = None if shares is None else dict(shares)

    def issue(self, trainer: str, microbatch_id: str, ticket: Ticket) -> None:
        """Record a Forward this worker ran (a repeated Forward of the microbatch replaces its ticket)."""
        key = (trainer, microbatch_id)
        with self._lock:
            if self._tickets.pop(key, None) is None:
                if self._held[trainer] >= self.tickets_per_trainer:
                    self._remove(next(k for k in self._tickets if k[0] == trainer))
                elif len(self._tickets) >= self.max_tickets:
                    self._remove(next(iter(self._tickets)))
                self._held[trainer] += 1
            self._tickets[key] = ticket

    def claim(self, trainer: str, microbatch_id: str, ticket: Ticket | None, samples: tuple[int, int]) -> None:
        """Admit a Backward of ``samples`` (``[start, end)``), consuming the Forward's ticket when ``ticket`` (what
        the Backward carries) is given; raises ``RequestRejected`` (FAILED_PRECONDITION) without changing anything
        otherwise."""
        key = (trainer, microbatch_id)
        now = time.monotonic()
        with self._lock:
            while self._claims and next(iter(self._claims.values())) < now:
                self._claims.popitem(last=False)
            if key in self._claims:
                raise RequestRejected(
                    f"microbatch {microbatch_id!r} of this trainer was already differentiated here (a replay)",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            self._check_samples(trainer, samples)
            if ticket is not None:
                issued = self._tickets.get(key)
                if issued is None:
                    raise RequestRejected(
                        f"no Forward of microbatch {microbatch_id!r} by this trainer ran on this worker since its "
                        "last step; run the Forward here first",
                        grpc.StatusCode.FAILED_PRECONDITION,
                    )
                if issued != ticket:
                    raise RequestRejected(
                        f"Backward of microbatch {microbatch_id!r} carries other samples or another input than "
                        "its Forward did",
                        grpc.StatusCode.FAILED_PRECONDITION,
                    )
                self._remove(key)
            self._claims[key] = now + 2 * MAX_REQUEST_AGE
            if len(self._claims) > self.max_claims:
                self._claims.popitem(last=False)
            if self._window is not None:
                self._stepped[key] = samples

    def admit_forward(self, samples: tuple[int, int]) -> None:
        """Refuse a Forward of samples outside the round this worker accumulates (FAILED_PRECONDITION). A signed
        answer then names samples of one round only, which pin the parameters every replica of the stage answers
        with: no trainer can collect answers from either side of a step and show them to disagree."""
        with self._lock:
            self._in_window(samples)

    def _check_samples(self, trainer: str, samples: tuple[int, int]) -> None:
        if self._window is None:
            return
        self._in_window(samples)
        start, end = samples
        share = None if self._shares is None else self._shares.get(trainer, (start, start))
        if share is not None and not share[0] <= start < end <= share[1]:
            raise RequestRejected(
                f"samples {start}-{end} are not this trainer's share of the round "
                f"({f'{share[0]}-{share[1]}' if share[1] > share[0] else 'none'}): they are another trainer's, or "
                "this worker has not yet seen the round open",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if any(start < other_end and other_start < end for other_start, other_end in self._stepped.values()):
            raise RequestRejected(
                f"samples {start}-{end} were already differentiated here in this step",
                grpc.StatusCode.FAILED_PRECONDITION,
            )

    def _in_window(self, samples: tuple[int, int]) -> None:
        if self._window is None:
            return
        start, end = samples
        if not self._window[0] <= start < end <= self._window[1]:
            raise RequestRejected(
                f"samples {start}-{end} are not in the round this worker is accumulating "
                f"({self._window[0]}-{self._window[1]}): that round is over, or not yet begun",
                grpc.StatusCode.FAILED_PRECONDITION,
            )

    def release(self, trainer: str, microbatch_id: str) -> None:
        """The claimed Backward was not applied (refused or never run): the trainer may try it again, after a
        new Forward where it needs one."""
        with self._lock:
            self._claims.pop((trainer, microbatch_id), None)
            self._stepped.pop((trainer, microbatch_id), None)

    def end_step(self) -> None:
        """The optimizer stepped: forward tickets end with the parameters their forwards used, and the next step
        starts with no samples."""
        with self._lock:
            self._tickets.clear()
            self._held.clear()
            self._stepped.clear()

    def _remove(self, key: tuple[str, str]) -> None:
        del self._tickets[key]
        self._held[key[0]] -= 1
        if not self._held[key[0]]:
            del self._held[key[0]]


# ----- gradient bound -----


class GradientRefused(InvalidRequest):
    """A Backward whose gradient the stage will not accumulate; nothing was added."""


def _lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


@dataclass
class _Voter:
    norms: collections.deque[float]
    last_step: int = 0


@dataclass(frozen=True)
class Verdict:
    """How a contribution is accumulated: ``scale`` multiplies its parameter gradient (1.0: as it came)."""

    per_sample: float
    scale: float


class GradientBound:
    """Which Backward contributions a stage accumulates, and at what weight (the rule and why: module docstring).

    The per-sample norm of a contribution is the L2 norm of its parameter gradient (a sum over its samples)
    divided by its sample count. The reference is the lower median, over the trainers seen in the last
    ``stale_steps`` steps, of each one's median per-sample norm over its last ``window`` accepted contributions
    (one vote per trainer). A finite contribution is

    - refused above ``refuse_factor`` × the reference or ``fresh_multiple`` × the clip threshold, whichever is
      larger (only the second before any contribution was accepted);
    - otherwise accepted, scaled down to ``factor`` × the reference or the clip threshold, whichever is larger,
      where it is above both (``Verdict.scale``).
    """

    def __init__(
        self,
        clip: float,
        *,
        factor: float = 100.0,
        refuse_factor: float = 1e5,
        fresh_multiple: float = 1000.0,
        window: int = 8,
        stale_steps: int = 2,
        max_trainers: int = 256,
    ) -> None:
        self.clip = clip
        self.factor = factor
        self.refuse_factor = refuse_factor
        self.fresh_bound = fresh_multiple * clip
        self.window = window
        self.stale_steps = stale_steps
        self.max_trainers = max_trainers
        self.steps = 0
        self.refused = 0
        self.scaled = 0
        self._voters: collections.OrderedDict[str, _Voter] = collections.OrderedDict()

    def reference(self) -> float | None:
        """The typical per-sample norm of the stage's recent contributions; None before any was accepted."""
        votes = [_lower_median(v.norms) for v in self._voters.values()]
        return _lower_median(votes) if votes else None

    def limits(self) -> tuple[float, float]:
        """(the per-sample norm above which a contribution is scaled down to it, the one above which it is
        refused)."""
        reference = self.reference()
        if reference is None:
            return self.fresh_bound, self.fresh_bound
        return max(self.factor * reference, self.clip), max(self.refuse_factor * reference, self.fresh_bound)

    def admit(self, trainer: str, grads: Sequence[torch.Tensor], samples: int) -> Verdict:
        """Check one contribution: how to accumulate it, or ``GradientRefused`` saying why it is not."""
        per_sample = gradient_norm(grads) / samples
        if not math.isfinite(per_sample):
            self.refused += 1
            raise GradientRefused("Backward refused: the parameter gradient holds NaN or infinite values")
        reference = self.reference()
        weight, ceiling = self.limits()
        if per_sample > ceiling:
            self.refused += 1
            why = (
                "no contribution accepted yet"
                if reference is None
                else f"the larger of {self.refuse_factor:g} × recent {reference:.3g} and {self.fresh_bound:.3g}"
            )
            raise GradientRefused(
                f"Backward refused: per-sample gradient norm {per_sample:.3g} exceeds this stage's bound "
                f"{ceiling:.3g} ({why}); nothing was accumulated"
            )
        self._record(trainer, per_sample)
        if per_sample <= weight:
            return Verdict(per_sample, 1.0)
        self.scaled += 1
        return Verdict(per_sample, weight / per_sample)

    def end_step(self) -> None:
        """The optimizer stepped: forget trainers that contributed nothing for ``stale_steps`` steps."""
        self.steps += 1
        for trainer in [t for t, v in self._voters.items() if self.steps - v.last_step > self.stale_steps]:
            del self._voters[trainer]

    def _record(self, trainer: str, norm: float) -> None:
        voter = self._voters.pop(trainer, None) or _Voter(collections.deque(maxlen=self.window))
        voter.norms.append(norm)
        voter.last_step = self.steps
        self._voters[trainer] = voter  # most recently seen last
        if len(self._voters) > self.max_trainers:
            self._voters.popitem(last=False)
