"""The tensors of a reference-style trainer's rounds, converted to and from our parameter server's.

The reference trainer sends θ_local - θ_before (its ``extract_gradients``:
every entry of its ``state_dict``, in its own dtype) and, after the round,
merges what it receives by adding it to the θ_before it kept. Our parameter
server takes Δ = θ_local - θ_global over the model's parameters alone (fp32,
with the round and the samples in the payload's metadata) and publishes each
round's new θ_global whole. So the bridge:

- sends the parameters' entries of the trainer's file as our Δ, relative to
  the θ_global it last handed the trainer (the parameter server's θ at the
  trainer's start, then each update): the same difference, since the
  trainer's θ_before is that θ;
- answers an update with θ_new - θ_before for every entry the trainer sent
  (its merge reads all of them): a parameter's difference; a tied alias (an
  entry equal to a parameter's, ``lm_head.weight`` beside the embedding) the
  same difference; anything else (buffers) zero.

Synchronous, torch-loading code: the bridge calls it through ``asyncio.to_thread``
and only for reference-style executions, so a worker without such jobs never
imports torch for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from hypha.errors import InvalidArgumentError
from hypha.tensors.payload import decode_state, encode_state


@dataclass(frozen=True)
class SentLayout:
    """What the trainer's file held: each entry's shape and dtype, and the parameter it aliases."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    #: Entry -> the parameter whose difference it carries (itself for a parameter).
    aliases: dict[str, str]


def decode_global(data: bytes) -> dict[str, torch.Tensor]:
    """The parameter server's θ_global (fp32, parameters only)."""
    return decode_state(data, torch.float32)


def delta_payload(
    trainer_file: Path, theta: Mapping[str, torch.Tensor], round_number: int, samples: int
) -> tuple[bytes, SentLayout]:
    """Our Δ payload from the trainer's file, and the file's layout for the update that answers it."""
    try:
        sent = load_file(str(trainer_file))
    except Exception as exc:  # safetensors raises its own error types (and OSError)
        raise InvalidArgumentError(f"{trainer_file.name} is not a SafeTensors file: {exc}") from None
    delta: dict[str, torch.Tensor] = {}
    for name, reference in theta.items():
        tensor = sent.get(name)
        if tensor is None:
            raise InvalidArgumentError(f"{trainer_file.name} lacks the model parameter {name!r}")
        if tuple(tensor.shape) != tuple(reference.shape):
            raise InvalidArgumentError(
                f"{trainer_file.name}: {name!r} has shape {tuple(tensor.shape)}, "
                f"the model's is {tuple(reference.shape)}"
            )
        delta[name] = tensor.to(torch.float32)
    aliases = {name: name for name in theta}
    for name, tensor in sent.items():
        if name in aliases or not tensor.is_floating_point():
            continue
        for param, value in delta.items():
            if value.shape == tensor.shape and torch.equal(value, tensor.to(torch.float32)):
                aliases[name] = param
                break
    layout = SentLayout(
        shapes={name: tuple(t.shape) for name, t in sent.items()},
        dtypes={name: t.dtype for name, t in sent.items()},
        aliases=aliases,
    )
    metadata = {"round": str(round_number), "samples": str(samples)}
    return encode_state(delta, "fp32", metadata=metadata), layout


def update_file(
    theta_new: Mapping[str, torch.Tensor], theta_before: Mapping[str, torch.Tensor], layout: SentLayout
) -> bytes:
    """θ_new - θ_before for every entry the trainer sent, in its dtypes (zero where none moved)."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in layout.shapes.items():
        param = layout.aliases.get(name)
        if param is not None and param in theta_new:
            diff = theta_new[param] - theta_before[param]
        else:
            diff = torch.zeros(shape, dtype=torch.float32)
        out[name] = diff.to(layout.dtypes[name]).contiguous()
    return st_save(out)


def zero_update(layout: SentLayout) -> bytes:
    """An update that changes nothing: the final round's, when its update was not served."""
    return st_save(
        {name: torch.zeros(shape, dtype=layout.dtypes[name]) for name, shape in layout.shapes.items()}
    )


__all__ = ["SentLayout", "decode_global", "delta_payload", "update_file", "zero_update"]
