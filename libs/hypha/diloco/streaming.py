"""Streaming DiLoCo as pure logic: fragments, their staggered sync schedule, per-fragment outer steps.

Plain DiLoCo moves the whole model at every sync, so the network sits idle
for H inner steps and then carries a full model's Δ at once. Streaming DiLoCo
(Douillard et al., 2025) splits the parameters into F fragments and syncs
fragment f every H inner steps too, but offset by ``f·H/F``: each sync moves
about 1/F of the model, the peak traffic drops by F, and while a fragment is
in flight the trainer keeps computing (``overlap_steps``), merging the new
θ_global of the fragment into its local copy when it arrives.

Everything here is synchronous and free of I/O: ``partition`` decides the
fragments, ``StreamingSchedule`` which fragments send and which updates land
at each inner step, ``FragmentedOuter`` keeps one ``NesterovOuter`` per
fragment. ``benchmarks/convergence.py`` drives them in-process.

In a job (``streaming_fragments = F``) the rounds *are* the fragment syncs:
round r carries fragment ``fragment_of_round(r, F)`` = r mod F, so with
rounds of H/F inner steps fragment f syncs every H steps at offset f·H/F,
the schedule above (``StreamingSchedule`` with ``inner_steps = F·round``, each
fragment's first sync coming early by ``H - (f+1)·H/F`` steps). The parameter
server steps only that fragment (``ParameterServerCore(fragments=...)``,
``NesterovOuter.step_average(names=...)``, the same arithmetic as
``FragmentedOuter``); the trainer sends the fragment's Δ in the background,
keeps training, and ``rebase_fragment`` merges the new θ_global when it lands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hypha.diloco.outer import NesterovOuter, weighted_average
from hypha.errors import InvalidArgumentError


def partition(sizes: Mapping[str, int], fragments: int) -> list[list[str]]:
    """Split parameter names, in order, into ``fragments`` contiguous groups of about equal size.

    Contiguous groups keep a layer's tensors together (the paper fragments by
    layer). A group is closed once it reaches its share of the remaining
    elements, and no group is ever empty, so there must be at least
    ``fragments`` parameters.
    """
    names = list(sizes)
    if fragments < 1:
        raise InvalidArgumentError(f"fragments must be >= 1, got {fragments}")
    if len(names) < fragments:
        raise InvalidArgumentError(f"{len(names)} parameters cannot make {fragments} fragments")
    groups: list[list[str]] = []
    remaining = sum(sizes.values())
    i = 0
    for f in range(fragments):
        left = fragments - f
        share = remaining / left
        group: list[str] = []
        taken = 0
        # Leave at least one name for each later group.
        while i < len(names) - (left - 1) and (
            not group or taken + sizes[names[i]] / 2 <= share or left == 1
        ):
            group.append(names[i])
            taken += sizes[names[i]]
            i += 1
        groups.append(group)
        remaining -= taken
    return groups


def fragments_for(params: Mapping[str, torch.Tensor], fragments: int) -> list[list[str]] | None:
    """A job's fragments of ``params`` (by element count, in order); None when streaming is off (F <= 1)."""
    if fragments <= 1:
        return None
    return partition({name: t.numel() for name, t in params.items()}, fragments)


def fragment_of_round(round_number: int, fragments: int) -> int:
    """The fragment a job's round syncs: rounds cycle through the fragments in order."""
    if fragments < 1:
        raise InvalidArgumentError(f"fragments must be >= 1, got {fragments}")
    return round_number % fragments


@dataclass(frozen=True)
class StreamingSchedule:
    """When each fragment syncs: fragment f at inner steps ``offset(f) + k·H`` (k >= 1).

    ``step`` counts completed inner steps from 1. ``overlap_steps`` is how many
    inner steps a fragment's exchange takes: its new θ_global is merged at
    ``sync step + overlap_steps`` (0: at once, before the next inner step).
    """

    inner_steps: int
    fragments: int
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise InvalidArgumentError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if not 1 <= self.fragments <= self.inner_steps:
            raise InvalidArgumentError(f"fragments must be in [1, inner_steps], got {self.fragments}")
        if not 0 <= self.overlap_steps < self.inner_steps:
            raise InvalidArgumentError(
                f"overlap_steps must be in [0, {self.inner_steps}): a fragment lands before its next sync"
            )

    def offset(self, fragment: int) -> int:
        return fragment * self.inner_steps // self.fragments

    def syncing(self, step: int) -> list[int]:
        """Fragments whose Δ is sent after inner step ``step``."""
        return [
            f
            for f in range(self.fragments)
            if step - self.offset(f) > 0 and (step - self.offset(f)) % self.inner_steps == 0
        ]

    def landing(self, step: int) -> list[int]:
        """Fragments whose new θ_global is merged after inner step ``step``."""
        return self.syncing(step - self.overlap_steps) if step - self.overlap_steps > 0 else []


def merge_fragment(
    local: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor], mix: float
) -> None:
    """``local ← mix·local + (1 - mix)·global`` in place (``mix`` 0: take θ_global as it is).

    With overlap, ``local`` has moved on while the fragment was in flight; the
    paper keeps part of that progress (its alpha) instead of discarding it.
    """
    if not 0.0 <= mix < 1.0:
        raise InvalidArgumentError(f"mix must be in [0, 1), got {mix}")
    with torch.no_grad():
        for name, value in global_.items():
            target = local[name]
            if mix == 0.0:
                target.copy_(value)
            else:
                target.mul_(mix).add_(value.to(target.dtype), alpha=1.0 - mix)


def rebase_fragment(
    local: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor]
) -> None:
    """``local ← local + (global - sent)`` in place: θ_global lands, the steps taken since the send stay.

    ``sent`` is the local fragment as it was when its Δ left. The trainer's
    next Δ for the fragment (``local - global``) then carries the progress
    made while the fragment was in flight instead of discarding it
    (``merge_fragment`` with mix 0 discards it; without overlap both are
    "take θ_global").
    """
    with torch.no_grad():
        for name, value in global_.items():
            target = local[name]
            # global + (local - sent), not local + (global - sent): with no step since the send
            # the difference is exactly 0 and the fragment becomes θ_global bit for bit.
            moved = target.detach().to(device="cpu", dtype=torch.float32) - sent[name]
            target.copy_((value + moved).to(device=target.device, dtype=target.dtype))


class FragmentedOuter:
    """θ_global as F fragments, each stepped by its own Nesterov outer optimizer."""

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        fragments: Sequence[Sequence[str]],
        lr: float,
        momentum: float,
    ) -> None:
        seen = [name for group in fragments for name in group]
        if sorted(seen) != sorted(params) or len(seen) != len(set(seen)):
            raise InvalidArgumentError("fragments must cover every parameter exactly once")
        self.fragments = [list(group) for group in fragments]
        self.outers = [NesterovOuter({n: params[n] for n in group}, lr, momentum) for group in self.fragments]

    def step(
        self, fragment: int, deltas: Sequence[tuple[Mapping[str, torch.Tensor], int]]
    ) -> dict[str, torch.Tensor]:
        """Average the fragment's deltas by samples and apply its outer step; its new θ_global."""
        return self.outers[fragment].step(weighted_average(deltas))

    def parameters(self) -> dict[str, torch.Tensor]:
        """The whole θ_global (live tensors)."""
        out: dict[str, torch.Tensor] = {}
        for outer in self.outers:
            out |= outer.parameters()
        return out
