"""The DataNode gRPC service: which datasets this node has, and their slices as verified chunk streams.

Every stream is checked against the slice's manifest sha256 (``SliceReader``,
hypha.data.slices): a file served for the first time, or changed since, is
hashed whole before its first chunk leaves, so a slice that rotted on disk is
refused with ``DATA_LOSS`` and not one of its bytes is sent; a file that
passed before is hashed as it is read, one chunk ahead of the wire, and its
last chunk is withheld if the bytes no longer match. Hashing and reads that
would wait for the disk run in worker threads (``asyncio.to_thread``) so
several readers are served in parallel and the event loop keeps answering
while a large slice is hashed; a trusted slice already in the page cache is
read on the loop (``SliceReader.read_now``), since each thread hop cost more
than the read (docs/performance.md, "Slices without thread hops").
The number of streams at once (and so the slices held in memory) is bounded
by ``max_concurrent_streams``; a caller that cannot get a slot within
``stream_wait_s`` gets ``RESOURCE_EXHAUSTED`` (retryable), never an unbounded
queue.

Chunk conventions (``hypha.v1.Chunk``): ``offset`` is absolute within the
slice, so a stream resumed at ``offset`` continues where a broken one stopped;
the first chunk of every stream carries ``total_size`` (the whole slice),
``content_type`` and metadata (``dataset``, ``index``, ``sha256``, ``samples``);
the last carries the sha256 of the *whole* slice and ``last=True``. A resume
at ``offset == total_size`` is one empty chunk that is both first and last.
Chunks leave pre-encoded, their data copied once (``hypha.tensors.chunk_frames``,
``add_data_node_servicer``); the bytes are the same message either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import grpc

from hypha.data.config import DEFAULT_TRUST_VERIFIED_S, WireCompression
from hypha.data.slices import SliceReader, VerifiedFiles
from hypha.data.wire_compression import CompressionChoice
from hypha.datasets.format import CONTENT_TYPE, DEFAULT_CHUNK_SIZE, MANIFEST_NAME, Dataset, scan_data_dir
from hypha.errors import DataLossError, InvalidArgumentError, NotFoundError, ResourceExhaustedError
from hypha.net.auth import peer_identity
from hypha.net.wire import frame_bytes, with_codecs
from hypha.tensors.chunk_frames import encode_chunk
from hypha.v1 import common_pb2, data_pb2, data_pb2_grpc

log = logging.getLogger(__name__)

#: Called before each chunk is sent, with (dataset, index, chunk header: the chunk without its
#: data). A seam for fault injection in tests and for telemetry; it may await, and whatever it
#: raises ends the stream like any handler error.
ChunkHook = Callable[[str, int, common_pb2.Chunk], Awaitable[None]]

#: What identifies the state of a data dir without reading any manifest: the
#: dir's own mtime and, per dataset dir, its manifest's inode, size and mtime.
_Signature = tuple[int, tuple[tuple[str, int, int, int], ...]]


class DatasetCatalog:
    """The datasets of a data dir, rescanned when the dir changes.

    ``prepare`` installs a dataset by renaming a finished temp dir into place
    (or replacing one), which changes the data dir's mtime and the manifest's
    inode; checking those few stats per call is far cheaper than reopening
    every dataset, so new datasets appear without a restart while an unchanged
    dir is never rescanned.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self._datasets: dict[str, Dataset] = {}
        self._signature: _Signature | None = None
        self._lock = asyncio.Lock()
        self._warned_missing = False
        #: How many times the dir was (re)scanned; for tests and metrics.
        self.scans = 0

    async def datasets(self) -> dict[str, Dataset]:
        """The current datasets by name (rescanned first if the dir changed)."""
        signature = await asyncio.to_thread(self._read_signature)
        if signature == self._signature:
            return self._datasets
        async with self._lock:
            if signature != self._signature:
                # NOTE: the signature is taken before the scan, so a change that lands during the
                # scan leaves a stale signature behind and the next call scans again; the
                # opposite order could miss a change forever.
                self._datasets = await asyncio.to_thread(self._scan)
                self._signature = signature
                self.scans += 1
        return self._datasets

    async def get(self, name: str) -> Dataset:
        if (known := self._unchanged(name)) is not None:
            return known
        datasets = await self.datasets()
        try:
            return datasets[name]
        except KeyError:
            raise NotFoundError(f"no dataset named {name!r} on this data node") from None

    def _unchanged(self, name: str) -> Dataset | None:
        """``name`` as last scanned if neither the data dir nor its manifest changed since.

        NOTE: two stats on the loop, of entries every stream touches (so cached): a thread
        hop for the whole signature cost more than the rest of a small slice's stream
        (docs/performance.md, "Slices without thread hops"). Anything else scans as before.
        """
        signature, dataset = self._signature, self._datasets.get(name)
        if signature is None or dataset is None:
            return None
        try:
            top = self.data_dir.stat().st_mtime_ns
            st = os.stat(os.path.join(self.data_dir, name, MANIFEST_NAME))
        except OSError:
            return None
        if top != signature[0] or (name, st.st_ino, st.st_size, st.st_mtime_ns) not in signature[1]:
            return None
        return dataset

    def _scan(self) -> dict[str, Dataset]:
        if not self.data_dir.is_dir():
            return {}
        found = scan_data_dir(self.data_dir)
        log.info("data dir %s: serving %d dataset(s): %s", self.data_dir, len(found), ", ".join(found) or "-")
        return found

    def _read_signature(self) -> _Signature:
        try:
            top = self.data_dir.stat().st_mtime_ns
            children = sorted(os.scandir(self.data_dir), key=lambda entry: entry.name)
        except FileNotFoundError:
            if not self._warned_missing:
                log.warning("data dir %s does not exist (yet); serving no datasets", self.data_dir)
                self._warned_missing = True
            return (-1, ())
        entries = []
        for child in children:
            if child.name.startswith(".") or not child.is_dir():
                continue
            try:
                st = os.stat(os.path.join(child.path, MANIFEST_NAME))
            except OSError:
                entries.append((child.name, 0, 0, 0))
                continue
            entries.append((child.name, st.st_ino, st.st_size, st.st_mtime_ns))
        return (top, tuple(entries))


class DataNodeServicer(data_pb2_grpc.DataNodeServicer):
    """Thin edge over ``DatasetCatalog`` and ``Dataset``; errors map through the server guard."""

    def __init__(
        self,
        catalog: DatasetCatalog,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_SIZE,
        max_concurrent_streams: int = 16,
        stream_wait_s: float = 10.0,
        trust_verified_s: float = DEFAULT_TRUST_VERIFIED_S,
        chunk_hook: ChunkHook | None = None,
        wire_compression: WireCompression = "auto",
    ) -> None:
        if chunk_bytes < 1:
            raise InvalidArgumentError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if max_concurrent_streams < 1:
            raise InvalidArgumentError(f"max_concurrent_streams must be >= 1, got {max_concurrent_streams}")
        self.catalog = catalog
        self.chunk_bytes = chunk_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self.stream_wait_s = stream_wait_s
        self.chunk_hook = chunk_hook
        self.compression = CompressionChoice(wire_compression)
        self._slots = asyncio.Semaphore(max_concurrent_streams)
        #: Slice files that passed a whole check; their next streams are hashed as they go.
        self.verified = VerifiedFiles(trust_s=trust_verified_s)
        #: Counters: streams started/completed, bytes sent, slices refused as corrupt, busy refusals.
        self.stats: Counter[str] = Counter()

    async def ListDatasets(
        self, request: data_pb2.ListDatasetsRequest, context: grpc.aio.ServicerContext
    ) -> data_pb2.ListDatasetsResponse:
        datasets = await self.catalog.datasets()
        return data_pb2.ListDatasetsResponse(
            datasets=[datasets[name].manifest.to_proto() for name in sorted(datasets)]
        )

    async def StreamSlice(
        self, request: data_pb2.StreamSliceRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """The slice's chunks, each pre-encoded (``add_data_node_servicer`` passes them through)."""
        dataset = await self.catalog.get(request.dataset)
        index, offset = request.index, request.offset
        async with self._slot(dataset.name, index):
            reader = SliceReader(dataset, index, self.chunk_bytes, offset, self.verified)
            try:
                # A file served lately opens on the loop; a whole check goes to a thread.
                if not (reader.known and reader.open(check_whole=False)):
                    await asyncio.to_thread(reader.open)
            except DataLossError as err:
                self.stats["refused_corrupt"] += 1
                log.error("refusing to serve %s slice %d: %s", dataset.name, index, err.message)
                raise
            compress = self.compression.known(dataset)
            if compress is None:
                compress = await asyncio.to_thread(self.compression.judge, dataset, index)
            if compress:
                context.set_compression(grpc.Compression.Gzip)
            self.stats["streams"] += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "streaming %s slice %d from byte %d to %s",
                    dataset.name,
                    index,
                    offset,
                    peer_identity(context).peer_id,
                )
            try:
                async with aclosing(_chunk_messages(dataset, index, offset, reader)) as chunks:
                    async for header, data in chunks:
                        if self.chunk_hook is not None:
                            await self.chunk_hook(dataset.name, index, header)
                        self.stats["bytes"] += len(data)
                        yield encode_chunk(header, data)
            except DataLossError as err:
                self.stats["refused_corrupt"] += 1
                log.error("stopped serving %s slice %d: %s", dataset.name, index, err.message)
                raise
            self.stats["completed"] += 1

    @asynccontextmanager
    async def _slot(self, name: str, index: int) -> AsyncIterator[None]:
        """Holds one of ``max_concurrent_streams`` slots for a whole stream: a stream holds a
        whole slice (checked before it is sent) or two chunks, so slots bound the memory in use."""
        try:
            async with asyncio.timeout(self.stream_wait_s):
                await self._slots.acquire()
        except TimeoutError:
            self.stats["busy"] += 1
            raise ResourceExhaustedError(
                f"data node busy: {self.max_concurrent_streams} slice streams in flight; "
                f"{name} slice {index} waited {self.stream_wait_s:g} s"
            ) from None
        try:
            yield
        finally:
            self._slots.release()


async def _chunk_messages(
    dataset: Dataset, index: int, offset: int, reader: SliceReader
) -> AsyncGenerator[tuple[common_pb2.Chunk, bytes | bytearray], None]:
    """The stream's chunks as (header, data); closing the generator waits for a read in flight,
    then closes the reader."""
    size = dataset.slice_size(index)
    sha = dataset.slice_sha256(index)
    metadata = {
        "dataset": dataset.name,
        "index": str(index),
        "sha256": sha,
        "samples": str(dataset.manifest.samples_in_slice(index)),
    }
    position = offset
    first = True
    try:
        async with aclosing(_slice_data(reader)) as pieces:
            async for data in pieces:
                chunk = common_pb2.Chunk(offset=position)
                position += len(data)
                if first:
                    chunk.total_size = size
                    chunk.content_type = CONTENT_TYPE
                    chunk.metadata.update(metadata)
                    first = False
                if position >= size:
                    chunk.last = True
                    chunk.sha256 = sha
                yield chunk, data
    finally:
        reader.close()
    if first:  # resumed at the very end: nothing left but the verdict
        header = common_pb2.Chunk(
            offset=position,
            total_size=size,
            content_type=CONTENT_TYPE,
            metadata=metadata,
            last=True,
            sha256=sha,
        )
        yield header, b""


async def _slice_data(reader: SliceReader) -> AsyncGenerator[bytes | bytearray, None]:
    """An opened reader's chunks. Taken on the loop when ``read_now`` can (cached, no hashing);
    otherwise read in a worker thread, one chunk ahead while the caller sends this one
    (hashing or waiting for the disk). Closing waits for the read in flight: a thread cannot
    be stopped, and the file must not close under it."""
    ahead: asyncio.Future[bytes | bytearray | None] | None = None
    threaded = False
    try:
        while True:
            if ahead is not None:  # first: the read ahead may have been the last chunk
                data, ahead = await ahead, None
            elif reader.done:
                return
            else:
                data = None if threaded else reader.read_now()
                if data is None:
                    threaded = True  # hashing or waiting for the disk: the rest goes to threads
                    data = await asyncio.to_thread(reader.next_chunk)
            if threaded and not reader.done:
                ahead = asyncio.ensure_future(asyncio.to_thread(reader.next_chunk))
            if data is None:
                return
            yield data
    finally:
        if ahead is not None:
            await asyncio.wait([ahead])
            if not ahead.cancelled():
                ahead.exception()  # retrieved: the stream already ended for its own reason


#: ``add_DataNodeServicer_to_server`` with ``StreamSlice``'s chunks sent as the pre-encoded bytes
#: the servicer yields.
add_data_node_servicer = with_codecs(
    data_pb2_grpc.add_DataNodeServicer_to_server, {"StreamSlice": {"response_serializer": frame_bytes}}
)
