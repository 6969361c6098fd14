"""Tensor payloads on the wire: a state dict as safetensors bytes.

Trainers send deltas and the parameter server sends updates and the global
state in this one format, so every byte a node receives can be checked the
same way before it touches a model: the header is parsed by safetensors (no
pickle, no code), names and shapes are compared with a template, and floating
tensors come back in the dtype the receiver computes in.

Floating tensors may travel as bf16 or fp16 to halve the traffic; non-floating
tensors (token ids, masks, counters) are never cast, because a cast would
change their values.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from hypha.errors import InvalidArgumentError
from hypha.tensors import quant

#: Content type carried by the first chunk of a tensor payload.
CONTENT_TYPE = "application/safetensors"

WireDType = Literal["fp32", "bf16", "fp16"]

#: Wire dtype names (the job spec's ``delta_dtype``) and the torch dtype each one means.
WIRE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
assert set(WIRE_DTYPES) == set(get_args(WireDType))

# safetensors refuses headers above 100 MB; so do we, before json.loads sees them.
_MAX_HEADER_BYTES = 100_000_000

#: What a template entry may be: the expected tensor itself, or its shape.
TemplateEntry = torch.Tensor | Sequence[int]


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name, or InvalidArgumentError naming the choices."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown tensor wire dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}"
        ) from None


def encode_state(
    tensors: Mapping[str, torch.Tensor],
    dtype: WireDType | str = "fp32",
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Serialize ``tensors`` as safetensors bytes, floating tensors cast to ``dtype``.

    Inputs may live on any device, be non-contiguous, require grad or share
    storage (tied embeddings): everything is detached, made contiguous on the
    CPU, and tensors sharing storage are copied so safetensors accepts them.
    """
    target = wire_dtype(dtype)
    if metadata is not None:
        _check_metadata(metadata)
    prepared: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"tensor names must be strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        out = tensor.detach()
        if out.is_floating_point():
            out = out.to(device="cpu", dtype=target)
        else:
            out = out.to(device="cpu")
        out = out.contiguous()
        if out.numel() > 0:
            # NOTE: safetensors refuses two names over one storage (tied weights); a copy
            # costs one tensor and keeps the payload self-contained.
            ptr = out.untyped_storage().data_ptr()
            if ptr in seen_storages:
                out = out.clone()
            else:
                seen_storages.add(ptr)
        prepared[name] = out
    return _st_save(prepared, metadata=dict(metadata) if metadata is not None else None)


def decode_state(
    data: bytes | bytearray | memoryview,
    to_dtype: torch.dtype | None = torch.float32,
    *,
    expected: Mapping[str, TemplateEntry] | None = None,
) -> dict[str, torch.Tensor]:
    """Parse safetensors bytes into CPU tensors; floating ones cast to ``to_dtype`` (None keeps them).

    With ``expected``, a payload whose tensor names or shapes differ from the
    template is refused with InvalidArgumentError naming the first offending
    tensor, so a wrong model's delta never reaches the arithmetic.
    Malformed bytes are InvalidArgumentError too, never a library exception.
    """
    if to_dtype is not None and not to_dtype.is_floating_point:
        raise InvalidArgumentError(f"to_dtype must be a floating dtype, got {to_dtype}")
    raw = bytes(data) if not isinstance(data, bytes) else data
    try:
        loaded = _st_load(raw)
    except (SafetensorError, ValueError, TypeError, KeyError) as exc:
        raise InvalidArgumentError(f"malformed safetensors payload: {exc}") from None
    if any(name.startswith(quant.PREFIX) for name in loaded):
        # A compressed Δ (int8 / top-k, hypha.tensors.quant): decoded to fp32 here, so every
        # receiver takes it through this one call.
        shapes = None if expected is None else template_of_entries(expected)
        loaded = quant.decode_wire(loaded, read_metadata(raw), shapes)
    if expected is not None:
        check_template(loaded, expected)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.items():
        if tensor.is_floating_point() and to_dtype is not None and tensor.dtype != to_dtype:
            out[name] = tensor.to(to_dtype)
        else:
            # NOTE: safetensors builds these tensors over immutable ``bytes``; own the memory so
            # callers may update it in place without writing into a bytes object.
            out[name] = tensor.clone()
    return out


def read_metadata(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload, read from its header alone (no tensor is parsed)."""
    view = memoryview(data)
    if len(view) < 8:
        raise InvalidArgumentError("malformed safetensors payload: shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", view[:8])
    if header_len > _MAX_HEADER_BYTES or header_len > len(view) - 8:
        raise InvalidArgumentError(f"malformed safetensors payload: header length {header_len} out of range")
    try:
        header = json.loads(bytes(view[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"malformed safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgumentError("malformed safetensors header: not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidArgumentError("malformed safetensors header: __metadata__ must map strings to strings")
    return dict(metadata)


def template_of_entries(expected: Mapping[str, TemplateEntry]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a template whose entries are tensors or shapes."""
    return {n: tuple(e.shape) if isinstance(e, torch.Tensor) else tuple(e) for n, e in expected.items()}


def template_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a state, the form ``check_template`` compares against."""
    return {name: tuple(t.shape) for name, t in tensors.items()}


def check_template(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, TemplateEntry], *, what: str = "payload"
) -> None:
    """Raise InvalidArgumentError naming the first tensor missing, unexpected, or of the wrong shape.

    ``what`` names the checked thing in the message ("payload", "delta", "state").
    """
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise InvalidArgumentError(
            f"tensor {missing[0]!r} is missing from the {what} ({len(missing)} missing in all)"
        )
    extra = [name for name in tensors if name not in expected]
    if extra:
        raise InvalidArgumentError(
            f"tensor {extra[0]!r} is not expected in the {what} ({len(extra)} unexpected in all)"
        )
    for name, want in expected.items():
        want_shape = tuple(want.shape) if isinstance(want, torch.Tensor) else tuple(want)
        got_shape = tuple(tensors[name].shape)
        if got_shape != want_shape:
            raise InvalidArgumentError(
                f"tensor {name!r} has shape {list(got_shape)} in the {what}, expected {list(want_shape)}"
            )


def _check_metadata(metadata: Mapping[str, str]) -> None:
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidArgumentError(
                f"payload metadata must map strings to strings, got {key!r}: {value!r}"
            )
