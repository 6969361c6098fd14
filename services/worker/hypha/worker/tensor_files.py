"""Files as chunk streams for the tensor exchange: read and hashed off the event loop.

Split from ``transfer`` so that the exchange module is about inboxes, publications
and sending; these are the byte-moving helpers it (and the worker's result
stream) uses. Each block is read and hashed in one worker thread call, the next
one while the current one is being sent. Blocks come as (chunk header, data), so
the sender can encode the frame with one copy of the data
(``hypha.worker.tensor_frames``) instead of protobuf's three (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from hypha.errors import NotFoundError
from hypha.tensors.chunks import DEFAULT_CHUNK_SIZE
from hypha.tensors.payload import CONTENT_TYPE
from hypha.v1 import common_pb2


async def file_chunks(
    path: Path,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    content_type: str = CONTENT_TYPE,
    metadata: dict[str, str] | None = None,
) -> AsyncIterator[common_pb2.Chunk]:
    """The chunks of a file, read block by block (never mmapped: a writer truncating it must not
    crash the worker), hashed as they go; the last carries the sha256."""
    async for chunk, data in file_blocks(path, chunk_size, content_type, metadata):
        chunk.data = data
        yield chunk


def _read_hashed(handle: Any, size: int, digest: Any) -> bytes:
    """One block read and hashed in a worker thread (hashlib drops the GIL for large blocks)."""
    data: bytes = handle.read(size)
    digest.update(data)
    return data


async def file_blocks(
    path: Path,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    content_type: str = CONTENT_TYPE,
    metadata: dict[str, str] | None = None,
) -> AsyncIterator[tuple[common_pb2.Chunk, bytes]]:
    """(chunk header, data) for each block of a file: the header is the chunk's every field but
    ``data`` (offset; total size, content type and metadata on the first; the sha256 on the last)."""
    try:
        handle = await asyncio.to_thread(open, path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"tensor file {path.name} is gone") from None
    reading: asyncio.Future[bytes] | None = None
    try:
        total = os.fstat(handle.fileno()).st_size
        digest = hashlib.sha256()
        offset = 0

        def read_next() -> asyncio.Future[bytes] | None:
            # The next block is read and hashed while this one is on the wire; reads stay
            # sequential (each starts once the one before is done), so the digest is in order.
            if offset >= total:
                return None
            return asyncio.ensure_future(asyncio.to_thread(_read_hashed, handle, chunk_size, digest))

        reading = read_next()
        while True:
            data = b""
            if reading is not None:
                data, reading = await reading, None
            chunk = common_pb2.Chunk(offset=offset)
            if offset == 0:
                chunk.total_size = total
                chunk.content_type = content_type
                if metadata:
                    chunk.metadata.update(metadata)
            offset += len(data)
            if offset >= total or not data:
                chunk.last = True
                chunk.sha256 = digest.hexdigest()
                yield chunk, data
                return
            reading = read_next()
            yield chunk, data
    finally:
        if reading is not None:  # the consumer stopped early: let the thread finish before closing
            await asyncio.wait([reading])
        handle.close()


def read_head(path: Path) -> bytes:
    """Enough of a safetensors file to parse its header (8-byte length, then the JSON)."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return head
        return head + handle.read(min(int.from_bytes(head, "little"), 100_000_000))
