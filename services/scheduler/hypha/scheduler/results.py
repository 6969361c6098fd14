"""A finished DiLoCo job's result: pulled from the parameter server's worker into the state dir.

The worker streams the result directory (``config.json`` + safetensors) with
``PullTensors`` (kind ``result``); each file is written and verified by the
one file-stream writer (``hypha.filestream``) into ``<job>.partial``, which
replaces ``<state_dir>/results/<job_id>/`` only once every file arrived
intact (``hypha.fsutil.replace_dir``: a failed swap leaves the previous
result as it was). ``FetchResult`` serves it from there.

A worker decides what it sends, so the pull is bounded: ``StreamLimits``
(``jobs.result_max_files`` / ``jobs.result_max_bytes``) cap what one result
may bring onto the scheduler's disk, and going over fails the pull at once
(no retry: the same worker would send the same result). So does a result the
worker refuses to send because the job left a link or special file in it
(FAILED_PRECONDITION from ``hypha.filesend``): the job fails saying which.

Every kind that ends with a result (a DiLoCo job's model, a task's declared
outputs, an inference job's outputs) keeps it through ``keep_result``: the
pull, its bytes on the scheduler's ``bytes_moved`` metric, and a failed pull
as the job's failure.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from hypha.errors import DataLossError, HyphaError
from hypha.filestream import FileStreamLimitError, StreamLimits, receive_files
from hypha.fsutil import replace_dir
from hypha.net.backoff import Backoff
from hypha.scheduler.config import JobsSection
from hypha.scheduler.runs import JobFailed, RunRegistry
from hypha.scheduler.worker_calls import WorkerCalls, describe, is_refusal
from hypha.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)

RESULTS_DIR = "results"
#: First and longest pause between two tries of a result pull.
FIRST_RETRY_S = 0.2
MAX_RETRY_S = 2.0
#: Bounds of one result when the caller gives none (the scheduler's config defaults).
DEFAULT_LIMITS = StreamLimits(max_files=1000, max_bytes=64 * 1024**3)


def result_dir(state_dir: Path, job_id: str) -> Path:
    """Where a job's result lives on the scheduler."""
    return state_dir / RESULTS_DIR / job_id


def result_limits(jobs: JobsSection) -> StreamLimits:
    """The ``jobs.result_max_*`` keys as the limits of one pull."""
    return StreamLimits(max_files=jobs.result_max_files, max_bytes=jobs.result_max_bytes)


class ResultPullError(HyphaError):
    """The result could not be pulled before the deadline, or the worker refused it."""


async def pull_result(
    calls: WorkerCalls,
    worker_id: str,
    job_id: str,
    target: Path,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    limits: StreamLimits | None = None,
) -> int:
    """Copy the job's result from ``worker_id`` into ``target``; returns the bytes pulled.

    Retried until ``timeout_s``: a worker that is still filing the finished
    execution away answers NOT_FOUND for a moment, and a stream may break.
    """
    partial = target.with_name(target.name + ".partial")
    deadline = clock() + timeout_s
    pause = Backoff(FIRST_RETRY_S, MAX_RETRY_S)
    while True:
        await asyncio.to_thread(_fresh_dir, partial)
        try:
            stream = calls.result_stream(worker_id, job_id, timeout_s=max(1.0, deadline - clock()))
            files = await receive_files(_named_chunks(stream), partial, limits or DEFAULT_LIMITS)
            if not files:
                raise DataLossError("the result stream held no files")
            break
        except (grpc.aio.AioRpcError, HyphaError, OSError) as err:
            delay = pause.next_delay()
            if clock() + delay >= deadline or _is_final(err):
                await asyncio.to_thread(shutil.rmtree, partial, True)
                raise ResultPullError(f"pulling the result from {worker_id} failed: {describe(err)}") from err
            log.info("job %s: result pull from %s failed (%s); retrying", job_id, worker_id, describe(err))
            await asyncio.sleep(delay)
    await asyncio.to_thread(replace_dir, partial, target)
    return sum(file.bytes for file in files)


async def keep_result(
    runs: RunRegistry, worker_id: str, job_id: str, state_dir: Path, *, failure: str = ""
) -> Path:
    """Pull the job's result from ``worker_id`` into its result dir (returned) and count its bytes;
    a pull that fails ends the job (``JobFailed``: ``failure`` then the pull's reason)."""
    target = result_dir(state_dir, job_id)
    try:
        size = await pull_result(
            runs.calls,
            worker_id,
            job_id,
            target,
            runs.jobs_cfg.result_timeout_s,
            runs.clock,
            limits=result_limits(runs.jobs_cfg),
        )
    except ResultPullError as err:
        raise JobFailed(failure + err.message) from err
    if runs.metrics is not None:
        runs.metrics.bytes_moved.labels(kind="result_pull").inc(size)
    return target


def _is_final(err: BaseException) -> bool:
    """Errors the same worker would answer again: a refusal, a result over the limits, or one it
    will not send (FAILED_PRECONDITION: a link or special file in it, ``hypha.filesend``)."""
    if is_refusal(err) or isinstance(err, FileStreamLimitError):
        return True
    if isinstance(err, grpc.aio.AioRpcError):
        return err.code() == grpc.StatusCode.FAILED_PRECONDITION
    return isinstance(err, HyphaError) and err.status == grpc.StatusCode.FAILED_PRECONDITION


async def _named_chunks(
    stream: AsyncIterator[worker_pb2.TensorChunk],
) -> AsyncIterator[tuple[str, common_pb2.Chunk]]:
    """``TensorChunk``s as (file name on a file's first chunk, chunk): the name is metadata ``path``."""
    async for piece in stream:
        chunk = piece.chunk
        yield chunk.metadata.get("path", ""), chunk


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


__all__ = [
    "DEFAULT_LIMITS",
    "RESULTS_DIR",
    "ResultPullError",
    "keep_result",
    "pull_result",
    "result_dir",
    "result_limits",
]
