"""Receiving files streamed as chunks: the one verified writer.

A job's result travels twice as a stream of files: from the parameter
server's worker to the scheduler (``Worker.PullTensors``, kind ``result``)
and from the scheduler to a client (``Scheduler.FetchResult``, ``hypha
fetch``), sent both times by ``hypha.filesend``. Each file is a run of
``hypha.v1.Chunk`` messages: the first names the file (a relative path) and
carries its size, the last carries its sha256.

Each file goes to a temporary ``.NAME.part`` next to its target, is checked
(offsets in order, size, sha256), fsynced and only then renamed into place,
so a broken or forged transfer never leaves a plausible-looking file, and a
name that would leave the target directory is refused before anything is
written. Every refusal is a ``FileStreamError``.

Names are confined: relative, no ``..``, no hidden component (a result has no
business writing ``.git/hooks/x`` or ``.bashrc`` under a client's ``--out``),
no NUL or backslash, and the resolved target must stay under the root (a
symlink inside it does not lead out). ``StreamLimits`` caps the file count
and the bytes (declared and written) of one stream; going over is a
``FileStreamLimitError`` (RESOURCE_EXHAUSTED).

NOTE: written as it arrives (one chunk in memory at a time), so a result may
be larger than memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from hypha.errors import DataLossError, ResourceExhaustedError
from hypha.fsutil import fsync_dir
from hypha.v1 import common_pb2


class FileStreamError(DataLossError):
    """A streamed file was cut off, out of order, failed its checks or named a path outside the target."""


class FileStreamLimitError(ResourceExhaustedError):
    """A stream brought more files or bytes than its ``StreamLimits`` allow."""


@dataclass(frozen=True)
class StreamLimits:
    """What one stream of files may bring; None: no limit."""

    max_files: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class ReceivedFile:
    """One file written and verified: its relative name, size and sha256."""

    path: str
    bytes: int
    sha256: str


class FileStreamWriter:
    """Writes the files of one stream under ``root``; feed it every chunk in order, then ``close()``.

    Synchronous (plain file I/O): async callers use ``receive_files``.
    """

    def __init__(self, root: Path, limits: StreamLimits | None = None) -> None:
        self.root = Path(root)
        self.limits = limits or StreamLimits()
        self._declared = 0
        self.files: list[ReceivedFile] = []
        self._handle: IO[bytes] | None = None
        self._name = ""
        self._target = Path()
        self._digest = hashlib.sha256()
        self._written = 0
        self._total = 0

    @property
    def _part(self) -> Path:
        return self._target.with_name(f".{self._target.name}.part")

    def feed(self, name: str, chunk: common_pb2.Chunk) -> None:
        """Take the next chunk; ``name`` is set on a file's first chunk only."""
        if name:
            if self._handle is not None:
                self._refuse(f"{self._name}: the stream moved on to {name!r} before the file's last chunk")
            self._open(name, chunk.total_size)
        if self._handle is None:
            raise FileStreamError("file stream: a chunk came before any file name")
        if chunk.offset != self._written:
            self._refuse(f"{self._name}: chunk at offset {chunk.offset}, expected {self._written}")
        if self._written + len(chunk.data) > self._total:
            self._refuse(f"{self._name}: more bytes than the {self._total} the file declared")
        self._handle.write(chunk.data)
        self._digest.update(chunk.data)
        self._written += len(chunk.data)
        if chunk.last:
            self._finish(chunk.sha256)

    def close(self) -> list[ReceivedFile]:
        """The stream ended: every file must be complete. Returns the files written."""
        if self.abort():
            raise FileStreamError(f"{self._name}: the stream ended before the file's last chunk")
        return self.files

    def abort(self) -> bool:
        """Drop a file left half-written (the stream broke); True if there was one."""
        if self._handle is None:
            return False
        self._handle.close()
        self._handle = None
        self._part.unlink(missing_ok=True)
        return True

    def _open(self, name: str, total: int) -> None:
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:
            raise FileStreamError(f"file stream: refusing file name {name!r} (outside the target directory)")
        if "\x00" in name or "\\" in name or any(part.startswith(".") for part in pure.parts):
            raise FileStreamError(f"file stream: refusing file name {name!r} (hidden or odd characters)")
        limits = self.limits
        if limits.max_files is not None and len(self.files) >= limits.max_files:
            raise FileStreamLimitError(f"file stream: more than {limits.max_files} files")
        if total < 0 or (limits.max_bytes is not None and self._declared + total > limits.max_bytes):
            raise FileStreamLimitError(
                f"file stream: {name!r} ({total} bytes) would take the stream over {limits.max_bytes} bytes"
            )
        root = self.root.resolve()
        target = root.joinpath(*pure.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.parent.resolve().is_relative_to(root) or target.is_symlink():
            raise FileStreamError(
                f"file stream: refusing file name {name!r} (leads outside the target directory)"
            )
        self._declared += total
        self._name = name
        self._target = target
        # O_NOFOLLOW|O_EXCL: a planted link or file at the part name is not written through.
        self._part.unlink(missing_ok=True)
        self._handle = os.fdopen(
            os.open(self._part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "wb"
        )
        self._digest = hashlib.sha256()
        self._written, self._total = 0, total

    def _finish(self, sha256: str) -> None:
        assert self._handle is not None
        handle, self._handle = self._handle, None
        try:
            handle.flush()
            os.fsync(handle.fileno())
        finally:
            handle.close()
        digest = self._digest.hexdigest()
        if self._written != self._total or not sha256 or digest != sha256.lower():
            self._part.unlink(missing_ok=True)
            raise FileStreamError(
                f"{self._name}: {self._written} of {self._total} bytes, sha256 {digest[:16]} "
                f"where {sha256[:16] or 'none'} was sent; file discarded"
            )
        os.replace(self._part, self._target)
        fsync_dir(self._target.parent)
        self.files.append(ReceivedFile(self._name, self._written, digest))

    def _refuse(self, message: str) -> None:
        self.abort()
        raise FileStreamError(message)


async def receive_files(
    stream: AsyncIterable[tuple[str, common_pb2.Chunk]], root: Path, limits: StreamLimits | None = None
) -> list[ReceivedFile]:
    """Write a stream of (name on a file's first chunk else "", chunk) under ``root``.

    The disk writes run in a worker thread so the event loop keeps serving;
    on any error (a refused chunk, a broken stream, cancellation) the file
    being written is dropped and the error propagates.
    """
    writer = FileStreamWriter(root, limits)
    try:
        async for name, chunk in stream:
            write = asyncio.ensure_future(asyncio.to_thread(writer.feed, name, chunk))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                await asyncio.wait([write])  # a thread cannot be stopped: let it finish before abort
                raise
    except BaseException:
        writer.abort()
        raise
    return writer.close()


__all__ = [
    "FileStreamError",
    "FileStreamLimitError",
    "FileStreamWriter",
    "ReceivedFile",
    "StreamLimits",
    "receive_files",
]
