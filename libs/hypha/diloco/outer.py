"""The DiLoCo outer step, as the parameter server runs it.

Each trainer sends its pseudo-gradient Δ = θ_local - θ_global after its inner
steps. The server averages the deltas weighted by the samples behind each one
and applies Nesterov momentum to θ_global, exactly as
``torch.optim.SGD(lr, momentum, nesterov=True)`` would with ``grad = -Δ_avg``.
The momentum buffer is kept in torch's convention (a running sum of ``grad``),
so it can be compared with, or loaded into, a real SGD optimizer.

What goes back to the trainers is the new θ_global itself, not the change: a
trainer sets its parameters to it, so a trainer that missed an update, or whose
state drifted, is back in sync after any one update (see ``NesterovOuter.step``).

All arithmetic is in fp32 on whatever device θ_global lives on (the CPU by
default), with ``torch._foreach_*`` ops so a 25M-parameter model is a handful of
fused passes rather than one Python loop iteration per tensor and op.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

import torch

from hypha.errors import InvalidArgumentError
from hypha.tensors.payload import check_template


class OuterStateDict(TypedDict):
    """Everything needed to resume the outer optimizer bit for bit."""

    params: dict[str, torch.Tensor]
    #: None until the first step, exactly like torch's lazily created ``momentum_buffer``.
    momentum_buffer: dict[str, torch.Tensor] | None
    lr: float
    momentum: float
    steps: int


def weighted_average(deltas: Sequence[tuple[Mapping[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    """Average of the deltas, each weighted by its samples / the total samples, in fp32.

    Every delta must have the same names and shapes as the first. A delta with
    zero samples adds nothing; all-zero samples (or no deltas) is an error,
    since there would be nothing to average. The inputs are never modified.
    """
    if not deltas:
        raise InvalidArgumentError("no deltas to average")
    for _, samples in deltas:
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise InvalidArgumentError(f"samples must be a non-negative integer, got {samples!r}")
    total = sum(samples for _, samples in deltas)
    if total <= 0:
        raise InvalidArgumentError("every delta covers zero samples; nothing to average")
    template = deltas[0][0]
    names = list(template)
    for delta, _ in deltas[1:]:
        check_template(delta, template, what="delta")
    for name in names:
        if not template[name].is_floating_point():
            raise InvalidArgumentError(f"delta tensor {name!r} is {template[name].dtype}, not floating point")

    contributing = [(delta, samples / total) for delta, samples in deltas if samples > 0]
    first, first_weight = contributing[0]
    # torch._foreach_mul allocates the result; casting first keeps the sum in fp32 even for
    # bf16/fp16 deltas (a no-op for fp32 inputs, which are then read, never written).
    out = torch._foreach_mul([_as_fp32(first[name]) for name in names], first_weight)
    for delta, weight in contributing[1:]:
        torch._foreach_add_(out, [_as_fp32(delta[name]) for name in names], alpha=weight)
    return dict(zip(names, out, strict=True))


class NesterovOuter:
    """θ_global and its momentum buffer, stepped with SGD + Nesterov semantics.

    ``params`` is copied (fp32, contiguous) at construction, so the caller's
    tensors are never aliased.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        lr: float,
        momentum: float,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if not lr > 0:
            raise InvalidArgumentError(f"outer learning rate must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise InvalidArgumentError(f"outer momentum must be in [0, 1), got {momentum}")
        if not params:
            raise InvalidArgumentError("the outer optimizer needs at least one parameter")
        for name, tensor in params.items():
            if not tensor.is_floating_point():
                raise InvalidArgumentError(f"parameter {name!r} is {tensor.dtype}, not floating point")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.steps = 0
        self._names = list(params)
        self._params = [
            params[n].detach().to(device=device, dtype=torch.float32, copy=True).contiguous()
            for n in self._names
        ]
        self._buffers: list[torch.Tensor] | None = None

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def parameters(self) -> dict[str, torch.Tensor]:
        """θ_global: the live tensors, updated in place by ``step`` (clone them to keep a snapshot)."""
        return dict(zip(self._names, self._params, strict=True))

    def momentum_buffer(self) -> dict[str, torch.Tensor] | None:
        """The live momentum buffer in torch's convention, or None before the first step."""
        if self._buffers is None:
            return None
        return dict(zip(self._names, self._buffers, strict=True))

    def step(self, avg_delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply one outer step for the averaged delta; return the new θ_global (live tensors).

        With ``g = -Δ``: ``buf = g`` on the first step, else ``buf = m·buf + g``;
        then ``θ ← θ - lr·(g + m·buf)``. The operation order is torch's, so
        results match ``torch.optim.SGD(nesterov=True)`` to fp32 rounding.
        Trainers set their parameters to the returned θ_global. ``avg_delta``
        is not modified.
        """
        check_template(avg_delta, self.parameters(), what="delta")
        device = self._params[0].device
        grads = torch._foreach_neg([avg_delta[n].to(device=device, dtype=torch.float32) for n in self._names])
        if self._buffers is None:
            self._buffers = [g.clone() for g in grads]
        else:
            torch._foreach_mul_(self._buffers, self.momentum)
            torch._foreach_add_(self._buffers, grads)
        # grads becomes the Nesterov direction d = g + m·buf, then θ -= lr·d.
        torch._foreach_add_(grads, self._buffers, alpha=self.momentum)
        torch._foreach_add_(self._params, grads, alpha=-self.lr)
        self.steps += 1
        return self.parameters()

    def state_dict(self) -> OuterStateDict:
        """References to the live state (like torch's ``state_dict``); serialize before the next step."""
        return OuterStateDict(
            params=self.parameters(),
            momentum_buffer=self.momentum_buffer(),
            lr=self.lr,
            momentum=self.momentum,
            steps=self.steps,
        )

    def load_state_dict(self, state: OuterStateDict) -> None:
        """Replace θ_global, the buffer and the step count with copies of ``state``'s.

        Names and shapes must match this optimizer's parameters; lr and momentum
        come from ``state`` too, so a resumed server continues with the settings
        it ran with.
        """
        template = self.parameters()
        check_template(state["params"], template, what="state")
        buffer = state["momentum_buffer"]
        if buffer is not None:
            check_template(buffer, template, what="momentum buffer")
        device = self._params[0].device
        lr, momentum = float(state["lr"]), float(state["momentum"])
        if not lr > 0 or not 0 <= momentum < 1:
            raise InvalidArgumentError(f"invalid outer settings in state: lr={lr}, momentum={momentum}")
        self._params = [_fp32_copy(state["params"][n], device) for n in self._names]
        self._buffers = None if buffer is None else [_fp32_copy(buffer[n], device) for n in self._names]
        self.lr, self.momentum = lr, momentum
        self.steps = int(state["steps"])

    @classmethod
    def from_state_dict(
        cls, state: OuterStateDict, *, device: torch.device | str | None = None
    ) -> NesterovOuter:
        outer = cls(state["params"], state["lr"], state["momentum"], device=device)
        outer.load_state_dict(state)
        return outer


def _as_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.float32 else tensor.to(torch.float32)


def _fp32_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device=device, dtype=torch.float32, copy=True).contiguous()
