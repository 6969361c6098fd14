"""Compressed deltas: int8 blocks and top-k round trips, the wire format's checks, error feedback."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import InvalidArgumentError
from hypha.tensors import quant
from hypha.tensors.deltas import DeltaEncoder, compression_for
from hypha.tensors.payload import decode_state, encode_state, read_metadata
from hypha.tensors.quant import CODEC_KEY, PREFIX, Compression, ErrorFeedback

shapes = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=3)


def _tensor(shape: list[int], seed: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * scale


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-6, 1e3),
    block=st.sampled_from([1, 7, 64, 256]),
)
def test_int8_round_trip_error_is_within_half_a_step_of_each_block(
    shape: list[int], seed: int, scale: float, block: int
) -> None:
    # Prepare
    values = _tensor(shape, seed, scale)

    # Execute
    codes, scales = quant.quantize_int8(values, block)
    back = quant.dequantize_int8(codes, scales, block).reshape(values.shape)

    # Assert: each value is off by at most half a quantisation step of its own block.
    assert codes.dtype == torch.int8 and scales.numel() == math.ceil(values.numel() / block)
    step = scales.repeat_interleave(block)[: values.numel()].reshape(values.shape)
    # (plus fp32 rounding of the values themselves)
    assert bool(((back - values).abs() <= step / 2 * (1 + 1e-5) + 4e-7 * values.abs() + 1e-30).all())


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16), topk=st.sampled_from([None, 0.01, 0.3]))
def test_payload_round_trip_keeps_names_shapes_and_the_largest_entries(
    shape: list[int], seed: int, topk: float | None
) -> None:
    # Prepare
    state = {"w": _tensor(shape, seed, 1.0), "ids": torch.arange(4)}
    encoder = DeltaEncoder("int8", topk)

    # Execute
    decoded = decode_state(encoder.encode(state), expected={"w": state["w"], "ids": state["ids"]})

    # Assert
    assert decoded["w"].shape == state["w"].shape and decoded["w"].dtype == torch.float32
    assert torch.equal(decoded["ids"], state["ids"])
    if topk is not None and state["w"].numel():
        kept = int((decoded["w"] != 0).sum())
        assert kept <= max(1, math.ceil(state["w"].numel() * topk))
        # The largest entry is kept, and int8 reproduces a block's absmax exactly (code ±127).
        top = state["w"].abs().argmax()
        assert torch.isclose(decoded["w"].flatten()[top], state["w"].flatten()[top], rtol=1e-5)


def test_int8_bytes_are_about_a_quarter_of_fp32() -> None:
    # Prepare: GPT-2-like tensor sizes, none a multiple of the block.
    gen = torch.Generator().manual_seed(0)
    delta = {f"h.{i}.w": torch.randn(300, 301, generator=gen) * 1e-3 for i in range(4)}

    # Execute
    fp32 = len(encode_state(delta, "fp32"))
    int8 = len(DeltaEncoder("int8").encode(delta))

    # Assert: one byte per value plus one fp32 scale per 256 values, plus a header.
    values = sum(t.numel() for t in delta.values())
    assert int8 <= values * (1 + 4 / 256) + 4096
    assert 0.24 < int8 / fp32 < 0.27


def test_topk_int8_sends_indices_and_codes_only() -> None:
    # Prepare
    delta = {"w": torch.randn(100_000, generator=torch.Generator().manual_seed(1))}

    # Execute
    blob = DeltaEncoder("int8", 0.01).encode(delta)

    # Assert: 1000 int32 indices + 1000 int8 codes + 4 scales, plus the header.
    assert len(blob) < 1000 * 5 + 4 * 4 + 2048
    codec = json.loads(read_metadata(blob)[CODEC_KEY])
    assert codec["tensors"]["w"] == {"shape": [100_000], "enc": "topk-int8"}


def test_bf16_topk_values_travel_as_bf16() -> None:
    delta = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(2))}

    raw = decode_state(DeltaEncoder("bf16", 0.1).encode(delta), None)

    assert raw["w"].dtype == torch.float32  # decoded back to fp32 by the receiver
    assert int((raw["w"] != 0).sum()) == 100


@pytest.mark.parametrize("dtype,topk", [("int8", None), ("int8", 0.05), ("fp32", 0.05), ("bf16", 0.05)])
def test_error_feedback_keeps_the_received_sum_within_one_residual_of_the_true_sum(
    dtype: str, topk: float | None
) -> None:
    # Prepare: 100 rounds of deltas with a persistent direction plus noise.
    gen = torch.Generator().manual_seed(3)
    drift = torch.randn(2048, generator=gen) * 1e-3
    encoder = DeltaEncoder(dtype, topk)
    true_sum = torch.zeros(2048)
    received = torch.zeros(2048)
    template = {"w": (2048,)}

    # Execute
    residual_norms = []
    for _ in range(100):
        delta = drift + torch.randn(2048, generator=gen) * 1e-3
        true_sum += delta
        received += decode_state(encoder.encode({"w": delta}), expected=template)["w"]
        residual_norms.append(float(encoder.residual["w"].norm()))

    # Assert: the gap is exactly the residual, and the residual levels off instead of growing.
    torch.testing.assert_close(true_sum - received, encoder.residual["w"], rtol=0, atol=1e-5)
    assert max(residual_norms[50:]) < 1.2 * max(residual_norms[:50])
    assert float((true_sum - received).norm()) < 0.15 * float(true_sum.norm())


def test_without_error_feedback_topk_loses_the_small_directions() -> None:
    # The control for the test above: the same stream, compressed without the residual.
    gen = torch.Generator().manual_seed(3)
    drift = torch.randn(2048, generator=gen) * 1e-3
    compression = compression_for("int8", 0.05)
    true_sum, received = torch.zeros(2048), torch.zeros(2048)
    for _ in range(100):
        delta = drift + torch.randn(2048, generator=gen) * 1e-3
        true_sum += delta
        wire, meta = quant.compress_state({"w": delta}, compression)
        received += quant.decode_wire(wire, meta)["w"]
    assert float((true_sum - received).norm()) > 0.5 * float(true_sum.norm())


def test_lossless_settings_keep_no_residual() -> None:
    encoder = DeltaEncoder("fp32")
    blob = encoder.encode({"w": torch.ones(3)})
    assert encoder.residual == {} and CODEC_KEY not in read_metadata(blob)


def _int8_payload() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    return quant.compress_state({"w": torch.randn(10, 10)}, Compression(quant="int8"))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w, m: m.pop(CODEC_KEY), "no hypha.codec"),
        (lambda w, m: m.update({CODEC_KEY: "{"}), "malformed hypha.codec"),
        (lambda w, m: m.update({CODEC_KEY: m[CODEC_KEY].replace('"format":1', '"format":9')}), "unsupported"),
        (lambda w, m: m.update({CODEC_KEY: m[CODEC_KEY].replace("[10,10]", "[10,11]")}), r"shape \[10, 11\]"),
        (lambda w, m: w.pop(f"{PREFIX}w/scale"), "lacks its 'scale' part"),
        (lambda w, m: w.update({f"{PREFIX}w/scale": torch.ones(3)}), "scales for 100 values"),
        (lambda w, m: w.update({f"{PREFIX}w/q": torch.zeros(100)}), "int8 codes"),
        (lambda w, m: w.update({f"{PREFIX}x/q": torch.zeros(1, dtype=torch.int8)}), "not described"),
        (lambda w, m: w.update({f"{PREFIX}w/scale": torch.full((1,), math.inf)}), "finite"),
    ],
)
def test_forged_compressed_payloads_are_refused_by_name(mutate: object, message: str) -> None:
    # Prepare
    wire, meta = _int8_payload()
    mutate(wire, meta)  # type: ignore[operator]

    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match=message):
        decode_state(encode_state(wire, "fp32", metadata=meta), expected={"w": (10, 10)})


def test_topk_indices_out_of_range_or_too_sparse_are_refused() -> None:
    wire, meta = quant.compress_state({"w": torch.randn(1000)}, Compression(topk=0.01))
    wire[f"{PREFIX}w/idx"][0] = 5000
    with pytest.raises(InvalidArgumentError, match="out of range"):
        quant.decode_wire(wire, meta)
    forged = {"format": 1, "block": 256, "tensors": {"w": {"shape": [10**9], "enc": "topk"}}}
    tiny = {f"{PREFIX}w/idx": torch.zeros(1, dtype=torch.int32), f"{PREFIX}w/val": torch.ones(1)}
    with pytest.raises(InvalidArgumentError, match="kept"):
        quant.decode_wire(tiny, {CODEC_KEY: json.dumps(forged)})


def test_settings_are_validated() -> None:
    with pytest.raises(InvalidArgumentError, match="top-k fraction"):
        Compression(topk=1e-6)
    with pytest.raises(InvalidArgumentError, match="unknown delta dtype 'int4'"):
        compression_for("int4")
    with pytest.raises(InvalidArgumentError, match="reserved prefix"):
        ErrorFeedback(Compression(quant="int8")).compress({f"{PREFIX}x": torch.ones(1)})
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        quant.quantize_int8(torch.tensor([1.0, math.nan]))
