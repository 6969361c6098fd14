"""The trainer's checkpoint: model, inner optimizer and round, so a restarted trainer resumes.

Split from ``training`` (the training pieces); ``checkpoint_writer`` decides
when a checkpoint is written and writes it off the training path.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hypha.errors import DataLossError
from hypha.fsutil import write_atomic
from hypha.tensors.payload import decode_state, encode_state

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
