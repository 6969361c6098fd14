"""Files as chunk streams for the tensor exchange: read and hashed off the event loop.

Split from ``transfer`` so that the exchange module is about inboxes, publications
and sending; these are the byte-moving helpers it uses (a job's result goes out
through ``hypha.filesend``, which never follows a link). Each block is read and
hashed in one worker thread call, the next one while the current one is being sent.
Blocks come as (chunk header, data), so the sender can encode the frame with one
copy of the data (``hypha.worker.tensor_frames``) instead of protobuf's three
(docs/performance.md).

A published file is pulled by every trainer of the job, each pull used to hash it
again: the parameter server's worker hashed θ_global once per trainer and round.
``SharedDigest`` hashes it once, in a thread, from the moment it is published;
a pull of the very file that was hashed (same inode, size, mtime and ctime:
``hypha.filestamp``) streams without hashing, reading what the page cache holds on the loop
(``hypha.pagecache``), and sends that digest in its last chunk. The
puller's own sha256 check is unchanged, so whatever the bytes on the wire were,
a mismatch is refused there (DATA_LOSS) and pulled again; a file that changed
since it was published is hashed as it streams, as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from stat import S_ISREG
from typing import Any

from hypha.errors import NotFoundError, UnavailableError
from hypha.filestamp import FileStamp
from hypha.pagecache import read_cached
from hypha.tensors.chunks import DEFAULT_CHUNK_SIZE
from hypha.tensors.payload import CONTENT_TYPE
from hypha.v1 import common_pb2


def _read_hashed(handle: Any, size: int, digest: Any) -> bytes:
    """One block read and hashed in a worker thread (hashlib drops the GIL for large blocks)."""
    data: bytes = handle.read(size)
    digest.update(data)
    return data


def _hash_file(path: Path, key: FileStamp) -> str | None:
    """The file's sha256 if it is the file ``key`` names before and after it was read, else None."""
    try:
        with open(path, "rb") as handle:
            if FileStamp.of(os.fstat(handle.fileno())) != key:
                return None
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
            return digest if FileStamp.of(os.fstat(handle.fileno())) == key else None
    except OSError:
        return None


class SharedDigest:
    """A published file's sha256, taken once in a worker thread for every pull of it."""

    def __init__(self, path: Path, key: FileStamp) -> None:
        self.key = key
        self._hashing = asyncio.ensure_future(asyncio.to_thread(_hash_file, path, key))

    @classmethod
    async def of(cls, path: Path) -> SharedDigest:
        """Starts hashing ``path`` as it is now; NotFoundError if there is no such file."""
        try:
            stat = await asyncio.to_thread(os.stat, path)
        except FileNotFoundError:
            stat = None
        if stat is None or not S_ISREG(stat.st_mode):
            raise NotFoundError(f"no file {path.name} to publish")
        return cls(path, FileStamp.of(stat))

    async def hexdigest(self) -> str:
        """The digest; UnavailableError if the file changed while it was hashed (pull again)."""
        digest = await asyncio.shield(self._hashing)
        if digest is None:
            raise UnavailableError("the published file changed while it was hashed; pull it again")
        return digest


async def file_blocks(
    path: Path,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    content_type: str = CONTENT_TYPE,
    metadata: dict[str, str] | None = None,
    known: SharedDigest | None = None,
) -> AsyncIterator[tuple[common_pb2.Chunk, bytes | bytearray]]:
    """(chunk header, data) for each block of a file: the header is the chunk's every field but
    ``data`` (offset; total size, content type and metadata on the first; the sha256 on the last).
    With ``known`` the digest of the same file (``FileStamp``) is sent instead of hashing it again."""
    try:
        handle = await asyncio.to_thread(open, path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"tensor file {path.name} is gone") from None
    reading: asyncio.Future[bytes] | None = None
    try:
        stat = os.fstat(handle.fileno())
        total = stat.st_size
        if known is not None and known.key != FileStamp.of(stat):
            known = None  # not the file that was hashed: hash this one as it goes
        digest = hashlib.sha256()
        offset = 0

        def read_next() -> asyncio.Future[bytes] | None:
            # The next block is read and hashed while this one is on the wire; reads stay
            # sequential (each starts once the one before is done), so the digest is in order.
            if offset >= total or known is not None:
                return None
            return asyncio.ensure_future(asyncio.to_thread(_read_hashed, handle, chunk_size, digest))

        reading = read_next()
        while True:
            data: bytes | bytearray = b""
            if known is not None and offset < total:
                # Nothing to hash: a block the page cache holds is read on the loop, another
                # waits for the disk in a thread (positional reads; the handle keeps no offset).
                want = min(chunk_size, total - offset)
                cached = read_cached(handle.fileno(), want, offset)
                if cached is None:
                    reading = asyncio.ensure_future(
                        asyncio.to_thread(os.pread, handle.fileno(), want, offset)
                    )
                else:
                    data = cached
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
                chunk.sha256 = await known.hexdigest() if known is not None else digest.hexdigest()
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
