"""Tensor chunks encoded and read without protobuf's copies (``hypha.worker.tensor_frames``) are
the messages the generated code builds and reads, so either end may use either."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from hypha.net.wire import with_codecs
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from hypha.worker.tensor_frames import (
    GRPC_PREFIX_BYTES,
    encode_tensor_chunk,
    parse_tensor_chunk,
    wire_bytes,
)

pytestmark = pytest.mark.timeout(60)

headers = st.builds(
    worker_pb2.TensorChunk,
    job_id=st.text(max_size=12),
    round=st.integers(0, 2**32 - 1),
    kind=st.sampled_from(["delta", "update", "global", ""]),
    samples=st.integers(0, 2**64 - 1),
)
chunks = st.builds(
    common_pb2.Chunk,
    offset=st.integers(0, 2**40),
    total_size=st.integers(0, 2**40),
    content_type=st.text(max_size=12),
    last=st.booleans(),
    sha256=st.text(max_size=64),
)


@given(header=headers, chunk=chunks, data=st.binary(max_size=3000))
def test_an_encoded_tensor_chunk_is_the_generated_message_and_reads_back_the_same(
    header: worker_pb2.TensorChunk, chunk: common_pb2.Chunk, data: bytes
) -> None:
    expected = worker_pb2.TensorChunk()
    expected.CopyFrom(header)
    expected.chunk.CopyFrom(chunk)
    expected.chunk.data = data

    encoded = encode_tensor_chunk(header, chunk, data)
    view = parse_tensor_chunk(encoded)

    assert worker_pb2.TensorChunk.FromString(encoded) == expected
    assert (view.job_id, view.kind, view.round, view.samples) == (
        header.job_id,
        header.kind,
        header.round,
        header.samples,
    )
    assert view.chunk.header == chunk
    assert bytes(view.chunk.data) == data
    assert wire_bytes(encoded) == wire_bytes(view) == len(encoded) + GRPC_PREFIX_BYTES
    # An empty data (or chunk) field is written out where protobuf leaves it off: a few bytes more.
    assert 0 <= wire_bytes(encoded) - wire_bytes(expected) <= 4
    # What a peer with the generated stubs sends (fields in the generated order) reads the same.
    generic = parse_tensor_chunk(expected.SerializeToString())
    assert generic.header == view.header and bytes(generic.chunk.data) == data


def test_a_tensor_chunk_without_a_chunk_reads_as_an_empty_one_and_garbage_is_refused() -> None:
    view = parse_tensor_chunk(worker_pb2.TensorChunk(job_id="j", kind="delta").SerializeToString())
    assert view.job_id == "j" and view.chunk.offset == 0 and bytes(view.chunk.data) == b""

    truncated = encode_tensor_chunk(worker_pb2.TensorChunk(job_id="j"), common_pb2.Chunk(), b"x" * 50)[:-5]
    with pytest.raises(DecodeError):
        parse_tensor_chunk(truncated)


def test_with_codecs_refuses_a_method_the_service_lacks() -> None:
    add = with_codecs(worker_pb2_grpc.add_WorkerServicer_to_server, {"PushTensor": {}})

    class Server:
        def add_generic_rpc_handlers(self, handlers: object) -> None:
            raise AssertionError("nothing is registered")

        add_registered_method_handlers = add_generic_rpc_handlers

    with pytest.raises(KeyError, match="PushTensor"):
        add(worker_pb2_grpc.WorkerServicer(), Server())
