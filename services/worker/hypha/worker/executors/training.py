"""What the DiLoCo executors share: the bridge they code against, and the training pieces.

The executors talk to their worker only through the job bridge
(docs/job-bridge.md). ``Bridge`` is the part of ``hypha.bridge_client.BridgeClient``
they use, written as a Protocol so that tests and benchmarks can connect a
trainer and a parameter server in one process through a fake.

The rest is synchronous, I/O-light code: cutting slice files into batches of
the worker's batch size, the loss of each model kind, the inner AdamW with
the job's settings, the pseudo-gradient Δ = θ_local - θ_global (parameters
only: buffers are not optimised and never travel), applying a received
θ_global, and the trainer checkpoint that lets a restarted trainer resume.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import secrets
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from google.protobuf import json_format
from torch import nn

from hypha.errors import DataLossError, InvalidArgumentError, UnavailableError
from hypha.fsutil import write_atomic
from hypha.models import ModelKind, batch_loss
from hypha.tensors.deltas import DeltaEncoder
from hypha.tensors.payload import check_template, decode_state, encode_state
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
    """AdamW settings; a field left at proto3's 0 takes torch's default (weight decay stays 0)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    @classmethod
    def from_proto(cls, config: common_pb2.AdamWConfig) -> InnerSettings:
        base = cls()
        settings = cls(
            lr=config.learning_rate or base.lr,
            beta1=config.beta1 or base.beta1,
            beta2=config.beta2 or base.beta2,
            eps=config.epsilon or base.eps,
            weight_decay=config.weight_decay,
        )
        if settings.lr < 0 or settings.eps < 0 or settings.weight_decay < 0:
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
    model: nn.Module, optimizer: torch.optim.Optimizer, kind: ModelKind, batch: Mapping[str, torch.Tensor]
) -> float:
    """One inner step; the batch's loss before the step.

    Reading the loss back waits for the device: the round's mean loss in the
    progress reports needs the real figure (and the real batch time).
    """
    optimizer.zero_grad(set_to_none=True)
    loss = batch_loss(model, kind, batch)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


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


# ---- trainer checkpoint ------------------------------------------------------------------

TRAINER_MANIFEST = "trainer.json"
_TRAINER_FORMAT = 1


@dataclass(frozen=True)
class TrainerState:
    """Where a trainer stands at a round boundary (its model then holds θ_global)."""

    round_number: int
    samples_total: int = 0


def save_trainer_state(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState
) -> Path:
    """Persist the model, the inner optimizer and the round; the JSON written last is the commit point.

    A crash at any moment leaves the previous checkpoint or the new one, never
    a mix: the tensor files carry a fresh token and stale ones are removed
    only after the manifest names the new ones.
    """
    return write_trainer_state(directory, model.state_dict(), optimizer.state_dict(), state)


def snapshot_trainer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Copies of the model's and the optimizer's state dicts, for ``write_trainer_state`` elsewhere.

    A copy is a memcpy of the tensors (a few ms for a small model); serialising,
    hashing and fsyncing it can then run in a thread while training changes the
    live tensors.
    """
    model_state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return model_state, _copied(optimizer.state_dict())


def _copied(value: Any) -> Any:
    """A deep copy of a state dict's tree; ``copy.deepcopy`` took 8 ms on AdamW's (0.85M params)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if type(value) in (list, tuple):  # not a subclass (a namedtuple is built differently)
        return type(value)(_copied(item) for item in value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return copy.deepcopy(value)


def write_trainer_state(
    directory: Path,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    state: TrainerState,
) -> Path:
    """``save_trainer_state`` from state dicts (live, or copies from ``snapshot_trainer_state``)."""
    directory.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    model_blob = encode_state(model_state, "fp32")
    buffer = io.BytesIO()
    torch.save(dict(optimizer_state), buffer)
    optim_blob = buffer.getvalue()
    model_name = f"model-{state.round_number:08d}-{token}.safetensors"
    optim_name = f"optimizer-{state.round_number:08d}-{token}.pt"
    write_atomic(directory / model_name, model_blob)
    write_atomic(directory / optim_name, optim_blob)
    manifest = {
        "format": _TRAINER_FORMAT,
        "round_number": state.round_number,
        "samples_total": state.samples_total,
        "model_file": model_name,
        "model_sha256": hashlib.sha256(model_blob).hexdigest(),
        "optimizer_file": optim_name,
        "optimizer_sha256": hashlib.sha256(optim_blob).hexdigest(),
    }
    path = directory / TRAINER_MANIFEST
    write_atomic(path, json.dumps(manifest, indent=2, sort_keys=True).encode())
    for stale in [*directory.glob("model-*.safetensors"), *directory.glob("optimizer-*.pt")]:
        if stale.name not in (model_name, optim_name):
            stale.unlink(missing_ok=True)
    return path


def load_trainer_state(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> TrainerState | None:
    """Restore model and optimizer from ``directory``; None when there is no checkpoint."""
    path = directory / TRAINER_MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataLossError(f"trainer checkpoint {path} is damaged: {exc}") from None
    try:
        if manifest["format"] != _TRAINER_FORMAT:
            raise DataLossError(f"unsupported trainer checkpoint format {manifest['format']!r}")
        model_blob = _read_verified(directory / Path(manifest["model_file"]).name, manifest["model_sha256"])
        optim_blob = _read_verified(
            directory / Path(manifest["optimizer_file"]).name, manifest["optimizer_sha256"]
        )
        state = TrainerState(int(manifest["round_number"]), int(manifest["samples_total"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise DataLossError(f"trainer checkpoint {path} is damaged: {exc!r}") from None
    model.load_state_dict(decode_state(model_blob, None), strict=True)
    optimizer.load_state_dict(torch.load(io.BytesIO(optim_blob), weights_only=True))
    return state


def _read_verified(path: Path, sha256: str) -> bytes:
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise DataLossError(f"checkpoint file {path} is missing") from None
    if hashlib.sha256(blob).hexdigest() != sha256:
        raise DataLossError(f"checkpoint file {path} does not match its sha256")
    return blob


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
