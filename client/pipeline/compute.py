"""One stage's computation behind the RPCs: request validation, forward, backward with recomputation.

Kept free of networking and threading so that what a worker computes can be tested and reasoned about on
its own. Every request comes from an untrusted trainer, so each field is checked (stage, ids, dtypes,
shapes, token range, finiteness, size) and its signature verified (``admission``) before any computation,
and a bad one is refused with the reason.

Backward re-runs the forward pass from the input the trainer sends again (activation recomputation): the
worker keeps no activations between RPCs, only the ticket of each Forward (``admission.MicrobatchLedger``,
kept by the worker). Its parameter gradients are computed apart and checked (``admission.GradientBound``)
before they are added to the stage's accumulated gradient, so a refused contribution leaves no trace (and an
out-of-line one is added scaled down).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
from solders.keypair import Keypair

from client.answers import META_ANSWER, META_SIGNATURE, answer_digest, question_digest, sign
from client.pipeline.admission import GradientBound, GradientRefused, RequestHeader, authenticate, read_header
from client.pipeline.device import autocast
from client.pipeline.messages import (
    MessageError,
    WireTensor,
    decode_message,
    encode_message,
    tensor_digest,
)
from client.pipeline.model import ModelSpec, build_stage
from client.pipeline.optim import OptimizerConfig, StageOptimizer, StepStats
from client.pipeline.rpc import InvalidRequest
from client.pipeline.wire import DEFAULT_CODEC, codec_name, codec_of, from_wire, is_finite, to_wire
from client.receipts import Receipt, SignedReceipt

log = logging.getLogger(__name__)

MAX_ID_CHARS = 128
_TOKEN_DTYPES = (torch.uint8, torch.int64)


def input_digest(digests: Mapping[str, str]) -> str:
    """What a receipt records of a stage's input, from the tensors' digests: the input's; for the tail, whose
    input is the hidden state and the targets, the sha256 of both digests, so that it is one digest too."""
    if "targets" not in digests:
        return digests["input"]
    return hashlib.sha256(f"{digests['input']}:{digests['targets']}".encode()).hexdigest()


@dataclass(frozen=True)
class StageRequest:
    """A validated, authenticated Forward or Backward request, tensors still in the wire form they arrived in."""

    header: RequestHeader
    wire_codec: str
    inputs: WireTensor
    targets: torch.Tensor | None
    grad_output: WireTensor | None
    signature: str = ""  # the trainer's, over ``header.message()`` (hex): evidence if its data is wrong

    @property
    def trainer(self) -> str:
        return self.header.trainer

    @property
    def microbatch_id(self) -> str:
        return self.header.microbatch_id

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.inputs.shape[0] * self.inputs.shape[1])

    def input_digest(self) -> str:
        return input_digest(self.header.digests)


class StageCompute:
    """A stage's module and optimizer, with the three operations the worker exposes."""

    def __init__(
        self,
        config: ModelSpec,
        stage: str,
        optimizer: OptimizerConfig,
        *,
        uid: str,
        run_id: str,
        max_batch_size: int,
        wire_codec: str = DEFAULT_CODEC,
        device: torch.device | str = "cpu",
        signer: Keypair,
    ) -> None:
        """``wire_codec`` is the run's (``wire``): the only one this stage accepts and answers in. The module and
        its optimizer state live on ``device`` in float32; computation there uses ``device.autocast``. ``signer``
        is the worker's identity: every request must name its public key (``admission.RequestHeader.worker``),
        and it signs the digest of every answer (``client.answers``), so that a trainer can hold a wrong one
        against it."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.wire_codec = codec_name(wire_codec)
        self.config = config
        self.stage = stage
        self.uid = uid
        self.run_id = run_id
        self.max_batch_size = max_batch_size
        self.signer = signer
        self.key = bytes(signer.pubkey()).hex()  # the worker every request it serves must name
        self.module = build_stage(config, stage)
        self.device = torch.device(device)
        self.module.to(self.device)  # before the optimizer, whose state follows its parameters
        self.optimizer = StageOptimizer(self.module, stage, config.num_stages, optimizer)
        self.bound = GradientBound(self.optimizer.clip)
        self.samples_accumulated = 0
        self.work: list[tuple[RequestHeader, str]] = []  # each accumulated Backward's signed header, this step's
        self.steps = 0
        # Serialises computation with step() and parameter reads coming from other threads.
        self.lock = threading.RLock()

    @property
    def max_elements(self) -> int:
        """The largest tensor a valid request carries: a full batch of activations."""
        return self.max_batch_size * self.config.seq_len * self.config.d_model

    @property
    def max_message_bytes(self) -> int:
        """Upper bound of a valid request (input and gradient in fp32, plus headers)."""
        return 2 * self.max_elements * 4 + 64 * 1024

    # ----- validation -----

    def parse(self, payload: bytes, *, backward: bool) -> StageRequest:
        """Decode, authenticate and check a Forward (``backward=False``) or Backward request; raises
        ``InvalidRequest``, or ``RequestRejected`` for a request its trainer did not sign (or no longer valid)."""
        if len(payload) > self.max_message_bytes:
            raise InvalidRequest(f"request of {len(payload)} bytes exceeds this worker's {self.max_message_bytes}")
        try:
            meta, tensors = decode_message(payload, max_elements=self.max_elements)
        except MessageError as exc:
            raise InvalidRequest(f"malformed request: {exc}") from None
        stage = meta.get("stage")
        if stage != self.stage:
            raise InvalidRequest(f"request for stage {stage!r} sent to a worker of stage {self.stage!r}")
        if meta.get("dtype") != self.wire_codec:
            raise InvalidRequest(
                f"field 'dtype': request encoded in wire codec {meta.get('dtype')!r}, but this run's wire codec is "
                f"{self.wire_codec!r}"
            )
        header = read_header(meta, tensors, "backward" if backward else "forward", MAX_ID_CHARS)
        authenticate(header, meta.get("signature"), run_id=self.run_id, worker=self.key)
        self._check_tensors(tensors, backward)
        batch = int(tensors["input"].shape[0])
        if header.sample_end - header.sample_start != batch:
            raise InvalidRequest(
                f"samples [{header.sample_start}, {header.sample_end}) do not match the batch of {batch} samples"
            )
        return StageRequest(
            header, self.wire_codec, tensors["input"], tensors.get("targets"), tensors.get("grad_output"),
            str(meta["signature"]),
        )

    def _check_tensors(self, tensors: dict[str, WireTensor], backward: bool) -> None:
        is_head, is_tail = self.module.is_head, self.module.is_tail
        expected = (
            {"input"} | ({"targets"} if is_tail else set()) | ({"grad_output"} if backward and not is_tail else set())
        )
        if set(tensors) != expected:
            raise InvalidRequest(
                f"{'Backward' if backward else 'Forward'} to stage {self.stage} needs tensors "
                f"{sorted(expected)}, got {sorted(tensors)}"
            )
        inputs = tensors["input"]
        if is_head:
            self._check_tokens("input", inputs)
        else:
            self._check_hidden("input", inputs)
        batch, length = inputs.shape[:2]
        if is_tail:
            self._check_tokens("targets", tensors["targets"])
            if tuple(tensors["targets"].shape) != (batch, length):
                raise InvalidRequest(f"targets shape {list(tensors['targets'].shape)} must be {[batch, length]}")
        if "grad_output" in tensors:
            self._check_hidden("grad_output", tensors["grad_output"])
            if tuple(tensors["grad_output"].shape) != (batch, length, self.config.d_model):
                raise InvalidRequest(
                    f"grad_output shape {list(tensors['grad_output'].shape)} must match the "
                    f"output shape {[batch, length, self.config.d_model]}"
                )

    def _check_batch_shape(self, name: str, tensor: WireTensor, ndim: int) -> None:
        if tensor.dim() != ndim:
            raise InvalidRequest(f"{name} must have {ndim} dimensions, got shape {list(tensor.shape)}")
        batch, length = tensor.shape[:2]
        if not 1 <= batch <= self.max_batch_size:
            raise InvalidRequest(f"{name} batch size {batch} is not in 1..{self.max_batch_size}")
        if not 1 <= length <= self.config.seq_len:
            raise InvalidRequest(f"{name} sequence length {length} is not in 1..{self.config.seq_len}")

    def _check_tokens(self, name: str, tensor: WireTensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _TOKEN_DTYPES:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else "int8 blocks"
            raise InvalidRequest(f"{name} must hold byte tokens as uint8 or int64, got {got}")
        self._check_batch_shape(name, tensor, 2)
        if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= self.config.vocab):
            raise InvalidRequest(f"{name} holds tokens outside 0..{self.config.vocab - 1}")

    def _check_hidden(self, name: str, tensor: WireTensor) -> None:
        if codec_of(tensor) != self.wire_codec:
            got = codec_of(tensor) or tensor.dtype  # type: ignore[union-attr]
            raise InvalidRequest(f"{name} must be in this run's wire codec {self.wire_codec}, got {got}")
        self._check_batch_shape(name, tensor, 3)
        if tensor.shape[2] != self.config.d_model:
            raise InvalidRequest(
                f"{name} width {tensor.shape[2]} differs from the model's d_model {self.config.d_model}"
            )
        if not is_finite(tensor):
            raise InvalidRequest(f"{name} holds NaN or infinite values")

    # ----- computation -----

    def forward(self, request: StageRequest) -> bytes:
        """Head/body: the stage output in the requested dtype. Tail: the mean loss, in the metadata."""
        with self.lock, torch.no_grad(), autocast(self.device):
            out = self.module(self._as_input(request.inputs), self._on_device(request.targets))
        if self.module.is_tail:
            meta: dict[str, object] = {"loss": float(out)}
            return encode_message(self._signed(request, meta, {}), {})
        tensors = {"output": to_wire(out.cpu(), request.wire_codec)}
        return encode_message(self._signed(request, {}, tensors), tensors)

    def _signed(self, request: StageRequest, meta: dict[str, object], tensors: dict[str, WireTensor],
                digests: Mapping[str, str] | None = None) -> dict[str, object]:
        """``meta`` with this worker's signed answer added (``client.answers``); ``digests`` are the tensors' if
        already computed."""
        digests = digests if digests is not None else {name: tensor_digest(t) for name, t in tensors.items()}
        loss = meta.get("loss")
        answer = answer_digest(digests, loss if isinstance(loss, float) else None)
        signed = sign(self.signer, question_digest(asdict(request.header)), answer)
        return {**meta, META_ANSWER: signed.answer, META_SIGNATURE: signed.signature}

    def backward(self, request: StageRequest, sign_receipt: Callable[[Receipt], SignedReceipt]
                 ) -> tuple[bytes, SignedReceipt]:
        """Recompute the forward pass, check the parameter gradients, accumulate them, return the input gradient
        and the receipt, signed by ``sign_receipt`` (the worker's key, for the round under way).

        The tail differentiates loss × batch size, so accumulated gradients are sums over samples and
        ``step`` divides by the sample count. Its response also carries the loss it recomputed, which saves
        the trainer a separate tail Forward. Gradients are computed apart (``torch.autograd.grad``) and added
        only once ``bound`` accepts them, scaled down where it says so; a refused contribution raises
        ``GradientRefused`` and changes nothing.
        """
        with self.lock:
            inputs = self._as_input(request.inputs)
            if not self.module.is_head:
                inputs.requires_grad_(True)
            with autocast(self.device):
                out = self.module(inputs, self._on_device(request.targets))
            params = self.optimizer.params
            wrt = [*params, inputs] if not self.module.is_head else params
            if self.module.is_tail:
                grads = torch.autograd.grad(out * request.batch_size, wrt)
            else:
                grad_output = from_wire(request.grad_output).to(self.device, out.dtype)
                grads = torch.autograd.grad(out, wrt, grad_outputs=grad_output)
            param_grads, grad_input = grads[: len(params)], (None if self.module.is_head else grads[-1])
            if grad_input is not None and not bool(torch.isfinite(grad_input).all()):
                raise GradientRefused("Backward refused: the input gradient holds NaN or infinite values")
            verdict = self.bound.admit(request.trainer, param_grads, request.batch_size)
            if verdict.scale != 1.0:
                log.info(
                    "%s scaled trainer %s's gradient by %.3g (per-sample norm %.3g above this stage's weight)",
                    self.uid, request.trainer[:16], verdict.scale, verdict.per_sample,
                )
                param_grads = tuple(grad * verdict.scale for grad in param_grads)
            for param, grad in zip(params, param_grads, strict=True):
                if param.grad is None:
                    param.grad = grad
                else:
                    param.grad.add_(grad)
            self.optimizer.observe(param_grads, request.batch_size)
            self.samples_accumulated += request.batch_size
            self.work.append((request.header, request.signature))  # the trainer's word for it: the step's weight
        meta: dict[str, object] = {}
        tensors: dict[str, WireTensor] = {}
        grad_input_digest = ""
        if grad_input is not None:
            tensors["grad_input"] = to_wire(grad_input.cpu(), request.wire_codec)
            grad_input_digest = tensor_digest(tensors["grad_input"])
        if self.module.is_tail:
            meta["loss"] = float(out.detach())
        header = request.header
        receipt = Receipt(
            trainer_id=header.trainer,
            microbatch_id=header.microbatch_id,
            stage=self.stage,
            worker_uid=self.uid,
            sample_start=header.sample_start,
            sample_end=header.sample_end,
            input_digest=request.input_digest(),
            grad_output_digest=header.digests.get("grad_output", ""),
            grad_input_digest=grad_input_digest,
        )
        signed = sign_receipt(receipt)
        meta.update({f"receipt.{k}": v for k, v in signed.to_value().items()})
        digests = {"grad_input": grad_input_digest} if grad_input is not None else {}
        return encode_message(self._signed(request, meta, tensors, digests), tensors), signed

    def step(self) -> StepStats:
        """Apply and clear the gradients accumulated since the last step (not applied if the result would be
        non-finite: see ``StageOptimizer.step``)."""
        with self.lock:
            stats = self.optimizer.step(self.samples_accumulated)
            self.samples_accumulated = 0
            self.work = []
            self.bound.end_step()
            if stats.samples and stats.applied:
                self.steps += 1
            return stats

    def parameters(self) -> list[torch.Tensor]:
        """The live parameter tensors in a fixed order (for averaging with same-stage peers)."""
        return [p.data for p in self.module.parameters()]

    def _as_input(self, tensor: WireTensor) -> torch.Tensor:
        """A request's input on this stage's device: tokens as they came, hidden states in float32."""
        tokens = isinstance(tensor, torch.Tensor) and tensor.dtype in _TOKEN_DTYPES
        return (tensor if tokens else from_wire(tensor)).to(self.device)

    def _on_device(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        return None if targets is None else targets.to(self.device)
