"""One ``StreamSlice`` call to one data node: a slice's bytes from where a partial download stopped.

``SliceFetcher`` (hypha.worker.fetcher) chooses the providers, retries and
caches; this is a single attempt. It resumes at the partial download's
offset, refuses a provider that serves another version of the slice before
its bytes are used (the first chunk's sha256 against the expected one and the
one the partial's first bytes came with), bounds the wait for each chunk, and
returns once the assembler verified the whole slice. A failed attempt raises
``AttemptError``, which says whether the bytes so far remain good for a resume
and whether the channel should be dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from hypha.datasets.format import CONTENT_TYPE
from hypha.errors import HyphaError
from hypha.tensors.chunk_frames import ChunkView, parse_chunk
from hypha.tensors.chunks import ChunkAssembler, ChunkFeeder
from hypha.v1 import data_pb2


def stream_slice(channel: Any) -> Any:
    """``DataNode.StreamSlice`` on ``channel`` (direct or relayed), its chunks read as
    ``ChunkView``s: their data stays in the received bytes, protobuf copies none of it."""
    return channel.unary_stream(
        "/hypha.v1.DataNode/StreamSlice",
        request_serializer=data_pb2.StreamSliceRequest.SerializeToString,
        response_deserializer=parse_chunk,
    )


class AttemptError(Exception):
    """One attempt on one provider failed; ``keep_partial`` says whether the bytes so far stay valid."""

    def __init__(self, reason: str, *, keep_partial: bool = True, drop_channel: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.keep_partial = keep_partial
        self.drop_channel = drop_channel


class PartialSlice:
    """A download in progress: the assembler plus which version of the slice its bytes belong to."""

    def __init__(self, max_bytes: int) -> None:
        self.assembler = ChunkAssembler(max_bytes=max_bytes, expected_content_type=CONTENT_TYPE)
        #: sha256 the first serving provider announced; a resume must come from the same version.
        self.sha256 = ""
        #: sha256 carried by the last chunk, once the payload verified.
        self.verified_sha256 = ""


async def stream_attempt(
    channel: Any,
    dataset: str,
    index: int,
    partial: PartialSlice,
    expected: str,
    *,
    stream_timeout_s: float,
    chunk_timeout_s: float,
) -> None:
    """One StreamSlice call from ``partial``'s offset; returns once the payload verified."""
    assembler = partial.assembler
    offset = assembler.received
    call = stream_slice(channel)(
        data_pb2.StreamSliceRequest(dataset=dataset, index=index, offset=offset),
        timeout=stream_timeout_s,
    )
    first = True
    feeder = ChunkFeeder(assembler)
    try:
        while True:
            try:
                async with asyncio.timeout(chunk_timeout_s):
                    chunk = await call.read()
            except TimeoutError:
                raise AttemptError(f"no chunk for {chunk_timeout_s:g} s", drop_channel=True) from None
            if chunk is grpc.aio.EOF:
                await feeder.settle()
                raise AttemptError(f"stream ended after {assembler.received} bytes without its last chunk")
            assert isinstance(chunk, ChunkView)
            if first:
                _check_version(chunk, partial, expected, offset)
                first = False
            if chunk.last:
                _check_final_sha(chunk, partial, expected)
            try:
                # Chunk k is hashed (and spooled) in a thread while chunk k+1 comes off the wire.
                await feeder.feed(chunk)
                if chunk.last:
                    await feeder.flush()
            except HyphaError as err:
                raise AttemptError(f"refused the stream: {err.message}", keep_partial=False) from None
            if assembler.complete:
                partial.verified_sha256 = chunk.sha256.lower()
                return
    except grpc.aio.AioRpcError as err:
        code = err.code()
        detail = (err.details() or "").splitlines()[0] if err.details() else ""
        raise AttemptError(
            f"{code.name}: {detail}" if detail else code.name,
            drop_channel=code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
        ) from None
    finally:
        if not call.done():
            call.cancel()
        await feeder.settle()  # the partial's byte count is final before a resume reads it


def _check_version(chunk: ChunkView, partial: PartialSlice, expected: str, offset: int) -> None:
    """A provider that serves another version of the slice is skipped before its bytes are used."""
    served = chunk.metadata.get("sha256", "").lower()
    if expected and served and served != expected:
        raise AttemptError(f"serves a different version of the slice (sha256 {served[:12]}...)")
    if offset and partial.sha256 and served and served != partial.sha256:
        # The bytes so far belong to another version: start over on the next attempt.
        raise AttemptError("cannot resume: serves a different version of the slice", keep_partial=False)
    if not offset:
        partial.sha256 = served


def _check_final_sha(chunk: ChunkView, partial: PartialSlice, expected: str) -> None:
    final = chunk.sha256.lower()
    if expected and final != expected:
        raise AttemptError(
            f"slice sha256 {final[:12]}... is not the expected {expected[:12]}...", keep_partial=False
        )
    if partial.sha256 and final != partial.sha256:
        raise AttemptError("last chunk's sha256 differs from the first chunk's", keep_partial=False)


__all__ = ["AttemptError", "PartialSlice", "stream_attempt", "stream_slice"]
