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
    names, contributing = _weights(deltas)
    first, first_weight = contributing[0]
    # torch._foreach_mul allocates the result; casting first keeps the sum in fp32 even for
    # bf16/fp16 deltas (a no-op for fp32 inputs, which are then read, never written).
    out = torch._foreach_mul([_as_fp32(first[name]) for name in names], first_weight)
    for delta, weight in contributing[1:]:
        torch._foreach_add_(out, [_as_fp32(delta[name]) for name in names], alpha=weight)
    return dict(zip(names, out, strict=True))


class NonFiniteDeltaError(InvalidArgumentError):
    """Some deltas hold NaN or infinity; nothing was stepped.

    ``culprits`` maps each such delta's position in the deltas given to the
    name of its first non-finite tensor.
    """

    def __init__(self, culprits: Mapping[int, str]) -> None:
        self.culprits = dict(culprits)
        first = ", ".join(f"#{i}: {name!r}" for i, name in sorted(self.culprits.items()))
        super().__init__(f"delta tensor holds NaN or infinity ({first})")


def _non_finite(
    deltas: Sequence[tuple[Mapping[str, torch.Tensor], int]], names: Sequence[str]
) -> dict[int, str]:
    """Position -> first non-finite tensor name, for each contributing delta that has one."""
    culprits: dict[int, str] = {}
    for position, (delta, samples) in enumerate(deltas):
        if samples <= 0:
            continue  # weighted by zero, it is not part of the sum
        for name in names:
            tensor = delta[name]
            if not bool(torch.isfinite(tensor.sum())) and not bool(torch.isfinite(tensor).all()):
                culprits[position] = name
                break
    return culprits


def _weights(
    deltas: Sequence[tuple[Mapping[str, torch.Tensor], int]],
) -> tuple[list[str], list[tuple[Mapping[str, torch.Tensor], float]]]:
    """The checked names and the (delta, weight) pairs that contribute (samples > 0)."""
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
    return names, [(delta, samples / total) for delta, samples in deltas if samples > 0]


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
        #: Scratch for -Δ_avg, reused every step (never part of the state).
        self._scratch: list[torch.Tensor] | None = None

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
        grads = self._grads()
        for g, name in zip(grads, self._names, strict=True):
            torch.neg(avg_delta[name].to(device=g.device, dtype=torch.float32), out=g)
        return self._apply(grads)

    def step_average(
        self,
        deltas: Sequence[tuple[Mapping[str, torch.Tensor], int]],
        names: Sequence[str] | None = None,
        *,
        reject_non_finite: bool = False,
    ) -> dict[str, torch.Tensor]:
        """``step(weighted_average(deltas))`` in fewer passes over memory, bit for bit the same.

        The average is accumulated straight into a gradient buffer kept between
        rounds, with the weights negated (``-Σ wᵢΔᵢ`` is exactly ``-(Σ wᵢΔᵢ)`` in
        IEEE arithmetic), so a round allocates nothing and never negates a copy:
        the costs were fresh 100 MB allocations (page faults) and extra passes,
        not the arithmetic (docs/performance.md).

        With ``reject_non_finite`` a NaN or infinity in any delta raises
        ``NonFiniteDeltaError`` naming the deltas that hold one, before anything
        is changed. The check is fused with the sum: NaN and inf survive a
        weighted sum with positive weights, so a finite sum of each tensor
        (taken right after it is accumulated, while it is still in cache)
        proves every delta finite, and only a non-finite sum re-reads the
        deltas to find the culprits. A separate scan of each delta was one more
        read of every delta, as costly as the sum itself.

        ``names`` (a streaming fragment) steps only those parameters; the
        deltas then hold exactly them, and the others and their momentum are
        left alone. Returns the stepped parameters (live tensors).
        """
        _, contributing = _weights(deltas)
        index = self._subset(names)
        subset = [self._names[i] for i in index]
        template = {n: self._params[i] for n, i in zip(subset, index, strict=True)}
        check_template(contributing[0][0], template, what="delta")
        scratch = self._grads()
        grads = [scratch[i] for i in index]  # θ's order, whatever order the deltas' dicts are in
        device = grads[0].device
        first, first_weight = contributing[0]
        sums: list[torch.Tensor] = []
        # Tensor by tensor rather than delta by delta: each gradient tensor stays in cache while
        # every delta is added to it and while it is summed for the finite check.
        for g, name in zip(grads, subset, strict=True):
            torch.mul(_as_fp32(first[name].to(device)), -first_weight, out=g)
            for delta, weight in contributing[1:]:
                g.add_(_as_fp32(delta[name].to(device)), alpha=-weight)
            if reject_non_finite:
                sums.append(g.sum())
        if reject_non_finite and not bool(torch.isfinite(torch.stack(sums)).all()):
            bad = _non_finite(deltas, subset)
            if bad:
                raise NonFiniteDeltaError(bad)
            # Every delta is finite and only the sum overflowed: the arithmetic stands as it is.
        if names is None:
            return self._apply(grads)
        return self._apply_subset(grads, index)

    def _subset(self, names: Sequence[str] | None) -> list[int]:
        if names is None:
            return list(range(len(self._names)))
        position = {name: i for i, name in enumerate(self._names)}
        unknown = [n for n in names if n not in position]
        if unknown or not names or len(set(names)) != len(names):
            raise InvalidArgumentError(f"a fragment must name distinct parameters; unknown: {unknown[:5]}")
        return sorted(position[n] for n in names)

    def _apply_subset(self, grads: list[torch.Tensor], index: list[int]) -> dict[str, torch.Tensor]:
        """``_apply`` for some parameters only (one streaming fragment).

        NOTE: the buffer is allocated for every parameter at the first fragment's
        step, zero for the others: ``m·0 + g = g`` is the lazily created
        buffer's ``buf = g`` (up to the sign of a zero), so each fragment still
        behaves as its own Nesterov optimizer, and the checkpoint format (one
        buffer per parameter) is unchanged. ``steps`` counts fragment steps.
        """
        if self._buffers is None:
            self._buffers = [torch.zeros_like(p) for p in self._params]
        buffers = [self._buffers[i] for i in index]
        params = [self._params[i] for i in index]
        torch._foreach_mul_(buffers, self.momentum)
        torch._foreach_add_(buffers, grads)
        torch._foreach_add_(grads, buffers, alpha=self.momentum)
        torch._foreach_add_(params, grads, alpha=-self.lr)
        self.steps += 1
        return {self._names[i]: self._params[i] for i in index}

    def _grads(self) -> list[torch.Tensor]:
        """The gradient buffer, allocated once (θ's shapes, device and dtype) and reused every step."""
        if self._scratch is None:
            self._scratch = [torch.empty_like(p) for p in self._params]
        return self._scratch

    def _apply(self, grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
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
