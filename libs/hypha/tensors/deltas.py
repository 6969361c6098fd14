"""The sender's side of a pseudo-gradient: Δ -> payload bytes, with error feedback when lossy.

A job's ``delta_dtype`` (fp32, bf16, fp16 or int8) and ``delta_topk`` decide
how a trainer's Δ travels. ``DeltaEncoder`` turns them into one object the
trainer (and ``benchmarks/convergence.py``) calls once per round: it adds the
residual that the last round's compression dropped, compresses, remembers the
new residual and returns the payload bytes that ``decode_state`` on the
parameter server turns back into fp32.

NOTE: bf16/fp16 without top-k keep no residual (the rounding of a cast is
tiny next to int8's and this keeps the default paths exactly as before);
int8 and top-k always use error feedback, without which they stall training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hypha.errors import InvalidArgumentError
from hypha.tensors.payload import WIRE_DTYPES, encode_state, wire_dtype
from hypha.tensors.quant import QUANTIZED_DTYPES, Compression, ErrorFeedback

#: Every ``delta_dtype`` name a job may use.
DELTA_DTYPE_NAMES = (*WIRE_DTYPES, *QUANTIZED_DTYPES)


def compression_for(dtype: str, topk: float | None = None) -> Compression:
    """The compression a ``delta_dtype`` name and a ``delta_topk`` fraction (None/0/1: off) mean."""
    if dtype not in DELTA_DTYPE_NAMES:
        raise InvalidArgumentError(
            f"unknown delta dtype {dtype!r}; expected one of {list(DELTA_DTYPE_NAMES)}"
        )
    fraction = topk if topk and topk < 1.0 else None
    if dtype in QUANTIZED_DTYPES:
        return Compression(quant=dtype, topk=fraction)
    return Compression(topk=fraction, value_dtype=wire_dtype(dtype))


class DeltaEncoder:
    """One trainer's Δ codec for a job: stateless for plain floats, error feedback when lossy."""

    def __init__(self, dtype: str = "fp32", topk: float | None = None) -> None:
        self.compression = compression_for(dtype, topk)
        # int8 codes are not floating, so encode_state leaves them alone; fp32 keeps the scales exact.
        self.float_dtype = "fp32" if dtype in QUANTIZED_DTYPES else dtype
        self.feedback = ErrorFeedback(self.compression)

    @property
    def residual(self) -> dict[str, torch.Tensor]:
        """What the receiver has not yet seen of the deltas so far (empty when lossless)."""
        return self.feedback.residual

    def encode(self, delta: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
        """Payload bytes for ``delta`` (plus the carried residual); updates the residual."""
        if not self.compression.active:
            return encode_state(delta, self.float_dtype, metadata=metadata)
        wire, codec, _ = self.feedback.compress(delta)
        return encode_state(wire, self.float_dtype, metadata={**(metadata or {}), **codec})
