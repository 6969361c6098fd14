"""Tensor payloads: safetensors bytes with wire dtypes, metadata and template checks."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import InvalidArgumentError
from hypha.tensors.payload import (
    TemplateEntry,
    check_template,
    decode_state,
    encode_state,
    read_metadata,
    template_of,
    wire_dtype,
)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(8, 5, generator=gen),
        "layer.bias": torch.randn(5, generator=gen),
        "position_ids": torch.arange(1_000_000, 1_000_016, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }


def test_fp32_round_trip_is_exact() -> None:
    # Prepare
    state = _state()

    # Execute
    decoded = decode_state(encode_state(state))

    # Assert
    assert set(decoded) == set(state)
    for name, tensor in state.items():
        assert decoded[name].dtype == tensor.dtype
        assert torch.equal(decoded[name], tensor), name


@pytest.mark.parametrize(("wire", "torch_dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_wire_casts_floats_only_and_halves_the_payload(
    wire: str, torch_dtype: torch.dtype
) -> None:
    # Prepare
    big = {"w": torch.randn(256, 256), "ids": torch.arange(1_000_000, 1_000_256)}

    # Execute
    payload = encode_state(big, wire)
    as_fp32 = decode_state(payload)
    as_wire = decode_state(payload, to_dtype=None)

    # Assert
    assert len(payload) < 0.6 * len(encode_state(big, "fp32"))
    assert as_wire["w"].dtype == torch_dtype
    assert as_fp32["w"].dtype == torch.float32
    assert torch.equal(as_fp32["w"], big["w"].to(torch_dtype).to(torch.float32))
    # Integers above bf16's exact range would be mangled by a cast: they must travel untouched.
    assert as_fp32["ids"].dtype == torch.int64
    assert torch.equal(as_fp32["ids"], big["ids"])


def test_decode_casts_to_the_requested_float_dtype() -> None:
    decoded = decode_state(encode_state({"w": torch.ones(3)}), to_dtype=torch.float64)
    assert decoded["w"].dtype == torch.float64


def test_metadata_round_trips_and_defaults_to_empty() -> None:
    payload = encode_state({"w": torch.ones(2)}, metadata={"round": "3", "kind": "delta"})
    assert read_metadata(payload) == {"round": "3", "kind": "delta"}
    assert read_metadata(encode_state({"w": torch.ones(2)})) == {}


def test_tied_non_contiguous_and_grad_tensors_encode() -> None:
    # Prepare: tied embeddings share storage, a transpose is not contiguous, a parameter requires grad.
    embedding = torch.nn.Parameter(torch.randn(4, 6))
    state = {"wte": embedding, "lm_head": embedding, "t": torch.randn(3, 5).t()}

    # Execute
    decoded = decode_state(encode_state(state))

    # Assert
    assert torch.equal(decoded["wte"], embedding.detach())
    assert torch.equal(decoded["lm_head"], embedding.detach())
    assert torch.equal(decoded["t"], state["t"])


def test_decoded_tensors_are_writable_and_independent() -> None:
    # Prepare
    payload = encode_state({"w": torch.zeros(4)})
    first = decode_state(payload)

    # Execute
    first["w"].add_(1)

    # Assert: a second decode of the same bytes is unaffected.
    assert torch.equal(decode_state(payload)["w"], torch.zeros(4))


@pytest.mark.parametrize(
    ("payload_state", "needle"),
    [
        ({"a": torch.zeros(2, 3)}, "'b'"),  # missing
        ({"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1)}, "'c'"),  # unexpected
        ({"a": torch.zeros(3, 2), "b": torch.zeros(4)}, "'a'"),  # wrong shape
    ],
)
def test_payload_not_matching_the_template_is_refused_naming_the_tensor(
    payload_state: dict[str, torch.Tensor], needle: str
) -> None:
    template: dict[str, TemplateEntry] = {"a": (2, 3), "b": torch.zeros(4)}
    with pytest.raises(InvalidArgumentError, match=needle):
        decode_state(encode_state(payload_state), expected=template)


def test_payload_matching_the_template_is_accepted() -> None:
    state = _state()
    decoded = decode_state(encode_state(state, "bf16"), expected=template_of(state))
    check_template(decoded, state)
    # Accepted means decoded as sent: floats went as bf16 (values rounded to it, back as fp32),
    # integers and booleans exactly, in their own dtype.
    assert set(decoded) == set(state)
    for name, tensor in state.items():
        assert decoded[name].shape == tensor.shape, name
        if tensor.is_floating_point():
            expected = tensor.to(torch.bfloat16).float()
        else:
            expected = tensor
        assert decoded[name].dtype == expected.dtype, name
        assert torch.equal(decoded[name], expected), name
    assert not torch.equal(decoded["layer.weight"], state["layer.weight"])  # it really was rounded


@pytest.mark.parametrize(
    ("garbage", "header_broken"),
    [
        (b"", True),
        (b"\x01\x02", True),
        (struct.pack("<Q", 10**12) + b"{}", True),
        (struct.pack("<Q", 5) + b"nojso", True),
        (struct.pack("<Q", 2) + b"[]", True),
        (encode_state({"w": torch.ones(100)})[:-7], False),  # truncated data, intact header
    ],
)
def test_malformed_bytes_are_invalid_argument(garbage: bytes, header_broken: bool) -> None:
    with pytest.raises(InvalidArgumentError):
        decode_state(garbage)
    if header_broken:
        with pytest.raises(InvalidArgumentError):
            read_metadata(garbage)


def test_unknown_wire_dtype_and_bad_metadata_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="fp8"):
        encode_state({"w": torch.ones(1)}, "fp8")
    with pytest.raises(InvalidArgumentError):
        encode_state({"w": torch.ones(1)}, metadata={"round": 3})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgumentError):
        decode_state(encode_state({"w": torch.ones(1)}), to_dtype=torch.int32)
    assert wire_dtype("bf16") is torch.bfloat16


_FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_INT_DTYPES = [torch.int64, torch.int32, torch.uint8]


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from(_FLOAT_DTYPES + _INT_DTYPES), min_size=4, max_size=4),
    wire=st.sampled_from(["fp32", "bf16", "fp16"]),
)
def test_any_state_round_trips_through_its_wire_dtype(
    shapes: list[list[int]], dtypes: list[torch.dtype], wire: str
) -> None:
    # Prepare
    gen = torch.Generator().manual_seed(1)
    state = {}
    for i, shape in enumerate(shapes):
        dtype = dtypes[i]
        base = torch.randint(0, 100, shape, generator=gen)
        state[f"t{i}"] = base.to(dtype) if not dtype.is_floating_point else (base / 7).to(dtype)
    target = wire_dtype(wire)

    # Execute
    decoded = decode_state(encode_state(state, wire), to_dtype=None)

    # Assert
    for name, tensor in state.items():
        want = tensor.to(target) if tensor.is_floating_point() else tensor
        assert decoded[name].dtype == want.dtype
        assert torch.equal(decoded[name], want), name
