"""Tensor payloads (safetensors bytes) and their chunked streaming.

``payload`` turns state dicts into bytes and back, checked against a template;
``chunks`` cuts bytes into bounded ``hypha.v1.Chunk`` messages and verifies
them on the way back in.
"""

from hypha.tensors.chunks import (
    DEFAULT_CHUNK_SIZE,
    AssemblyState,
    ChunkAssembler,
    assemble,
    sha256_hex,
    split_payload,
)
from hypha.tensors.payload import (
    CONTENT_TYPE,
    WIRE_DTYPES,
    WireDType,
    check_template,
    decode_state,
    encode_state,
    read_metadata,
    template_of,
    wire_dtype,
)

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_CHUNK_SIZE",
    "WIRE_DTYPES",
    "AssemblyState",
    "ChunkAssembler",
    "WireDType",
    "assemble",
    "check_template",
    "decode_state",
    "encode_state",
    "read_metadata",
    "sha256_hex",
    "split_payload",
    "template_of",
    "wire_dtype",
]
