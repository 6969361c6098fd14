"""A trainer's arithmetic: one inner step (loss, clipping, the rate's schedule), and θ and Δ
around a round.

Synchronous, I/O-light code. The pseudo-gradient is Δ = θ_local - θ_global
(parameters only: buffers are not optimised and never travel); a received
θ_global is applied in place so the optimizer keeps tracking the parameters.
"""

from __future__ import annotations

import math
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

    ``settings`` adds gradient clipping and the rate's schedule (the optimizer itself holds
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
        if settings.scheduled:
            schedule_lr(optimizer, settings)
    optimizer.step()
    return float(loss.detach())


def schedule_lr(optimizer: torch.optim.Optimizer, settings: InnerSettings) -> None:
    """Set the learning rate of the step about to be taken.

    The count comes from the optimizer's own state (AdamW keeps each
    parameter's ``step``), so a trainer resumed from its checkpoint, or one that
    joins a running job with a fresh optimizer, follows the schedule from where its
    optimizer stands rather than from a counter of its own.
    """
    taken = 0
    for state in optimizer.state.values():
        if "step" in state:
            taken = int(state["step"])
            break
    factor = lr_factor(taken + 1, settings)
    for group in optimizer.param_groups:
        group["lr"] = settings.lr * factor


def lr_factor(step: int, settings: InnerSettings) -> float:
    """The fraction of ``lr`` that step ``step`` (from 1) takes: a linear warmup, then a half
    cosine from 1 down to ``min_lr_ratio`` at ``decay_steps``, held after it.

    The decay counts the trainer's own steps, not the job's rounds: the rounds' length in steps
    may change as the scheduler fits them to the link, a trainer's step count does not.
    """
    factor = 1.0
    if settings.warmup_steps:
        factor = min(1.0, step / settings.warmup_steps)
    if settings.decay_steps and step > settings.warmup_steps:
        span = settings.decay_steps - settings.warmup_steps
        progress = min(1.0, (step - settings.warmup_steps) / span)
        floor = settings.min_lr_ratio
        factor = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


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
