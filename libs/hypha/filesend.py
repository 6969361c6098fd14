"""Sending a result directory as chunks: the one reader, and it never follows a link.

A job's result leaves twice as a stream of files (``hypha.filestream`` is the
receiving side): from the worker that kept it to the scheduler
(``Worker.PullTensors``, kind ``result``) and from the scheduler to a client
(``Scheduler.FetchResult``). Both send with ``send_dir``.

A job writes its result directory and the worker, outside the sandbox, reads
it: a symlink left there to a file the job cannot read itself (the worker's
key) would have the worker read that file and stream it on to the client. So a
result holds only directories and regular files: a symbolic link (to a file or
to a directory), a fifo, a socket or a device anywhere under the root fails the
whole send with ``FileSendRefused`` (FAILED_PRECONDITION, so the scheduler
does not ask again), naming the path, before the first byte goes out. The walk
lists each directory through its descriptor without following anything, and
every directory and file is then opened relative to its parent's descriptor
with ``O_NOFOLLOW`` and checked with ``fstat``: a link or fifo swapped in
between the walk and the open is refused too (the stream breaks off there and
the receiver drops the file in flight).

NOTE: hard links are not refused. A regular file with ``st_nlink > 1`` may be
a second name of a file elsewhere, but a job can only link what it can name:
under bubblewrap the worker's key, config and state dir are not mounted, and a
link cannot cross into the bind-mounted work dir (EXDEV); unconfined, the job
runs as the worker's user and reads those files anyway. On top of that Linux's
``fs.protected_hardlinks`` (1 by default, so on the machines this was written
on: ``/proc/sys/fs/protected_hardlinks``) refuses a link to another user's
file the linker cannot both read and write.

Files are read block by block in a worker thread, never mapped (a file cut
short while it is sent must not kill the sender with SIGBUS), each block
hashed as it is read, the next read while the current block is on the wire;
the last chunk of a file carries its sha256 (the receiver's check).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path, PurePosixPath
from typing import Any

from hypha.errors import FailedPreconditionError, NotFoundError
from hypha.tensors.chunks import DEFAULT_CHUNK_SIZE
from hypha.v1 import common_pb2

#: Content types by suffix, for the receiver's information (``hypha fetch`` keeps files as they come).
CONTENT_TYPES = {".safetensors": "application/safetensors", ".json": "application/json", ".txt": "text/plain"}

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: opening a fifo swapped in for a file must not hang the sender (it is refused after fstat).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class FileSendRefused(FailedPreconditionError):
    """The directory holds something other than directories and regular files: nothing of it is sent."""


def _refused(label: str, relative: str, what: str) -> FileSendRefused:
    return FileSendRefused(
        f"{label}: {relative!r} is {what}; a result holds only regular files and directories, "
        "so none of it is sent"
    )


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return f"not a regular file (mode {stat.filemode(mode)})"


def _open_at(dir_fd: int | None, name: str, flags: int, label: str, relative: str) -> int:
    """``name`` opened without following a link; a link there (ELOOP, or ENOTDIR for a link where a
    directory is expected) is a refusal, a missing one NotFound."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise NotFoundError(f"{label}: {relative!r} is gone") from None
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = stat.S_IFLNK  # gone again: it was not what it should be either way
        raise _refused(label, relative, _kind(mode)) from None


def _walk(dir_fd: int, prefix: str, label: str, found: list[str]) -> None:
    with os.scandir(dir_fd) as entries:
        listed = sorted((entry.name, entry) for entry in entries)
    for name, entry in listed:
        relative = f"{prefix}{name}"
        if entry.is_dir(follow_symlinks=False):
            child = _open_at(dir_fd, name, _DIR_FLAGS, label, relative)
            try:
                _walk(child, f"{relative}/", label, found)
            finally:
                os.close(child)
        elif entry.is_file(follow_symlinks=False):
            found.append(relative)
        else:
            raise _refused(label, relative, _kind(entry.stat(follow_symlinks=False).st_mode))


def list_files(root: Path, label: str = "result") -> list[str]:
    """The relative names of every file under ``root``, sorted; FileSendRefused at the first thing
    that is neither a regular file nor a directory (a link to either included). Blocking."""
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        raise NotFoundError(f"{label}: {root.name} is missing") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _refused(label, root.name, "a symbolic link") from None
        if err.errno == errno.ENOTDIR:
            raise NotFoundError(f"{label}: {root.name} is not a directory") from None
        raise
    found: list[str] = []
    try:
        _walk(root_fd, "", label, found)
    finally:
        os.close(root_fd)
    return sorted(found)


def _open_file(root: Path, relative: str, label: str) -> int:
    """``root/relative`` opened component by component, no link followed, and checked to be a regular file."""
    *dirs, name = PurePosixPath(relative).parts
    dir_fd = _open_at(None, str(root), _DIR_FLAGS, label, root.name)
    try:
        for depth, part in enumerate(dirs):
            inner = _open_at(dir_fd, part, _DIR_FLAGS, label, "/".join(dirs[: depth + 1]))
            os.close(dir_fd)
            dir_fd = inner
        fd = _open_at(dir_fd, name, _FILE_FLAGS, label, relative)
    finally:
        os.close(dir_fd)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refused(label, relative, _kind(mode))
    os.set_blocking(fd, True)
    return fd


def _close_opened(done: asyncio.Future[int]) -> None:
    if not done.cancelled() and done.exception() is None:
        os.close(done.result())


def _read_hashed(fd: int, size: int, offset: int, digest: Any) -> bytes:
    data = os.pread(fd, size, offset)
    digest.update(data)
    return data


async def _file_chunks(
    root: Path, relative: str, label: str, chunk_size: int
) -> AsyncGenerator[common_pb2.Chunk, None]:
    opening = asyncio.ensure_future(asyncio.to_thread(_open_file, root, relative, label))
    try:
        fd = await asyncio.shield(opening)
    except asyncio.CancelledError:
        # A thread cannot be stopped: the descriptor it opens is closed once it is there.
        opening.add_done_callback(_close_opened)
        raise
    reading: asyncio.Future[bytes] | None = None
    try:
        total = os.fstat(fd).st_size
        digest = hashlib.sha256()
        offset = 0

        def read_next(at: int) -> asyncio.Future[bytes] | None:
            # Reads stay sequential (each starts once the one before is done): the digest is in order.
            if at >= total:
                return None
            return asyncio.ensure_future(
                asyncio.to_thread(_read_hashed, fd, min(chunk_size, total - at), at, digest)
            )

        reading = read_next(0)
        while True:
            data = b""
            if reading is not None:
                data, reading = await reading, None
            chunk = common_pb2.Chunk(offset=offset, data=data)
            if offset == 0:
                chunk.total_size = total
                chunk.content_type = CONTENT_TYPES.get(
                    PurePosixPath(relative).suffix, "application/octet-stream"
                )
                chunk.metadata["path"] = relative
            offset += len(data)
            # A file cut short ends early: the receiver finds fewer bytes than declared (DATA_LOSS).
            if offset >= total or not data:
                chunk.last = True
                chunk.sha256 = digest.hexdigest()
                yield chunk
                return
            reading = read_next(offset)
            yield chunk
    finally:
        if reading is not None:  # the consumer stopped early: let the thread finish before closing
            await asyncio.wait([reading])
        os.close(fd)


async def send_dir(
    root: Path, label: str = "result", chunk_size: int = DEFAULT_CHUNK_SIZE
) -> AsyncIterator[tuple[str, common_pb2.Chunk]]:
    """(name on a file's first chunk else "", chunk) for every file under ``root`` in name order.

    The first chunk of a file also names it in its metadata (``path``), the
    last carries its sha256; an empty directory yields nothing. ``label``
    begins every error message (which job's result). Raises FileSendRefused
    (before anything is yielded if the walk finds it) or NotFoundError.
    """
    names = await asyncio.to_thread(list_files, root, label)
    for relative in names:
        first = True
        async with contextlib.aclosing(_file_chunks(root, relative, label, chunk_size)) as chunks:
            async for chunk in chunks:
                yield (relative if first else ""), chunk
                first = False


__all__ = ["CONTENT_TYPES", "FileSendRefused", "list_files", "send_dir"]
