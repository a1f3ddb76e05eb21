"""Checked data: the tokens a trainer sends are the run's dataset at the samples it signed for.

Data is addressed by sample index the same way on every machine (``client.data.windows``), and every request a
trainer sends is signed over its sample range and the digest of each tensor it carries (``admission.RequestHeader``).
So the stages that receive tokens, the head (its ``input``) and the tail (its ``targets``), can read the run's
dataset at those samples and compare (``DataCheck``): a request whose tokens are not the dataset's is refused,
before anything is computed, with ``INVALID_ARGUMENT`` and a message naming the samples, and the refusal keeps the
trainer's signed header as evidence (``WrongData``).

That evidence needs no trust in the worker that kept it: the trainer signed the digest, and anyone who can open the
run's dataset (pinned by ``Model.dataset_sha256``) recomputes the digest the tokens at those samples must have
(``proven``). Tokens travel as ``uint8`` (vocabularies of at most 256) or ``int64``, so an honest request has one of
at most two digests; one that has neither is the trainer's own signed claim of other data. A worker cannot forge
such evidence against an honest trainer (it would need the trainer's signature over a wrong digest), nor make one
out of a request it altered (the digest is of what the trainer signed, not of what arrived).

Which samples a trainer may claim is not this module's business: the worker's ledger admits a Backward only for
samples of the round it accumulates, each once (``admission.MicrobatchLedger``), and the witnesses credit a
trainer only for exactly the range the round's seed assigned it (``client.witness.judge``). Tokens are checked at
whatever samples the request claims, so correct tokens at another trainer's samples pass this check and earn
nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading

import grpc
import torch

from client.data import SampleDataset
from client.identity import from_json, verify
from client.pipeline.admission import DOMAIN, RequestHeader
from client.pipeline.compute import StageRequest
from client.pipeline.messages import tensor_digest
from client.pipeline.rpc import RequestRejected

log = logging.getLogger("psyswarm.worker")

MAX_EVIDENCE_SAMPLES = 256
"""The most samples one piece of evidence may cover (a worker takes at most ``max_batch_size``, 32 by default):
a reader checks every piece it is shown, so each must cost little."""
MAX_REQUEST_CHARS = 2048
"""The longest signed header evidence may quote (a real one is about 700 characters)."""
TOKEN_FIELD = {"head": "input", "tail": "targets"}
"""The tensor of each stage that carries tokens (every other tensor is hidden states or their gradient)."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


def dataset_tokens(dataset: SampleDataset, field: str, start: int, end: int) -> torch.Tensor:
    """The tokens (int64, ``[end - start, seq_len]``) an honest trainer sends as ``field`` for samples
    ``[start, end)``: each sample's window without its last token as input, without its first as targets."""
    windows = dataset.batch(list(range(start, end)))
    return windows[:, :-1] if field == "input" else windows[:, 1:]


def honest_digests(tokens: torch.Tensor, vocab: int) -> set[str]:
    """The wire digests tokens may have when sent honestly: as int64, and as uint8 where the vocabulary fits."""
    digests = {tensor_digest(tokens.to(torch.int64).contiguous())}
    if vocab <= 256:
        digests.add(tensor_digest(tokens.to(torch.uint8).contiguous()))
    return digests


@dataclasses.dataclass(frozen=True)
class WrongData:
    """A trainer's signed request for tokens that are not the run's dataset: the canonical header it signed
    (``RequestHeader.message``, as text) and its signature (hex). Checked by ``proven``."""

    request: str
    signature: str

    def header(self) -> RequestHeader:
        """The signed header, parsed; ``ValueError`` naming what is wrong with it."""
        if not isinstance(self.request, str) or len(self.request) > MAX_REQUEST_CHARS:
            raise ValueError(f"the quoted request must be text of at most {MAX_REQUEST_CHARS} characters")
        try:
            fields = from_json(self.request)
        except ValueError:
            raise ValueError("the quoted request is not JSON") from None
        names = {f.name for f in dataclasses.fields(RequestHeader)} | {"domain"}
        if not isinstance(fields, dict) or set(fields) != names or fields.pop("domain") != DOMAIN:
            raise ValueError("the quoted request is not a stage request's signed header")
        digests = fields.get("digests")
        if not isinstance(digests, dict) or not all(isinstance(d, str) for d in digests.values()):
            raise ValueError("the quoted request's digests must map names to text")
        for name in ("run_id", "stage", "kind", "trainer", "worker", "microbatch_id", "dtype"):
            if not isinstance(fields[name], str):
                raise ValueError(f"the quoted request's {name} must be text")
        for name in ("sample_start", "sample_end", "issued_at"):
            value = fields[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
                raise ValueError(f"the quoted request's {name} must be a non-negative integer")
        try:
            header = RequestHeader(**fields)
        except TypeError:
            raise ValueError("the quoted request's fields are not a header's") from None
        if header.message().decode() != self.request:
            raise ValueError("the quoted request is not in the canonical form a trainer signs")
        if not _HEX64.fullmatch(header.trainer):
            raise ValueError("the quoted request's trainer must be a 64-hex public key")
        return header

    def signed(self) -> bool:
        """Whether the trainer the header names signed it."""
        header = self.header()
        return (isinstance(self.signature, str) and _HEX128.fullmatch(self.signature) is not None
                and verify(header.pubkey, self.request.encode(), bytes.fromhex(self.signature)))


def signed_other_tokens(dataset: SampleDataset, vocab: int, header: RequestHeader) -> bool:
    """Whether ``header`` signed, for its stage's token tensor, a digest that none of the dataset's tokens at its
    samples can have (False for a stage that receives no tokens)."""
    field = TOKEN_FIELD.get(header.stage)
    if field is None or field not in header.digests:
        return False
    expected = dataset_tokens(dataset, field, header.sample_start, header.sample_end)
    return header.digests[field] not in honest_digests(expected, vocab)


def proven(evidence: WrongData, dataset: SampleDataset, vocab: int, run_id: str) -> bytes | None:
    """The public key of the trainer ``evidence`` proves sent other tokens than the run's dataset (``dataset``,
    of a model with ``vocab`` tokens) in run ``run_id``; None if it proves nothing. Never raises on bad evidence."""
    try:
        header = evidence.header()
        if not evidence.signed():
            return None
    except ValueError:
        return None
    samples = header.sample_end - header.sample_start
    if header.run_id != run_id or not 0 < samples <= MAX_EVIDENCE_SAMPLES:
        return None
    return header.pubkey if signed_other_tokens(dataset, vocab, header) else None


class WrongTokens(RequestRejected):
    """A request whose tokens are not the run's dataset at its samples; ``evidence`` proves it to anyone."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, reason: str, evidence: WrongData) -> None:
        super().__init__(reason)
        self.evidence = evidence


class DataCheck:
    """What the head and the tail check of a request's tokens, against the run's dataset; it keeps the evidence
    against each trainer it refused until drained (one piece per trainer: one proves it)."""

    def __init__(self, dataset: SampleDataset, vocab: int, stage: str) -> None:
        if stage not in TOKEN_FIELD:
            raise ValueError(f"stage {stage!r} receives no tokens to check; only {' and '.join(TOKEN_FIELD)} do")
        self.dataset = dataset
        self.vocab = vocab
        self.field = TOKEN_FIELD[stage]
        self._found: dict[str, WrongData] = {}  # trainer -> the first evidence against it since drained
        self._lock = threading.Lock()

    def drain(self) -> list[WrongData]:
        """The evidence found since the last call, oldest first."""
        with self._lock:
            found, self._found = list(self._found.values()), {}
        return found

    def check(self, request: StageRequest) -> None:
        """Raise ``WrongTokens``, keeping its evidence, unless the request's tokens are the dataset's at its samples
        (the request is already parsed: its tokens are in the vocabulary, its batch matches its sample range)."""
        header = request.header
        sent = request.inputs if self.field == "input" else request.targets
        expected = dataset_tokens(self.dataset, self.field, header.sample_start, header.sample_end)
        if isinstance(sent, torch.Tensor) and sent.shape == expected.shape and torch.equal(sent.long(), expected):
            return
        refused = WrongTokens(
            f"{self.field} of samples {header.sample_start}-{header.sample_end} is not the run's dataset at those "
            f"samples; trainer {header.trainer[:16]}… is accused with its signed request, and nothing was computed",
            WrongData(header.message().decode(), request.signature),
        )
        log.warning("refused trainer %s: %s", header.trainer[:16], refused)
        with self._lock:
            self._found.setdefault(header.trainer, refused.evidence)
        raise refused
