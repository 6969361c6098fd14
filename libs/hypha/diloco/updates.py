"""Each round's update on its way down: θ_global itself, or its change in a smaller dtype.

A whole-model round moves the model's size twice per trainer: Δ up, the update
down. ``delta_dtype`` shrinks the way up; ``update_dtype`` (the job's key)
shrinks the way down. With ``update_dtype`` other than fp32 the parameter
server sends, instead of θ_global, the change of θ_global since the θ_global
the trainers hold, encoded like a Δ (int8: block-wise with error feedback, the
rounding residual carried into the next round's change).

The trainers cannot know what the rounding dropped, so θ_global is *defined*
as what they rebuild: after the outer step the server sets θ_global (and the
state it checkpoints) to ``held + decode(encoded change)``, the same fp32
addition of the same decoded bytes each trainer performs, and every trainer
and the server hold bit-identical values. The outer step's remainder is not
lost: the encoder keeps it and adds it to the next round's change. A restarted
server starts with no residual (at most one round's rounding is dropped).

A change names the round of the θ_global it applies to (``BASE_ROUND_KEY``); a
trainer whose θ_global is of another round (it missed an update) must fetch
θ_global whole instead (``global_sync``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hypha.errors import InvalidArgumentError
from hypha.tensors.deltas import DeltaEncoder
from hypha.tensors.payload import decode_state, read_metadata

#: Metadata of a change payload: the global round (θ_global after that many rounds) it applies to.
BASE_ROUND_KEY = "update_base_round"


class UpdateEncoder:
    """The parameter server's side: what the trainers hold, and the codec (with its residual)."""

    def __init__(self, dtype: str, params: Mapping[str, torch.Tensor]) -> None:
        if dtype == "fp32":
            raise InvalidArgumentError("fp32 updates are θ_global itself: no change to encode")
        self.encoder = DeltaEncoder(dtype)
        #: θ_global as every trainer holds it (fp32, CPU): the base of the next change.
        self.held = {
            n: t.detach().to(device="cpu", dtype=torch.float32, copy=True) for n, t in params.items()
        }

    def encode(
        self,
        live: Mapping[str, torch.Tensor],
        names: Sequence[str],
        base_round: int,
        metadata: Mapping[str, str],
    ) -> bytes:
        """The change of ``names`` from the held θ_global to ``live``, encoded; ``live`` and the held
        copy are then set, in place, to what a trainer rebuilds from it."""
        change = {n: live[n].detach().to(device="cpu", dtype=torch.float32) - self.held[n] for n in names}
        blob = self.encoder.encode(change, {**metadata, BASE_ROUND_KEY: str(base_round)})
        decoded = decode_state(blob, torch.float32, expected=change)
        with torch.no_grad():
            for name in names:
                rebuilt = rebuild(self.held[name], decoded[name])
                live[name].copy_(rebuilt)
                self.held[name] = rebuilt
        return blob


def rebuild(held: torch.Tensor, change: torch.Tensor) -> torch.Tensor:
    """θ_global from the held one and a decoded change: the one addition both sides perform."""
    return held + change


def change_base(data: bytes) -> int | None:
    """The global round a change payload applies to; None for θ_global itself (fp32 updates)."""
    value = read_metadata(data).get(BASE_ROUND_KEY)
    if value is None:
        return None
    if not value.isdigit():
        raise InvalidArgumentError(f"update: {BASE_ROUND_KEY} is {value!r}, not a round")
    return int(value)


def apply_change(data: bytes, held: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The new θ_global of ``held``'s tensors (the names the payload must hold) from a change payload."""
    change = decode_state(data, torch.float32, expected=held)
    return {n: rebuild(held[n], change[n]) for n in held}
