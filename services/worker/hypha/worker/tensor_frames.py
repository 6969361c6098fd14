"""``TensorChunk`` messages on the wire without protobuf's copies of their data.

As ``hypha.tensors.chunk_frames`` does for slices: a pushed or pulled chunk
leaves as the ``TensorChunk`` header and the ``Chunk`` header serialized by
protobuf around the data encoded by hand, joined once, and arrives as both
headers parsed beside a view of the data in the received bytes. The bytes are
the very message the generated code builds, so peers and tools that use the
generated stubs read and send them as before. ``add_worker_servicer`` is the
worker's service with ``PushTensors`` and ``PullTensors`` taking these codecs.
"""

from __future__ import annotations

from hypha.net.wire import Encoded, field_number, frame_bytes, split_field, with_codecs
from hypha.tensors.chunk_frames import ChunkView, parse_chunk
from hypha.v1 import common_pb2, worker_pb2, worker_pb2_grpc

_CHUNK = field_number(worker_pb2.TensorChunk, "chunk")
#: gRPC's length prefix on every message (1 flag byte, 4 length bytes).
GRPC_PREFIX_BYTES = 5


def encode_tensor_chunk(
    header: worker_pb2.TensorChunk, chunk: common_pb2.Chunk, data: bytes | bytearray
) -> bytes:
    """``header`` (its chunk unset) carrying ``chunk`` (its data unset) with ``data``, serialized;
    ``data`` is copied once."""
    return bytes(Encoded.with_field(chunk, "data", data).within(header, "chunk"))


class TensorChunkView:
    """A received ``TensorChunk``: the header's fields, and its chunk as a ``ChunkView``."""

    __slots__ = ("chunk", "header", "size")

    def __init__(self, header: worker_pb2.TensorChunk, chunk: ChunkView, size: int) -> None:
        self.header = header
        self.chunk = chunk
        #: The serialized message's length.
        self.size = size

    @property
    def job_id(self) -> str:
        return self.header.job_id

    @property
    def kind(self) -> str:
        return self.header.kind

    @property
    def round(self) -> int:
        return self.header.round

    @property
    def samples(self) -> int:
        return self.header.samples


#: A pushed message as a servicer gets it: a view (``add_worker_servicer``), or a message when
#: the service was registered the generated way.
Pushed = TensorChunkView | worker_pb2.TensorChunk


def parse_tensor_chunk(raw: bytes) -> TensorChunkView:
    """Deserializer of tensor streams; bytes that are not plain wire format with one ``chunk``
    field are parsed by protobuf as a whole (and refused the same way)."""
    split = split_field(memoryview(raw), _CHUNK)
    if split is None:
        message = worker_pb2.TensorChunk.FromString(raw)
        chunk = parse_chunk(message.chunk.SerializeToString())
        message.ClearField("chunk")
        return TensorChunkView(message, chunk, len(raw))
    rest, chunk_bytes = split
    return TensorChunkView(
        worker_pb2.TensorChunk.FromString(b"".join(rest)), parse_chunk(chunk_bytes), len(raw)
    )


def wire_bytes(message: bytes | TensorChunkView | worker_pb2.TensorChunk) -> int:
    """A message's bytes on the wire: the serialized message and gRPC's prefix (not HTTP/2 or TLS)."""
    if isinstance(message, bytes):
        return len(message) + GRPC_PREFIX_BYTES
    if isinstance(message, TensorChunkView):
        return message.size + GRPC_PREFIX_BYTES
    return message.ByteSize() + GRPC_PREFIX_BYTES


#: ``add_WorkerServicer_to_server`` with tensor streams as pre-encoded frames and views: pushes
#: arrive as ``TensorChunkView``s, pulls and pushes may yield pre-encoded bytes (or messages).
add_worker_servicer = with_codecs(
    worker_pb2_grpc.add_WorkerServicer_to_server,
    {
        "PushTensors": {"request_deserializer": parse_tensor_chunk},
        "PullTensors": {"response_serializer": frame_bytes},
    },
)


__all__ = [
    "GRPC_PREFIX_BYTES",
    "Pushed",
    "TensorChunkView",
    "add_worker_servicer",
    "encode_tensor_chunk",
    "parse_tensor_chunk",
    "wire_bytes",
]
