"""Reading one slice for one stream: verified before its first byte leaves, or as it goes.

A slice file is checked against its manifest sha256 on every stream. The first
time this node serves a file (or after the file changed: another inode, size,
mtime or ctime) the whole slice is read and hashed before its first chunk
leaves, so a slice that was rewritten or replaced badly is refused with
``DATA_LOSS`` and not one of its bytes is sent. Once a file has passed that
check, later streams of the same unchanged file are hashed *while* they are
read and sent, one chunk read ahead, so a reader no longer waits for a whole
slice to be hashed before its first byte (that wait was a third of a 4 MiB
slice's time: docs/performance.md). The check still covers every byte: the
last chunk, the one carrying the sha256, is withheld when the bytes no longer
match (rot the file's stat cannot show), the stream ends in ``DATA_LOSS``, the
reader discards what it had (its own sha256 would refuse it anyway) and the
file is checked whole again before it is next served.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import IO, NamedTuple, NoReturn

from hypha.datasets.format import Dataset
from hypha.errors import DataLossError, InvalidArgumentError, OutOfRangeError

log = logging.getLogger(__name__)

#: Bytes read per call while hashing the part of a slice a resumed stream skips.
_PREFIX_BLOCK = 1 << 20


class FileStamp(NamedTuple):
    """What ``stat`` says about a file; any write through the file system changes ``ctime``."""

    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class VerifiedFiles:
    """Slice files this node has read whole and found matching their manifest, by path and stamp.

    Thread-safe: readers record and forget entries from worker threads.
    """

    def __init__(self) -> None:
        self._stamps: dict[str, FileStamp] = {}
        self._lock = threading.Lock()

    def matches(self, path: str, stamp: FileStamp) -> bool:
        with self._lock:
            return self._stamps.get(path) == stamp

    def record(self, path: str, stamp: FileStamp) -> None:
        with self._lock:
            self._stamps[path] = stamp

    def forget(self, path: str) -> None:
        with self._lock:
            self._stamps.pop(path, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._stamps)


class SliceReader:
    """The chunks of one slice from ``offset``, for one stream; ``next_chunk`` blocks (run it in a
    thread) and returns ``None`` after the last one. ``close`` releases the file or buffer."""

    def __init__(
        self, dataset: Dataset, index: int, chunk_size: int, offset: int, verified: VerifiedFiles
    ) -> None:
        if chunk_size < 1:
            raise InvalidArgumentError(f"chunk_size must be >= 1, got {chunk_size}")
        self.dataset = dataset
        self.index = index
        self.size = dataset.slice_size(index)  # checks the index
        if not 0 <= offset <= self.size:
            raise OutOfRangeError(
                f"dataset {dataset.name}: offset {offset} outside slice {index} (0..{self.size})"
            )
        self.chunk_size = chunk_size
        self.position = offset
        self._verified = verified
        self._path = str(dataset.slice_path(index))
        self._expected = dataset.slice_sha256(index)
        self._file: IO[bytes] | None = None
        self._digest: hashlib._Hash | None = None
        self._memory: memoryview | None = None
        #: True when the slice was hashed whole before its first chunk (first serve, or it changed).
        self.checked_first = False

    def open(self) -> None:
        """Check the slice whole unless this very file passed before; blocking."""
        try:
            file = open(self._path, "rb")  # held for the stream, closed by close()
        except OSError as exc:
            raise DataLossError(
                f"dataset {self.dataset.name}: cannot read slice {self.index}: {exc}"
            ) from None
        stamp = FileStamp.of(os.fstat(file.fileno()))
        if stamp.size == self.size and self._verified.matches(self._path, stamp):
            self._file, self._digest = file, hashlib.sha256()
            return
        # NOTE: the stamp is read from the open file before its bytes, so a change made during the
        # read leaves a stamp that no longer matches the file and the next stream checks again.
        with file:
            data = file.read()
        if len(data) != self.size or hashlib.sha256(data).hexdigest() != self._expected:
            self._verified.forget(self._path)
            raise DataLossError(
                f"dataset {self.dataset.name}: slice {self.index} ({os.path.basename(self._path)}) "
                "fails its sha256 check"
            )
        self._verified.record(self._path, stamp)
        self._memory = memoryview(data)
        self.checked_first = True

    def next_chunk(self) -> bytes | None:
        """The next chunk's bytes, ``None`` when the slice is done; blocking. In streaming mode the
        last chunk is returned only if the whole file hashed to the manifest's sha256."""
        if self.position >= self.size:
            return None
        if self._memory is not None:
            data = bytes(self._memory[self.position : self.position + self.chunk_size])
            self.position += len(data)
            return data
        file, digest = self._file, self._digest
        if file is None or digest is None:
            raise RuntimeError("SliceReader.open() was not called")
        try:
            return self._read_hashed(file, digest)
        except OSError as exc:
            self._fail(f"cannot be read ({exc})")

    def _read_hashed(self, file: IO[bytes], digest: hashlib._Hash) -> bytes:
        if file.tell() < self.position:  # a resumed stream: the skipped bytes are hashed too
            while file.tell() < self.position:
                block = file.read(min(_PREFIX_BLOCK, self.position - file.tell()))
                if not block:
                    self._fail("ends early")
                digest.update(block)
        data = file.read(min(self.chunk_size, self.size - self.position))
        if len(data) != min(self.chunk_size, self.size - self.position):
            self._fail("ends early")
        digest.update(data)
        self.position += len(data)
        if self.position >= self.size and (file.read(1) or digest.hexdigest() != self._expected):
            self._fail("fails its sha256 check")
        return data

    def close(self) -> None:
        file, self._file, self._memory = self._file, None, None
        if file is not None:
            file.close()

    def _fail(self, why: str) -> NoReturn:
        self._verified.forget(self._path)
        self.close()
        raise DataLossError(
            f"dataset {self.dataset.name}: slice {self.index} ({os.path.basename(self._path)}) {why} "
            "while it was streamed; the last chunk was withheld"
        )
