"""A DiLoCo job's settings as the executors read them: the spec, the Δ codec, the inner AdamW.

The spec arrives as a proto or its JSON form; a field left at proto3's 0
takes the default (see ``InnerSettings``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf import json_format
from torch import nn

from hypha.errors import InvalidArgumentError
from hypha.tensors.deltas import DeltaEncoder
from hypha.v1 import common_pb2

#: The DiLoCo paper's outer settings, used when the job leaves the outer optimizer unset.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9


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
    return _dtype_name(spec.delta_dtype, "delta")


def update_wire_dtype(spec: common_pb2.DilocoJobSpec) -> str:
    """How each round's update comes down (``update_dtype``; fp32: θ_global itself)."""
    return _dtype_name(spec.update_dtype, "update")


def _dtype_name(value: common_pb2.DeltaDType, what: str) -> str:
    try:
        return _DELTA_DTYPES[value]
    except KeyError:
        raise InvalidArgumentError(f"unknown {what} dtype {value}") from None


def delta_encoder(spec: common_pb2.DilocoJobSpec) -> DeltaEncoder:
    """The job's Δ codec (``delta_dtype``, ``delta_topk``); it holds the error-feedback residual."""
    return DeltaEncoder(delta_wire_dtype(spec), spec.delta_topk or None)


@dataclass(frozen=True)
class InnerSettings:
    """AdamW settings; a field left at proto3's 0 takes torch's default (weight decay stays 0),
    and gradient clipping, warmup and decay stay off."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    #: Clip the gradients' global L2 norm to this before each step (0: no clipping).
    max_grad_norm: float = 0.0
    #: Linear warmup: step n (from 1) uses lr * min(1, n / warmup_steps) (0: none).
    warmup_steps: int = 0
    #: Cosine decay after the warmup: lr * min_lr_ratio from step decay_steps on (0: none).
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    @property
    def scheduled(self) -> bool:
        """Whether the rate changes from step to step (``inner_steps.lr_factor``)."""
        return bool(self.warmup_steps or self.decay_steps)

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
            decay_steps=config.decay_steps,
            min_lr_ratio=config.min_lr_ratio,
        )
        if min(settings.lr, settings.eps, settings.weight_decay, settings.max_grad_norm) < 0:
            raise InvalidArgumentError(f"invalid inner optimizer settings: {settings}")
        if not (0 <= settings.beta1 < 1 and 0 <= settings.beta2 < 1):
            raise InvalidArgumentError(f"inner betas must be in [0, 1): {settings.beta1}, {settings.beta2}")
        if not 0 <= settings.min_lr_ratio <= 1:
            raise InvalidArgumentError(f"inner min_lr_ratio must be in [0, 1]: {settings.min_lr_ratio}")
        if settings.decay_steps and settings.decay_steps <= settings.warmup_steps:
            raise InvalidArgumentError(
                f"inner decay_steps ({settings.decay_steps}) must be above "
                f"warmup_steps ({settings.warmup_steps})"
            )
        return settings


def make_inner_optimizer(model: nn.Module, settings: InnerSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )


def outer_settings(spec: common_pb2.DilocoJobSpec) -> tuple[float, float]:
    """The outer Nesterov step's learning rate and momentum (the defaults when the spec sets none)."""
    if not spec.HasField("outer_optimizer"):
        return DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM
    outer = spec.outer_optimizer
    return outer.learning_rate or DEFAULT_OUTER_LR, outer.momentum


def quorum(spec: common_pb2.DilocoJobSpec) -> float:
    """The spec's quorum fraction; unset (0) means every trainer."""
    return float(spec.quorum) if spec.quorum > 0 else 1.0


def has_preprocessor(spec: common_pb2.DilocoJobSpec) -> bool:
    """Whether the job names a preprocessor (tokenizer, image processor) to ship beside the model."""
    return spec.HasField("preprocessor") and bool(
        spec.preprocessor.repository or spec.preprocessor.local_path
    )
