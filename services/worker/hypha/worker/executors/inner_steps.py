"""A trainer's arithmetic: one inner step (loss, clipping, warmup), and θ and Δ around a round.

Synchronous, I/O-light code. The pseudo-gradient is Δ = θ_local - θ_global
(parameters only: buffers are not optimised and never travel); a received
θ_global is applied in place so the optimizer keeps tracking the parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from hypha.models import ModelKind, batch_loss
from hypha.tensors.deltas import DeltaEncoder
from hypha.tensors.payload import check_template, decode_state
from hypha.worker.executors.diloco_settings import InnerSettings


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
