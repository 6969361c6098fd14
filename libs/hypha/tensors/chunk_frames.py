"""``hypha.v1.Chunk`` messages on the wire without protobuf's copies of their data.

Why (docs/performance.md, ``slices``): with the upb runtime a 1 MiB ``data``
field is copied when the message is built, twice when it is serialized, once
when it is parsed and once more at every read of the field. A slice stream
spent more on those copies than on its own work beside a bare gRPC stream of
the same bytes. Here a chunk leaves as its header (every field but ``data``)
serialized by protobuf followed by ``data`` encoded by hand, joined once
(``hypha.net.wire``), and arrives as its header parsed by protobuf beside a
view of ``data`` in the received bytes. Protobuf parsers accept fields in any
order, so the bytes are exactly the message the generated code would build:
peers that use the generated stubs read and send them as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from hypha.net.wire import Encoded, field_number, split_field
from hypha.v1 import common_pb2

_DATA = field_number(common_pb2.Chunk, "data")


def encode_chunk(header: common_pb2.Chunk, data: bytes | bytearray | memoryview) -> bytes:
    """``header`` (its ``data`` unset) with ``data`` as its data field, serialized; ``data`` is
    copied once. A stream's serializer passes the result through (``hypha.net.wire.frame_bytes``)."""
    return bytes(Encoded.with_field(header, "data", data))


class ChunkView:
    """A received chunk: the header's fields, and ``data`` as a view of the received bytes
    (which it keeps alive). Reads like a ``common_pb2.Chunk`` for ``ChunkAssembler``."""

    __slots__ = ("data", "header")

    def __init__(self, header: common_pb2.Chunk, data: memoryview) -> None:
        self.header = header
        self.data = data

    @property
    def offset(self) -> int:
        return self.header.offset

    @property
    def total_size(self) -> int:
        return self.header.total_size

    @property
    def content_type(self) -> str:
        return self.header.content_type

    @property
    def metadata(self) -> Mapping[str, str]:
        return self.header.metadata

    @property
    def last(self) -> bool:
        return self.header.last

    @property
    def sha256(self) -> str:
        return self.header.sha256


def parse_chunk(raw: bytes | memoryview) -> ChunkView:
    """Response deserializer of chunk streams. Bytes that are not plain wire format with one
    ``data`` field are parsed by protobuf as a whole, and refused the same way
    (``google.protobuf.message.DecodeError``)."""
    split = split_field(memoryview(raw), _DATA)
    if split is None:
        message = common_pb2.Chunk.FromString(bytes(raw))
        whole = memoryview(message.data)
        message.ClearField("data")
        return ChunkView(message, whole)
    rest, view = split
    return ChunkView(common_pb2.Chunk.FromString(b"".join(rest)), view)


__all__ = ["ChunkView", "encode_chunk", "parse_chunk"]
