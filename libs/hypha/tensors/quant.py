"""Compressed pseudo-gradients: block-wise int8, top-k sparsification, and error feedback.

A trainer's Δ is mostly small, smooth noise around a few large entries, so it
survives heavy compression if what is lost in one round is not lost for good:
``ErrorFeedback`` keeps the residual (what the receiver will not see) on the
trainer and adds it to the next round's Δ, so the sum of what the parameter
server receives tracks the sum of the true deltas within one round's residual.

Wire format (format 1), inside an ordinary safetensors payload so that every
existing check (``read_metadata``, sizes, hashes) still applies:

- the header's ``__metadata__`` holds ``hypha.codec``: a JSON object
  ``{"format": 1, "block": B, "tensors": {name: {"shape": [...], "enc": E}}}``
  naming every compressed tensor, its original shape and its encoding E;
- a compressed tensor ``name`` is stored under reserved names
  ``hypha.q/<name>/<part>`` (``PREFIX``), never under ``name`` itself:

  ``int8``       ``q``: int8, the flattened values; ``scale``: fp32, one per block
                 of B consecutive values (absmax / 127), the last block may be short.
  ``topk``       ``idx``: int32 flat indices (int64 past 2**31 values), sorted and unique;
                 ``val``: the kept values (in the payload's float wire dtype).
  ``topk-int8``  ``idx`` as above; ``q``/``scale``: the kept values, int8 in blocks.

- tensors not named in ``hypha.codec`` (non-floating ones) travel unchanged.

``decode_wire`` is what ``hypha.tensors.payload.decode_state`` calls when a
payload holds reserved names, so a receiver (the parameter server) decodes an
int8 Δ to fp32 through the same call as an fp32 one and aggregates in fp32.
This module never imports ``payload`` (payload imports it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hypha.errors import InvalidArgumentError

#: Payload metadata key that describes the compressed tensors (see the module docstring).
CODEC_KEY = "hypha.codec"
#: Names under this prefix belong to the codec; a plain tensor may not use it.
PREFIX = "hypha.q/"
FORMAT = 1
#: Values per int8 scale. 256 keeps the scales' overhead at 1.6% of the int8 bytes.
DEFAULT_BLOCK = 256
#: Smallest top-k fraction accepted: bounds how far a payload may expand when decoded.
MIN_TOPK = 1e-4
#: Quantisation schemes a job may name (``delta_dtype``) beside the plain float dtypes.
QUANTIZED_DTYPES = ("int8",)

_ENCODINGS = ("int8", "topk", "topk-int8")


@dataclass(frozen=True)
class Compression:
    """How a Δ is compressed: ``quant`` ("int8" or None) and ``topk`` (fraction kept, None: all)."""

    quant: str | None = None
    topk: float | None = None
    block: int = DEFAULT_BLOCK
    #: The float dtype top-k values travel in without int8 (the payload's wire dtype), so the
    #: residual accounts for that rounding too.
    value_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.quant is not None and self.quant not in QUANTIZED_DTYPES:
            raise InvalidArgumentError(
                f"unknown quantisation {self.quant!r}; expected one of {QUANTIZED_DTYPES}"
            )
        if self.topk is not None and not MIN_TOPK <= self.topk <= 1.0:
            raise InvalidArgumentError(f"top-k fraction must be in [{MIN_TOPK}, 1], got {self.topk}")
        if not 1 <= self.block <= 1 << 20:
            raise InvalidArgumentError(f"quantisation block must be in [1, 2**20], got {self.block}")

    @property
    def active(self) -> bool:
        """Whether anything is lost in transit (and error feedback has work to do)."""
        return self.quant is not None or (self.topk is not None and self.topk < 1.0)


# ---- int8 blocks ---------------------------------------------------------------------------


def quantize_int8(values: torch.Tensor, block: int = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened ``values`` as (int8 codes, fp32 per-block scales); scale = absmax / 127.

    A block of zeros gets scale 0 and codes 0. Non-finite input is refused: one
    inf would zero every other value of its block.
    """
    flat = values.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise InvalidArgumentError("cannot quantise non-finite values")
    n = flat.numel()
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    grid = padded.view(blocks, block)
    scales = grid.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(grid / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.reshape(-1)[:n].contiguous(), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Inverse of ``quantize_int8``: fp32 values, flattened."""
    n = codes.numel()
    if scales.numel() != math.ceil(n / block):
        raise InvalidArgumentError(f"{scales.numel()} scales for {n} values in blocks of {block}")
    expanded = scales.to(torch.float32).repeat_interleave(block)[:n]
    return codes.to(torch.float32) * expanded


# ---- a whole state ------------------------------------------------------------------------


def compress_state(
    tensors: Mapping[str, torch.Tensor], compression: Compression
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The wire tensors and the ``hypha.codec`` metadata entry for ``tensors``.

    Floating tensors are compressed; others pass unchanged. With nothing to do
    (no quantisation, top-k off) the tensors come back as they are with no metadata.
    """
    if not compression.active:
        return dict(tensors), {}
    wire: dict[str, torch.Tensor] = {}
    described: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if name.startswith(PREFIX):
            raise InvalidArgumentError(f"tensor name {name!r} uses the reserved prefix {PREFIX!r}")
        if not tensor.is_floating_point():
            wire[name] = tensor
            continue
        flat = tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        enc = "int8"
        if compression.topk is not None and compression.topk < 1.0:
            k = max(1, math.ceil(flat.numel() * compression.topk)) if flat.numel() else 0
            idx = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
            wire[f"{PREFIX}{name}/idx"] = idx.to(torch.int32 if flat.numel() < 1 << 31 else torch.int64)
            flat = flat[idx]
            enc = "topk"
        if compression.quant == "int8":
            codes, scales = quantize_int8(flat, compression.block)
            wire[f"{PREFIX}{name}/q"] = codes
            wire[f"{PREFIX}{name}/scale"] = scales
            enc = "topk-int8" if enc == "topk" else "int8"
        else:
            wire[f"{PREFIX}{name}/val"] = flat.to(compression.value_dtype)
        described[name] = {"shape": list(tensor.shape), "enc": enc}
    codec = {"format": FORMAT, "block": compression.block, "tensors": described}
    return wire, {CODEC_KEY: json.dumps(codec, separators=(",", ":"))}


def decode_wire(
    loaded: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str],
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Rebuild the tensors of a compressed payload: decoded ones in fp32, plain ones as they are.

    Every reserved name must be accounted for by ``hypha.codec`` and every part
    must be consistent (counts, dtypes, index range), or InvalidArgumentError:
    a payload is untrusted input. ``expected_shapes`` (the receiver's template)
    is checked before anything is allocated, so a forged shape costs nothing.
    """
    codec = _parse_codec(metadata)
    block = codec["block"]
    out = {name: t for name, t in loaded.items() if not name.startswith(PREFIX)}
    used: set[str] = set()
    for name, entry in codec["tensors"].items():
        if name in out:
            raise InvalidArgumentError(f"tensor {name!r} is both plain and compressed in the payload")
        shape, enc = entry["shape"], entry["enc"]
        numel = math.prod(shape)
        if expected_shapes is not None:
            if name not in expected_shapes:
                raise InvalidArgumentError(f"tensor {name!r} is not expected in the payload")
            if tuple(expected_shapes[name]) != tuple(shape):
                want = list(expected_shapes[name])
                raise InvalidArgumentError(
                    f"tensor {name!r} has shape {list(shape)} in the payload, expected {want}"
                )

        def part(suffix: str, name: str = name) -> torch.Tensor:
            key = f"{PREFIX}{name}/{suffix}"
            if key not in loaded:
                raise InvalidArgumentError(f"compressed tensor {name!r} lacks its {suffix!r} part")
            used.add(key)
            return loaded[key]

        if enc == "int8":
            values = _dequantize_part(name, part("q"), part("scale"), block, numel)
        else:
            idx = part("idx")
            if idx.dtype not in (torch.int32, torch.int64) or idx.dim() != 1:
                raise InvalidArgumentError(f"compressed tensor {name!r}: indices must be 1-D int32/int64")
            # Without a template only the top-k floor bounds how far a forged shape expands.
            if expected_shapes is None and numel > max(1, idx.numel()) / MIN_TOPK:
                raise InvalidArgumentError(
                    f"compressed tensor {name!r}: {numel} values from {idx.numel()} kept"
                )
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= numel):
                raise InvalidArgumentError(f"compressed tensor {name!r}: an index is out of range")
            if enc == "topk":
                kept = part("val")
                if not kept.is_floating_point() or kept.shape != idx.shape:
                    raise InvalidArgumentError(f"compressed tensor {name!r}: values do not match its indices")
                kept = kept.to(torch.float32)
            else:
                kept = _dequantize_part(name, part("q"), part("scale"), block, idx.numel())
            values = torch.zeros(numel, dtype=torch.float32)
            values[idx.to(torch.int64)] = kept
        out[name] = values.reshape(shape)
    stray = [name for name in loaded if name.startswith(PREFIX) and name not in used]
    if stray:
        raise InvalidArgumentError(f"payload tensor {stray[0]!r} is not described by {CODEC_KEY}")
    return out


def _dequantize_part(
    name: str, codes: torch.Tensor, scales: torch.Tensor, block: int, numel: int
) -> torch.Tensor:
    if codes.dtype != torch.int8 or codes.dim() != 1 or codes.numel() != numel:
        raise InvalidArgumentError(f"compressed tensor {name!r}: expected {numel} int8 codes")
    if not scales.is_floating_point() or scales.dim() != 1 or not bool(torch.isfinite(scales).all()):
        raise InvalidArgumentError(f"compressed tensor {name!r}: scales must be finite floats")
    return dequantize_int8(codes, scales, block)


def _parse_codec(metadata: Mapping[str, str]) -> dict[str, Any]:
    raw = metadata.get(CODEC_KEY)
    if raw is None:
        raise InvalidArgumentError(f"payload has reserved {PREFIX!r} tensors but no {CODEC_KEY} metadata")
    try:
        codec = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"malformed {CODEC_KEY}: {exc}") from None
    if not isinstance(codec, dict) or codec.get("format") != FORMAT:
        raise InvalidArgumentError(f"unsupported {CODEC_KEY} format (expected {FORMAT})")
    block, tensors = codec.get("block"), codec.get("tensors")
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= 1 << 20:
        raise InvalidArgumentError(f"{CODEC_KEY}: bad block size {block!r}")
    if not isinstance(tensors, dict):
        raise InvalidArgumentError(f"{CODEC_KEY}: 'tensors' must be an object")
    for name, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or entry.get("enc") not in _ENCODINGS
        ):
            raise InvalidArgumentError(f"{CODEC_KEY}: bad entry for tensor {name!r}")
    return codec


# ---- error feedback -----------------------------------------------------------------------


class ErrorFeedback:
    """The trainer's memory of what compression dropped, added back to the next Δ.

    ``compress(delta)`` compresses ``delta + residual`` and keeps the new
    residual ``(delta + residual) - decoded``; the receiver's cumulative sum of
    decoded deltas therefore equals the cumulative true deltas minus the
    current residual, which stays bounded (one round's compression error).
    """

    def __init__(self, compression: Compression) -> None:
        self.compression = compression
        self.residual: dict[str, torch.Tensor] = {}

    def compress(
        self, delta: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, torch.Tensor]]:
        """(wire tensors, codec metadata, decoded Δ as the receiver will see it)."""
        corrected = {
            name: t.detach().to(torch.float32) + self.residual[name] if name in self.residual else t
            for name, t in delta.items()
        }
        wire, meta = compress_state(corrected, self.compression)
        decoded = decode_wire(wire, meta) if meta else dict(corrected)
        if self.compression.active:
            # update, not replace: a delta may cover only some tensors (a streaming fragment),
            # and the others keep their residual for their own next sync.
            self.residual.update(
                {
                    name: corrected[name].to(torch.float32) - decoded[name]
                    for name in corrected
                    if corrected[name].is_floating_point()
                }
            )
        return wire, meta, decoded

    def reset(self) -> None:
        self.residual = {}
