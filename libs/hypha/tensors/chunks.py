"""Streaming a payload as bounded ``hypha.v1.Chunk`` messages, and putting it back together.

Large blobs (tensor payloads, data slices, model files) never travel as one
gRPC message: the sender cuts them into chunks of at most 1 MiB, the first
carrying the total size, content type and metadata, the last carrying the
sha256 of the whole payload. The receiver keeps each chunk's bytes and hashes
as it goes, then joins them once, so assembling costs one copy plus the hash;
it returns the payload only once the last chunk has arrived and the checksum
matches. Nothing half-received is ever handed out.

A payload declared larger than ``memory_bytes`` is spooled instead: each chunk
is written to a temporary file in ``spool_dir`` as it arrives, so memory stays
at one chunk whatever the size, and ``finish_file`` hands out the verified file.

Both sides are plain synchronous code so that any transport (gRPC streams, the
job bridge, a relay) can drive them; async receivers call ``feed_off_loop``,
which hashes (and spools) large chunks in a worker thread so the event loop
keeps moving bytes meanwhile (hashing was half a reader's loop time).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from enum import StrEnum
from pathlib import Path
from typing import IO, NoReturn, Protocol

from hypha.errors import DataLossError, FailedPreconditionError, InvalidArgumentError
from hypha.v1 import common_pb2

#: Default (and recommended maximum) bytes of data per chunk. gRPC's default message limit is
#: 4 MiB including framing, so 1 MiB leaves room and keeps memory per in-flight chunk small.
DEFAULT_CHUNK_SIZE = 1 << 20

_SHA256_HEX_LEN = 64


def sha256_hex(payload: bytes | bytearray | memoryview) -> str:
    """Hex sha256 of a payload, as carried by the last chunk."""
    return hashlib.sha256(payload).hexdigest()


def split_payload(
    payload: bytes | bytearray | memoryview,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    content_type: str = "",
    metadata: Mapping[str, str] | None = None,
) -> Iterator[common_pb2.Chunk]:
    """Yield the chunks of ``payload``; an empty payload is one chunk that is both first and last.

    The hash is computed while yielding, so the first chunk goes out before the
    whole payload has been hashed.
    """
    if chunk_size <= 0:
        raise InvalidArgumentError(f"chunk_size must be positive, got {chunk_size}")
    view = memoryview(payload).cast("B")
    total = len(view)
    digest = hashlib.sha256()
    offset = 0
    while True:
        end = min(offset + chunk_size, total)
        data = bytes(view[offset:end])
        digest.update(data)
        chunk = common_pb2.Chunk(offset=offset, data=data)
        if offset == 0:
            chunk.total_size = total
            chunk.content_type = content_type
            if metadata:
                chunk.metadata.update(metadata)
        if end >= total:
            chunk.last = True
            chunk.sha256 = digest.hexdigest()
            yield chunk
            return
        yield chunk
        offset = end


class ChunkLike(Protocol):
    """What an assembler reads of a chunk: a ``common_pb2.Chunk``, or a ``ChunkView`` whose data
    is a view of the received bytes (``hypha.tensors.chunk_frames``)."""

    @property
    def offset(self) -> int: ...
    @property
    def total_size(self) -> int: ...
    @property
    def content_type(self) -> str: ...
    @property
    def metadata(self) -> Mapping[str, str]: ...
    @property
    def last(self) -> bool: ...
    @property
    def sha256(self) -> str: ...
    @property
    def data(self) -> bytes | memoryview: ...


class AssemblyState(StrEnum):
    """Where an assembler stands; ``failed`` and ``finished`` are terminal."""

    WAITING_FIRST = "waiting_first"  # nothing received yet
    RECEIVING = "receiving"  # first chunk seen, last not yet
    VERIFIED = "verified"  # last chunk seen and the checksum matched
    FINISHED = "finished"  # payload handed out by finish()
    FAILED = "failed"  # refused; the buffer is released


class ChunkAssembler:
    """Rebuilds one payload from its chunks, fed in order.

    Every refusal poisons the assembler (state ``failed``, buffer released): a
    stream that went wrong once is never resumed, the sender starts over.
    Oversize (declared or actual) is InvalidArgumentError rather than
    ResourceExhaustedError, because the project's clients retry
    RESOURCE_EXHAUSTED and sending the same oversized payload again cannot
    succeed.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        expected_content_type: str | None = None,
        spool_dir: Path | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        if max_bytes < 0:
            raise InvalidArgumentError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        #: Payloads declared larger than this go to a file in ``spool_dir`` (None: never).
        self.memory_bytes = memory_bytes
        self.spool_dir = spool_dir
        self._spool: IO[bytes] | None = None
        self._spool_path: Path | None = None
        self.expected_content_type = expected_content_type
        self.state = AssemblyState.WAITING_FIRST
        self.total_size = 0
        self.received = 0
        self.content_type = ""
        self.metadata: dict[str, str] = {}
        self._parts: list[bytes | memoryview] = []
        self._digest = hashlib.sha256()
        self._failure = ""

    @property
    def complete(self) -> bool:
        """True once the last chunk arrived and the payload verified."""
        return self.state is AssemblyState.VERIFIED

    def feed(self, chunk: ChunkLike) -> None:
        """Take the next chunk; raise (and poison the assembler) if it breaks the stream's rules."""
        if self.state is AssemblyState.FAILED:
            raise FailedPreconditionError(f"chunk stream already refused: {self._failure}")
        if self.state in (AssemblyState.VERIFIED, AssemblyState.FINISHED):
            self._fail(InvalidArgumentError("chunk received after the last chunk"))
        if self.state is AssemblyState.WAITING_FIRST:
            self._start(chunk)
        elif chunk.total_size and chunk.total_size != self.total_size:
            self._fail(
                InvalidArgumentError(
                    f"chunk at offset {chunk.offset} declares total_size {chunk.total_size}, "
                    f"the stream declared {self.total_size}"
                )
            )
        if chunk.offset != self.received:
            kind = "gap" if chunk.offset > self.received else "overlap"
            self._fail(
                InvalidArgumentError(f"chunk offset {chunk.offset} leaves a {kind}: expected {self.received}")
            )
        data = chunk.data
        end = self.received + len(data)
        if end > self.total_size:
            self._fail(
                InvalidArgumentError(
                    f"chunks carry more than the declared total_size of {self.total_size} bytes"
                )
            )
        if data:
            # NOTE: chunks are kept as received and joined once in finish(): linear like a
            # bytearray preallocated to total_size, minus zero-filling it and copying it out
            # again (100 MiB: 0.09 s against 0.13 s, sha256 alone 0.05 s). Memory stays bounded
            # by the declared total_size, checked against max_bytes before the first byte.
            self._digest.update(data)
            if self._spool is not None:
                self._spool.write(data)
            else:
                self._parts.append(data)
            self.received = end
        if chunk.last:
            self._verify(chunk.sha256)

    @property
    def spooled(self) -> bool:
        """True when the payload goes to a file (``finish_file``) rather than memory (``finish``)."""
        return self._spool_path is not None

    def finish_file(self) -> Path:
        """The verified payload's file (the caller owns it now); like ``finish`` for a spooled payload."""
        if self.state is AssemblyState.VERIFIED and self._spool is not None and self._spool_path:
            spool, path = self._spool, self._spool_path
            self._spool, self._spool_path = None, None
            spool.close()
            self.state = AssemblyState.FINISHED
            return path
        if self.state is AssemblyState.VERIFIED:
            raise FailedPreconditionError("payload is held in memory: use finish()")
        self.finish()
        raise AssertionError("unreachable")  # pragma: no cover - finish() raised

    def abort(self) -> None:
        """Give up on the payload (the stream broke or was cancelled): release the buffer and
        delete a spool file. Safe to call at any time, also after ``finish``."""
        if self.state not in (AssemblyState.FINISHED, AssemblyState.FAILED):
            self.state = AssemblyState.FAILED
            self._failure = "aborted"
        self._parts = []
        self._drop_spool()

    def finish(self) -> bytes:
        """The verified payload; DataLossError if the stream ended before its last chunk."""
        if self.state is AssemblyState.VERIFIED and self._spool is not None:
            raise FailedPreconditionError("payload was spooled to a file: use finish_file()")
        if self.state is AssemblyState.VERIFIED:
            payload = b"".join(self._parts)
            self._parts = []
            self.state = AssemblyState.FINISHED
            return payload
        if self.state is AssemblyState.FAILED:
            raise FailedPreconditionError(f"chunk stream already refused: {self._failure}")
        if self.state is AssemblyState.FINISHED:
            raise FailedPreconditionError("payload already handed out")
        self._fail(
            DataLossError(
                f"incomplete payload: stream ended after {self.received} of {self.total_size} bytes "
                "without its last chunk"
            )
        )

    def _start(self, chunk: ChunkLike) -> None:
        declared = chunk.total_size
        if declared > self.max_bytes:
            self._fail(
                InvalidArgumentError(
                    f"payload of {declared} bytes exceeds the limit of {self.max_bytes} bytes"
                )
            )
        if self.expected_content_type is not None and chunk.content_type != self.expected_content_type:
            self._fail(
                InvalidArgumentError(
                    f"content type {chunk.content_type!r} is not the expected {self.expected_content_type!r}"
                )
            )
        self.total_size = declared
        self.content_type = chunk.content_type
        self.metadata = dict(chunk.metadata)
        self.state = AssemblyState.RECEIVING
        if self.spool_dir is not None and self.memory_bytes is not None and declared > self.memory_bytes:
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=".spool-", suffix=".part", dir=self.spool_dir)
            self._spool_path = Path(name)
            self._spool = os.fdopen(fd, "wb")

    def _verify(self, sha256: str) -> None:
        if self.received != self.total_size:
            self._fail(
                DataLossError(
                    f"incomplete payload: last chunk arrived after {self.received} of {self.total_size} bytes"
                )
            )
        if len(sha256) != _SHA256_HEX_LEN:
            self._fail(DataLossError("last chunk carries no valid sha256"))
        if self._digest.hexdigest() != sha256.lower():
            self._fail(DataLossError("payload checksum mismatch: sha256 of the received bytes differs"))
        self.state = AssemblyState.VERIFIED

    def _drop_spool(self) -> None:
        spool, path = self._spool, self._spool_path
        self._spool, self._spool_path = None, None
        if spool is not None:
            spool.close()
        if path is not None:
            path.unlink(missing_ok=True)

    def _fail(self, error: InvalidArgumentError | DataLossError) -> NoReturn:
        self.state = AssemblyState.FAILED
        self._parts = []
        self._drop_spool()
        self._failure = error.message
        raise error


#: Chunks at least this large are fed in a worker thread (hashlib and file writes drop the GIL).
_THREAD_FEED_BYTES = 64 << 10


async def feed_off_loop(assembler: ChunkAssembler, chunk: ChunkLike) -> None:
    """``assembler.feed(chunk)``, in a worker thread for a large chunk once the stream started.

    A cancelled caller waits for the thread to finish its chunk (a thread cannot be
    stopped), so an ``abort()`` that follows never races a write to the spool file.
    """
    feeder = ChunkFeeder(assembler)
    await feeder.feed(chunk)
    await feeder.flush()


class ChunkFeeder:
    """Feeds an assembler one chunk behind the stream it reads from.

    ``feed_off_loop`` makes the reader wait for each chunk's hash and write;
    here chunk k is hashed and written in a worker thread while the reader
    takes chunk k+1 off the wire (the tensor exchange's pushes and pulls:
    docs/performance.md). Chunks still reach the assembler one at a time and
    in order. A failure of chunk k (too large, wrong checksum) is raised by
    the next ``feed`` or by ``flush``; ``settle`` waits for a chunk in flight
    without raising, so an ``abort()`` after it never races a spool write.
    """

    def __init__(self, assembler: ChunkAssembler) -> None:
        self.assembler = assembler
        self._pending: asyncio.Future[None] | None = None

    async def feed(self, chunk: ChunkLike) -> None:
        await self.flush()
        if len(chunk.data) < _THREAD_FEED_BYTES or self.assembler.state is not AssemblyState.RECEIVING:
            self.assembler.feed(chunk)
            return
        self._pending = asyncio.ensure_future(asyncio.to_thread(self.assembler.feed, chunk))

    async def flush(self) -> None:
        """Wait for the chunk in flight; its failure is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            await asyncio.shield(pending)
        except asyncio.CancelledError:
            await asyncio.wait([pending])
            raise

    async def settle(self) -> None:
        """Wait for the chunk in flight, if any, and drop its outcome (the caller is giving up)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            await asyncio.wait([pending])
            if not pending.cancelled():
                pending.exception()  # retrieved: the caller already fails for its own reason


def assemble(
    chunks: Iterable[common_pb2.Chunk],
    *,
    max_bytes: int,
    expected_content_type: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """Assemble a whole stream held in an iterable; returns the payload and the first chunk's metadata."""
    assembler = ChunkAssembler(max_bytes=max_bytes, expected_content_type=expected_content_type)
    for chunk in chunks:
        assembler.feed(chunk)
    return assembler.finish(), assembler.metadata
