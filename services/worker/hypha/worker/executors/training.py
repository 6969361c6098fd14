"""What the DiLoCo executors share: the bridge they code against, and the training pieces.

The executors talk to their worker only through the job bridge
(docs/job-bridge.md). ``Bridge`` is the part of ``hypha.bridge_client.BridgeClient``
they use, written as a Protocol so that tests and benchmarks can connect a
trainer and a parameter server in one process through a fake.

The rest is synchronous, I/O-light code: cutting slice files into batches of
the worker's batch size, the loss of each model kind, the inner AdamW with
the job's settings, the pseudo-gradient Δ = θ_local - θ_global (parameters
only: buffers are not optimised and never travel), and applying a received
θ_global. The trainer's checkpoint is ``trainer_state``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from google.protobuf import json_format
from torch import nn

from hypha.errors import DataLossError, InvalidArgumentError, UnavailableError
from hypha.models import ModelKind, batch_loss
from hypha.tensors.deltas import DeltaEncoder
from hypha.tensors.payload import check_template, decode_state
from hypha.v1 import common_pb2

# ---- the bridge, as the executors see it -------------------------------------------------


class JobInfo(Protocol):
    """``GET /v1/job``: who this executor is in the job."""

    @property
    def job_id(self) -> str: ...
    @property
    def spec(self) -> Any: ...  # JobSpec proto, or its JSON form as a dict
    @property
    def work_dir(self) -> Path | str: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def parameter_server_id(self) -> str: ...
    @property
    def trainer_ids(self) -> Sequence[str]: ...
    @property
    def start_round(self) -> int: ...
    @property
    def attempt(self) -> int: ...


class SliceInfo(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def path(self) -> Path | str: ...


class Directive(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def batches(self) -> int: ...
    @property
    def round(self) -> int: ...


class Received(Protocol):
    @property
    def data(self) -> bytes: ...
    @property
    def from_peer(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def round(self) -> int: ...
    @property
    def samples(self) -> int: ...


class Bridge(Protocol):
    """The job-bridge calls the DiLoCo executors make (``hypha.bridge_client.BridgeClient``)."""

    async def job(self) -> JobInfo: ...
    async def fetch_resource(self, name: str) -> Path: ...
    async def next_slice(self) -> SliceInfo | None: ...
    async def slices_used(self, indices: Sequence[int]) -> None: ...
    async def progress(
        self,
        round: int,
        batches: int,
        samples: int,
        loss: float,
        batch_seconds: float,
        batch_size: int,
        next_batch_started: bool = False,
    ) -> Directive: ...
    async def metrics(self, round: int, values: Mapping[str, float]) -> None: ...
    async def log(self, stream: str, line: str) -> None: ...
    async def send_tensors(self, peer: str, kind: str, round: int, samples: int, path: Path) -> Any: ...
    async def inbox(self, kind: str, timeout_s: float) -> Received | None: ...
    async def publish_tensors(self, kind: str, round: int, path: Path) -> None: ...
    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None: ...
    async def result(self, path: Path) -> None: ...
    async def status(self, state: str, message: str) -> None: ...


def send_outcome(reply: Any) -> tuple[bool, str]:
    """``send_tensors``' reply as (accepted, message), whether a tuple or an object."""
    if isinstance(reply, tuple):
        return bool(reply[0]), str(reply[1]) if len(reply) > 1 else ""
    return bool(reply.accepted), str(getattr(reply, "message", ""))


#: Tensor kinds exchanged between trainers and the parameter server.
DELTA, UPDATE, GLOBAL = "delta", "update", "global"
#: Payload metadata key on published θ_global: the round it is the starting point of.
GLOBAL_ROUND_KEY = "global_round"


# ---- the job spec ------------------------------------------------------------------------


def diloco_spec(spec: Any) -> common_pb2.DilocoJobSpec:
    """The DiLoCo part of the job spec, from a proto or its JSON form (``json_format``)."""
    if isinstance(spec, common_pb2.DilocoJobSpec):
        return spec
    if isinstance(spec, common_pb2.JobSpec):
        if spec.WhichOneof("kind") != "diloco":
            raise InvalidArgumentError(f"job spec {spec.name!r} is not a DiLoCo job")
        return spec.diloco
    if isinstance(spec, Mapping):
        body = dict(spec)
        try:
            if "diloco" in body:
                return json_format.ParseDict(body, common_pb2.JobSpec(), ignore_unknown_fields=True).diloco
            return json_format.ParseDict(body, common_pb2.DilocoJobSpec(), ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            raise InvalidArgumentError(f"malformed DiLoCo job spec: {exc}") from None
    raise InvalidArgumentError(f"cannot read a DiLoCo job spec from {type(spec).__name__}")


_DELTA_DTYPES = {
    common_pb2.DELTA_DTYPE_UNSPECIFIED: "fp32",
    common_pb2.DELTA_DTYPE_FP32: "fp32",
    common_pb2.DELTA_DTYPE_BF16: "bf16",
    common_pb2.DELTA_DTYPE_FP16: "fp16",
    common_pb2.DELTA_DTYPE_INT8: "int8",
}


def delta_wire_dtype(spec: common_pb2.DilocoJobSpec) -> str:
    try:
        return _DELTA_DTYPES[spec.delta_dtype]
    except KeyError:
        raise InvalidArgumentError(f"unknown delta dtype {spec.delta_dtype}") from None


def delta_encoder(spec: common_pb2.DilocoJobSpec) -> DeltaEncoder:
    """The job's Δ codec (``delta_dtype``, ``delta_topk``); it holds the error-feedback residual."""
    return DeltaEncoder(delta_wire_dtype(spec), spec.delta_topk or None)


@dataclass(frozen=True)
class InnerSettings:
    """AdamW settings; a field left at proto3's 0 takes torch's default (weight decay stays 0),
    and gradient clipping and warmup stay off."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Clip the gradients' global L2 norm to this before each step (0: no clipping).
    max_grad_norm: float = 0.0
    #: Linear warmup: step n (from 1) uses lr * min(1, n / warmup_steps) (0: none).
    warmup_steps: int = 0

    @classmethod
    def from_proto(cls, config: common_pb2.AdamWConfig) -> InnerSettings:
        base = cls()
        settings = cls(
            lr=config.learning_rate or base.lr,
            beta1=config.beta1 or base.beta1,
            beta2=config.beta2 or base.beta2,
            eps=config.epsilon or base.eps,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            warmup_steps=config.warmup_steps,
        )
        if min(settings.lr, settings.eps, settings.weight_decay, settings.max_grad_norm) < 0:
            raise InvalidArgumentError(f"invalid inner optimizer settings: {settings}")
        if not (0 <= settings.beta1 < 1 and 0 <= settings.beta2 < 1):
            raise InvalidArgumentError(f"inner betas must be in [0, 1): {settings.beta1}, {settings.beta2}")
        return settings


def make_inner_optimizer(model: nn.Module, settings: InnerSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


# ---- batches -----------------------------------------------------------------------------

Batch = dict[str, torch.Tensor]


def to_device(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def batch_rows(batch: Mapping[str, torch.Tensor]) -> int:
    return int(next(iter(batch.values())).shape[0])


class BatchStream:
    """Cuts slices into batches of exactly ``batch_size`` samples.

    Rows left over at the end of a slice wait for the next slice, so a batch
    may span two slices and the batch size (the scheduler's per-worker
    figure) holds. A slice counts as consumed once its last row has gone into
    a batch; ``take_consumed`` hands those indices out once.
    """

    def __init__(self, batch_size: int, keys: Collection[str] | None = None) -> None:
        if batch_size < 1:
            raise InvalidArgumentError(f"batch size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._keys = None if keys is None else tuple(keys)
        self._pending: deque[tuple[int, dict[str, torch.Tensor], int]] = deque()
        self._consumed: list[int] = []

    @property
    def pending_rows(self) -> int:
        return sum(batch_rows(tensors) - offset for _, tensors, offset in self._pending)

    @property
    def held_slices(self) -> int:
        """Slices this stream holds that the scheduler still counts as assigned: those with rows
        left, and those used up but not yet handed out by ``take_consumed``."""
        return len(self._pending) + len(self._consumed)

    def add_slice(self, index: int, tensors: Mapping[str, torch.Tensor]) -> None:
        selected = {k: v for k, v in tensors.items() if self._keys is None or k in self._keys}
        if not selected:
            raise DataLossError(f"slice {index} holds none of the tensors {list(self._keys or ())}")
        rows = {k: int(v.shape[0]) if v.dim() else -1 for k, v in selected.items()}
        if len(set(rows.values())) != 1 or min(rows.values()) < 0:
            raise DataLossError(f"slice {index}: tensors do not share their first dimension: {rows}")
        if next(iter(rows.values())) == 0:
            self._consumed.append(index)
            return
        self._pending.append((index, selected, 0))

    def next_batch(self) -> Batch | None:
        """A full batch, or None while fewer than ``batch_size`` rows are pending."""
        if self.pending_rows < self.batch_size:
            return None
        return self._take(self.batch_size)

    def flush(self) -> Batch | None:
        """Whatever rows are pending, as one short batch (None when there are none)."""
        rows = self.pending_rows
        return self._take(rows) if rows else None

    def take_consumed(self) -> list[int]:
        consumed, self._consumed = self._consumed, []
        return consumed

    def _take(self, rows: int) -> Batch:
        pieces: list[dict[str, torch.Tensor]] = []
        while rows > 0:
            index, tensors, offset = self._pending[0]
            available = batch_rows(tensors) - offset
            n = min(rows, available)
            pieces.append({k: v[offset : offset + n] for k, v in tensors.items()})
            rows -= n
            if n == available:
                self._pending.popleft()
                self._consumed.append(index)
            else:
                self._pending[0] = (index, tensors, offset + n)
        if len(pieces) == 1:
            return pieces[0]
        return {k: torch.cat([piece[k] for piece in pieces]) for k in pieces[0]}


# ---- loss and steps ----------------------------------------------------------------------


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    kind: ModelKind,
    batch: Mapping[str, torch.Tensor],
    settings: InnerSettings | None = None,
) -> float:
    """One inner step; the batch's loss before the step.

    ``settings`` adds gradient clipping and warmup (the optimizer itself holds
    everything else). Reading the loss back waits for the device: the round's
    mean loss in the progress reports needs the real figure (and the real batch
    time).
    """
    optimizer.zero_grad(set_to_none=True)
    loss = batch_loss(model, kind, batch)
    loss.backward()
    if settings is not None:
        if settings.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
        if settings.warmup_steps:
            warm_up(optimizer, settings)
    optimizer.step()
    return float(loss.detach())


def warm_up(optimizer: torch.optim.Optimizer, settings: InnerSettings) -> None:
    """Set the learning rate of the step about to be taken.

    The count comes from the optimizer's own state (AdamW keeps each
    parameter's ``step``), so a trainer resumed from its checkpoint, or one that
    joins a running job with a fresh optimizer, warms up from where its
    optimizer stands rather than from a counter of its own.
    """
    taken = 0
    for state in optimizer.state.values():
        if "step" in state:
            taken = int(state["step"])
            break
    factor = min(1.0, (taken + 1) / settings.warmup_steps)
    for group in optimizer.param_groups:
        group["lr"] = settings.lr * factor


# ---- θ and Δ -----------------------------------------------------------------------------


def parameter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached fp32 copy of the model's parameters (tied weights once, under their first name)."""
    return {
        name: p.detach().to(device="cpu", dtype=torch.float32, copy=True)
        for name, p in model.named_parameters()
    }


@torch.no_grad()
def compute_delta(model: nn.Module, theta_global: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Δ = θ_local - θ_global in fp32, parameter by parameter."""
    params = dict(model.named_parameters())
    check_template(params, theta_global, what="model")
    return {
        name: p.detach().to(device="cpu", dtype=torch.float32) - theta_global[name]
        for name, p in params.items()
    }


@torch.no_grad()
def apply_global(model: nn.Module, theta_global: Mapping[str, torch.Tensor]) -> None:
    """Set the model's parameters to θ_global (in place, so the optimizer keeps tracking them)."""
    params = dict(model.named_parameters())
    check_template(theta_global, params, what="global state")
    for name, p in params.items():
        p.copy_(theta_global[name])


def encode_delta(
    delta: Mapping[str, torch.Tensor],
    dtype: str | DeltaEncoder,
    round_number: int,
    samples: int,
) -> bytes:
    """Δ as payload bytes; pass the trainer's ``DeltaEncoder`` so a lossy codec keeps its residual."""
    encoder = dtype if isinstance(dtype, DeltaEncoder) else DeltaEncoder(dtype)
    return encoder.encode(delta, metadata={"round": str(round_number), "samples": str(samples)})


def decode_global(data: bytes, template: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A received θ_global in fp32, refused unless it has the model's names and shapes."""
    return decode_state(data, torch.float32, expected=template)


def raise_if_bridge_gone(exc: UnavailableError) -> None:
    """Re-raise when the job bridge itself cannot be reached: the worker is gone.

    NOTE: the bridge is a local Unix socket, so a refused or missing
    connection (an OSError behind the error, other than a timeout) does not
    heal; carrying on would leave an orphaned executor retrying for as long as
    its patience lasts. Failures the bridge reports (503: a peer or the
    scheduler is unreachable) stay retryable.
    """
    cause = exc.__cause__
    if isinstance(cause, OSError) and not isinstance(cause, TimeoutError):
        raise exc
