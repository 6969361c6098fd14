"""Tensor payloads between workers: pushes into per-job inboxes, pulls of published files.

A trainer's delta reaches the parameter server as a ``Worker.PushTensors``
stream; the update (and the current global state, for a late or replacement
trainer) goes back by ``Worker.PullTensors``, which the PS worker holds open
until the round is published. Either way the payload travels as ≤ 1 MiB
``Chunk`` messages with a sha256 over the whole, and the receiving side uses
nothing before the last chunk verified: a broken stream leaves no trace in an
inbox and is simply sent again.

Memory is bounded: a payload larger than ``memory_payload_bytes`` is written to
a spool file as its chunks arrive (``TensorPayload.path``) instead of being held
whole, and the payloads queued for a job (in memory or spooled) may hold at most
``inbox_max_bytes``: a push that would go over waits before its first byte is
kept (gRPC flow control holds the sender), then fails with RESOURCE_EXHAUSTED
naming the setting. Reading and hashing run in worker threads, off the event
loop (docs/performance.md).

``TensorExchange`` is the one object per worker that owns the inboxes
(bounded queues per job and kind, ``tensor_inbox``), the publications, and the
sending side (direct channel or relay through ``PeerConnector``, with jittered
retries). Chunks travel pre-encoded and arrive as views (``tensor_frames``).
The gRPC servicer and the job bridge both drive it; it knows no HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from hypha.errors import (
    RETRYABLE_CODES,
    DataLossError,
    HyphaError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from hypha.net.backoff import Backoff
from hypha.net.wire import frame_bytes
from hypha.tensors.chunks import ChunkAssembler, ChunkFeeder
from hypha.tensors.payload import CONTENT_TYPE, read_metadata
from hypha.v1 import worker_pb2
from hypha.worker.tensor_files import SharedDigest, file_blocks, read_head
from hypha.worker.tensor_frames import (
    Pushed,
    TensorChunkView,
    encode_tensor_chunk,
    parse_tensor_chunk,
    wire_bytes,
)
from hypha.worker.tensor_inbox import (
    ChannelSource,
    JobTensors,
    Published,
    TensorPayload,
    TransferSettings,
    check_kind,
)

log = logging.getLogger(__name__)


class TensorExchange:
    """Inboxes, publications and sending for every job on this worker."""

    def __init__(self, connector: ChannelSource | None, settings: TransferSettings | None = None) -> None:
        self.connector = connector
        self.settings = settings or TransferSettings()
        self._jobs: dict[str, JobTensors] = {}
        if self.settings.spool_dir is not None and self.settings.spool_dir.is_dir():
            for stale in self.settings.spool_dir.glob(".spool-*.part"):  # left by a crash
                stale.unlink(missing_ok=True)
        #: Counters for operators and tests.
        self.stats: dict[str, int] = {"received": 0, "refused": 0, "sent": 0, "send_retries": 0, "served": 0}
        #: Tensor bytes on the wire over every job (``wire_bytes``): pushed (sent) and pulled (fetched).
        self.bytes_total: dict[str, int] = {"pushed": 0, "pulled": 0}
        #: PullTensors calls waiting for their round right now.
        self.pulls_waiting = 0

    # ---- jobs -------------------------------------------------------------------------

    def open_job(self, job_id: str) -> None:
        """Accept pushes and pulls for ``job_id`` (counted: co-located executions share it)."""
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = JobTensors(self.settings.inbox_max)
        job.users += 1

    async def close_job(self, job_id: str) -> None:
        """Forget the job once its last execution ended; waiting pulls end with NOT_FOUND."""
        job = self._jobs.get(job_id)
        if job is None:
            return
        job.users -= 1
        if job.users > 0:
            return
        del self._jobs[job_id]
        for queue in job.inboxes.values():
            while not queue.empty():
                queue.get_nowait().release()
        async with job.changed:
            job.changed.notify_all()

    def job_bytes(self, job_id: str) -> tuple[int, int]:
        """(pushed, pulled): the job's tensor bytes this worker sent and fetched so far."""
        job = self._jobs.get(job_id)
        return (job.pushed_bytes, job.pulled_bytes) if job is not None else (0, 0)

    def _job(self, job_id: str) -> JobTensors:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r} runs on this worker")
        return job

    # ---- receiving: PushTensors -----------------------------------------------------------

    async def receive(
        self, messages: AsyncIterator[Pushed], from_peer: str
    ) -> worker_pb2.PushTensorsResponse:
        """Assemble one pushed payload and queue it; raises (nothing queued) if the stream breaks.
        ``messages`` are views (``add_worker_servicer``) or, registered the generated way, messages."""
        assembler = self._assembler()
        feeder = ChunkFeeder(assembler)
        first: Pushed | None = None
        job: JobTensors | None = None
        reserved = 0
        queued = False
        try:
            try:
                async for message in messages:
                    if first is None:
                        first = message
                        check_kind(message.kind)
                        job = self._job(message.job_id)  # refuse before receiving gigabytes for nobody
                        reserved = await self._reserve(job, message.job_id, message.chunk.total_size)
                    await feeder.feed(message.chunk)
                await feeder.flush()
                if first is None:
                    raise InvalidArgumentError("empty tensor stream")
                payload = await self._complete(
                    assembler, first.job_id, first.kind, first.round, first.samples, from_peer
                )
            except HyphaError as err:
                self.stats["refused"] += 1
                log.info("tensor push from %s refused: %s", from_peer, err.message)
                raise
            assert job is not None
            queue = job.inbox(first.kind)
            try:
                async with asyncio.timeout(self.settings.inbox_put_timeout_s):
                    await queue.put(payload)
            except TimeoutError:
                payload.release()
                raise ResourceExhaustedError(
                    f"inbox of job {first.job_id} ({first.kind}) is full "
                    f"(jobs.inbox_max = {self.settings.inbox_max}); try again later"
                ) from None
            queued = True
        finally:
            await feeder.settle()
            assembler.abort()  # nothing after finish; a half-received spool file is deleted
            if not queued and job is not None and reserved:
                await self._unreserve(job, reserved)
        self.stats["received"] += 1
        log.debug("queued %s round %d from %s (%d bytes)", first.kind, first.round, from_peer, payload.nbytes)
        return worker_pb2.PushTensorsResponse(accepted=True, message="queued")

    def _assembler(self) -> ChunkAssembler:
        settings = self.settings
        return ChunkAssembler(
            max_bytes=settings.max_payload_bytes,
            expected_content_type=CONTENT_TYPE,
            spool_dir=settings.spool_dir or Path(tempfile.gettempdir()) / "hypha-tensor-spool",
            memory_bytes=settings.memory_payload_bytes,
        )

    async def _complete(
        self, assembler: ChunkAssembler, job_id: str, kind: str, round: int, samples: int, from_peer: str
    ) -> TensorPayload:
        """The verified payload, in memory or as its spool file; its safetensors header checked."""
        if assembler.spooled:
            path = assembler.finish_file()
            try:
                head = await asyncio.to_thread(read_head, path)
                read_metadata(head)  # a safetensors header, or nothing gets queued
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            return TensorPayload(
                job_id, kind, round, samples, from_peer, path=path, size=assembler.total_size
            )
        data = assembler.finish()
        read_metadata(data)
        return TensorPayload(job_id, kind, round, samples, from_peer, data=data)

    async def _reserve(self, job: JobTensors, job_id: str, size: int) -> int:
        """Hold ``size`` bytes of the job's inbox budget, waiting (bounded) while it is spent."""
        limit = self.settings.inbox_max_bytes
        if size > limit:
            raise InvalidArgumentError(
                f"payload of {size} bytes exceeds jobs.inbox_max_bytes = {limit} of job {job_id}"
            )
        try:
            async with asyncio.timeout(self.settings.inbox_put_timeout_s):
                async with job.room:
                    await job.room.wait_for(lambda: job.held_bytes + size <= limit)
                    job.held_bytes += size
        except TimeoutError:
            raise ResourceExhaustedError(
                f"inbox of job {job_id} holds {job.held_bytes} bytes; {size} more would exceed "
                f"jobs.inbox_max_bytes = {limit}; try again later"
            ) from None
        return size

    async def _unreserve(self, job: JobTensors, size: int) -> None:
        async with job.room:
            job.held_bytes -= size
            job.room.notify_all()

    async def next_received(self, job_id: str, kind: str, timeout_s: float) -> TensorPayload | None:
        """The next queued payload of (job, kind), or None after ``timeout_s``.

        A spooled payload's file now belongs to the caller (``TensorPayload.release``)."""
        job = self._job(job_id)
        queue = job.inbox(check_kind(kind))
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                payload = await queue.get()
        except TimeoutError:
            return None
        await self._unreserve(job, payload.nbytes)
        return payload

    # ---- publishing: PullTensors --------------------------------------------------------------

    async def publish(self, job_id: str, kind: str, round: int, path: Path, samples: int = 0) -> None:
        """Serve ``path`` to pullers of (job, kind, round) and wake those already waiting; the
        file is hashed once, from now on, for all of them (``SharedDigest``)."""
        job = self._job(job_id)
        check_kind(kind)
        rounds = job.published.setdefault(kind, {})
        rounds[round] = Published(path, samples, await SharedDigest.of(path))
        for old in sorted(rounds)[: -self.settings.keep_published]:
            del rounds[old]
        async with job.changed:
            job.changed.notify_all()

    def _find(self, job: JobTensors, kind: str, round: int) -> tuple[int, Published] | None:
        rounds = job.published.get(kind, {})
        if kind == "global":
            # The current global state: a joining trainer takes the newest, never an older one.
            newer = [r for r in rounds if r >= round]
            return (max(newer), rounds[max(newer)]) if newer else None
        found = rounds.get(round)
        return (round, found) if found is not None else None

    async def serve_pull(
        self, request: worker_pb2.PullTensorsRequest, time_remaining: float | None
    ) -> AsyncIterator[bytes]:
        """The PullTensors stream: waits for the round to be published (bounded), then streams it."""
        kind = check_kind(request.kind)
        job = self._job(request.job_id)
        wait_s = self.settings.max_pull_wait_s if time_remaining is None else time_remaining
        self.pulls_waiting += 1
        try:
            async with asyncio.timeout(wait_s):
                async with job.changed:
                    await job.changed.wait_for(
                        lambda: (
                            self._find(job, kind, request.round) is not None
                            or request.job_id not in self._jobs
                        )
                    )
        except TimeoutError:
            raise UnavailableError(
                f"{kind} of round {request.round} not published within {wait_s:.1f} s"
            ) from None
        finally:
            self.pulls_waiting -= 1
        found = self._find(job, kind, request.round)
        if found is None:
            raise NotFoundError(f"job {request.job_id} ended on this worker")
        round, published = found
        header = worker_pb2.TensorChunk(
            job_id=request.job_id, kind=kind, round=round, samples=published.samples
        )
        async for chunk, data in file_blocks(
            published.path, self.settings.chunk_size, known=published.digest
        ):
            yield encode_tensor_chunk(header, chunk, data)
            header = _REST
        self.stats["served"] += 1

    # ---- sending: PushTensors to a peer, PullTensors from a peer ---------------------------------

    def _outgoing(self, attempt: int, messages: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Fault seam: tests override it to break attempt ``attempt``'s stream (of encoded
        ``TensorChunk`` messages)."""
        return messages

    async def _push_stream(
        self, job_id: str, kind: str, round: int, samples: int, path: Path
    ) -> AsyncIterator[bytes]:
        job = self._jobs.get(job_id)
        header = worker_pb2.TensorChunk(job_id=job_id, kind=kind, round=round, samples=samples)
        async for chunk, data in file_blocks(path, self.settings.chunk_size):
            message = encode_tensor_chunk(header, chunk, data)
            header = _REST
            size = wire_bytes(message)
            self.bytes_total["pushed"] += size
            if job is not None:
                job.pushed_bytes += size
            yield message

    def _require_connector(self) -> ChannelSource:
        if self.connector is None:
            raise UnavailableError("this worker has no way to reach peers")
        return self.connector

    async def send(
        self,
        job_id: str,
        peer_id: str,
        addresses: Sequence[str],
        kind: str,
        round: int,
        samples: int,
        path: Path,
    ) -> tuple[bool, str]:
        """Push a file to ``peer_id``'s job; retries broken streams; (accepted, message)."""
        check_kind(kind)
        if not await asyncio.to_thread(path.is_file):
            raise NotFoundError(f"no file {path.name} to send")
        connector = self._require_connector()
        backoff = Backoff(self.settings.backoff_base_s, self.settings.backoff_cap_s)
        reasons: list[str] = []
        for attempt in range(self.settings.send_attempts):
            if attempt:
                self.stats["send_retries"] += 1
                await asyncio.sleep(backoff.next_delay())
            try:
                channel = await connector.channel(peer_id, list(addresses))
                stream = self._outgoing(attempt, self._push_stream(job_id, kind, round, samples, path))
                response = await _push_call(channel)(stream, timeout=self.settings.push_timeout_s)
            except UnavailableError as err:
                reasons.append(err.message)
                continue
            except grpc.aio.AioRpcError as err:
                code = err.code()
                reasons.append(f"{code.name}: {err.details()}")
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    await connector.invalidate(peer_id)
                # NOTE: grpcio sometimes reports a server's early final status on a client
                # stream (e.g. NOT_FOUND after the first chunk) as this INTERNAL instead; it is a
                # transport artefact, so the push is tried again to learn the real answer.
                core_artefact = (
                    code is grpc.StatusCode.INTERNAL and err.details() == "Internal error from Core"
                )
                if code in RETRYABLE_CODES or code is grpc.StatusCode.DATA_LOSS or core_artefact:
                    log.info("sending %s to %s: attempt %d failed: %s", kind, peer_id, attempt + 1, code.name)
                    continue
                return False, reasons[-1]
            self.stats["sent"] += 1
            return response.accepted, response.message
        raise UnavailableError(
            f"sending {kind} to {peer_id} failed after {self.settings.send_attempts} attempts: "
            + "; ".join(reasons)
        )

    async def fetch(
        self,
        job_id: str,
        peer_id: str,
        addresses: Sequence[str],
        kind: str,
        round: int,
        timeout_s: float,
    ) -> TensorPayload | None:
        """Pull (job, kind, round) from ``peer_id``; None when it is not published within ``timeout_s``.

        A peer whose job is not there yet (NOT_FOUND) or that cannot be
        reached is asked again until the time is up; a broken stream too.
        """
        check_kind(kind)
        connector = self._require_connector()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        backoff = Backoff(self.settings.backoff_base_s, self.settings.backoff_cap_s)
        while (remaining := deadline - loop.time()) > 0:
            try:
                channel = await connector.channel(peer_id, list(addresses))
                return await self._pull_once(channel, job_id, peer_id, kind, round, remaining)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    return None
                if code is grpc.StatusCode.UNAVAILABLE:
                    await connector.invalidate(peer_id)
                if code not in (*RETRYABLE_CODES, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS):
                    raise UnavailableError(
                        f"pulling {kind} from {peer_id}: {code.name}: {err.details()}"
                    ) from None
                log.debug("pulling %s from %s: %s; asking again", kind, peer_id, code.name)
            except (UnavailableError, DataLossError, InvalidArgumentError) as err:
                log.info("pulling %s from %s: %s; asking again", kind, peer_id, err.message)
            await asyncio.sleep(min(backoff.next_delay(), max(0.0, deadline - loop.time())))
        return None

    async def _pull_once(
        self, channel: Any, job_id: str, peer_id: str, kind: str, round: int, timeout_s: float
    ) -> TensorPayload:
        call = _pull_call(channel)(
            worker_pb2.PullTensorsRequest(job_id=job_id, kind=kind, round=round), timeout=timeout_s
        )
        assembler = self._assembler()
        feeder = ChunkFeeder(assembler)
        first: TensorChunkView | None = None
        job = self._jobs.get(job_id)
        try:
            async for message in call:
                if first is None:
                    first = message
                size = wire_bytes(message)
                self.bytes_total["pulled"] += size
                if job is not None:
                    job.pulled_bytes += size
                await feeder.feed(message.chunk)
            await feeder.flush()
            if first is None:
                raise DataLossError(f"{kind} stream from {peer_id} ended before its first chunk")
            return await self._complete(
                assembler, job_id, first.kind or kind, first.round, first.samples, peer_id
            )
        finally:
            if not call.done():
                call.cancel()
            await feeder.settle()
            assembler.abort()


#: The header of every chunk of a stream but the first: nothing beyond the chunk.
_REST = worker_pb2.TensorChunk()


def _push_call(channel: Any) -> Any:
    """``Worker.PushTensors`` on ``channel`` (direct or relayed), sending pre-encoded messages."""
    return channel.stream_unary(
        "/hypha.v1.Worker/PushTensors",
        request_serializer=frame_bytes,
        response_deserializer=worker_pb2.PushTensorsResponse.FromString,
    )


def _pull_call(channel: Any) -> Any:
    """``Worker.PullTensors`` on ``channel``, each chunk read as a ``TensorChunkView``."""
    return channel.unary_stream(
        "/hypha.v1.Worker/PullTensors",
        request_serializer=worker_pb2.PullTensorsRequest.SerializeToString,
        response_deserializer=parse_tensor_chunk,
    )


__all__ = [
    "ChannelSource",
    "TensorExchange",
    "TensorPayload",
    "TransferSettings",
    "check_kind",
]
