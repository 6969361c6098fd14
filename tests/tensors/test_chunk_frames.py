"""Chunks encoded and read without protobuf's copies (``hypha.tensors.chunk_frames``) are exactly
the messages the generated code builds and reads, whichever side uses which."""

from __future__ import annotations

import hashlib

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from hypha.errors import DataLossError
from hypha.tensors.chunk_frames import encode_chunk, parse_chunk
from hypha.tensors.chunks import ChunkAssembler, split_payload
from hypha.v1 import common_pb2

pytestmark = pytest.mark.timeout(60)

headers = st.builds(
    common_pb2.Chunk,
    offset=st.integers(0, 2**63),
    total_size=st.integers(0, 2**63),
    content_type=st.text(max_size=20),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    last=st.booleans(),
    sha256=st.text(max_size=64),
)


@given(header=headers, data=st.binary(max_size=3000))
def test_an_encoded_chunk_is_the_generated_message_and_reads_back_the_same(
    header: common_pb2.Chunk, data: bytes
) -> None:
    expected = common_pb2.Chunk()
    expected.CopyFrom(header)
    expected.data = data

    encoded = encode_chunk(header, data)
    view = parse_chunk(encoded)

    assert common_pb2.Chunk.FromString(encoded) == expected
    assert isinstance(view.data, memoryview)
    assert bytes(view.data) == data
    assert (view.offset, view.total_size, view.content_type, view.last, view.sha256) == (
        header.offset,
        header.total_size,
        header.content_type,
        header.last,
        header.sha256,
    )
    assert dict(view.metadata) == dict(header.metadata)
    # What a peer with the generated code sends reads the same way.
    generic = parse_chunk(expected.SerializeToString())
    assert bytes(generic.data) == data
    assert generic.header == view.header


def test_a_chunk_whose_data_field_repeats_reads_as_protobuf_reads_it_the_last_one_wins() -> None:
    raw = common_pb2.Chunk(offset=3, data=b"first").SerializeToString()
    raw += common_pb2.Chunk(data=b"second").SerializeToString()

    view = parse_chunk(raw)

    assert bytes(view.data) == common_pb2.Chunk.FromString(raw).data == b"second"
    assert view.offset == 3


def test_malformed_bytes_are_refused_like_protobuf_refuses_them() -> None:
    truncated = encode_chunk(common_pb2.Chunk(offset=1), b"x" * 100)[:-10]
    with pytest.raises(DecodeError):
        common_pb2.Chunk.FromString(truncated)
    with pytest.raises(DecodeError):
        parse_chunk(truncated)


def test_an_assembler_fed_views_verifies_and_returns_the_payload() -> None:
    payload = bytes(range(256)) * 5000  # 1.2 MB: two chunks of 1 MiB
    assembler = ChunkAssembler(max_bytes=len(payload))
    for chunk in split_payload(payload, content_type="x"):
        assembler.feed(parse_chunk(chunk.SerializeToString()))
    assert assembler.finish() == payload

    corrupt = ChunkAssembler(max_bytes=len(payload))
    chunks = [parse_chunk(c.SerializeToString()) for c in split_payload(payload)]
    bad = common_pb2.Chunk()
    bad.CopyFrom(chunks[-1].header)
    bad.sha256 = hashlib.sha256(b"other").hexdigest()
    corrupt.feed(chunks[0])
    with pytest.raises(DataLossError, match="checksum mismatch"):
        corrupt.feed(parse_chunk(encode_chunk(bad, chunks[-1].data)))
