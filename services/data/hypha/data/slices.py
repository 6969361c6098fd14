"""Reading one slice for one stream: checked before its first byte leaves, as it goes, or trusted.

Every slice a reader receives is checked by that reader against the
manifest's sha256 (``ChunkAssembler``, ``SliceFetcher``): corrupt bytes are
never used, whatever the node does. The node's own check is there so that it
stops serving a slice that rotted, says so (``refused_corrupt``, an error in
its log) and does not make every reader pay for the failed download. It
costs a sha256 pass over every byte served, which on a small data node was
as much CPU as the transfer itself (docs/performance.md), so the node checks
a file three ways:

- the first time it serves the file, or after the file changed (another
  inode, size, mtime or ctime): the whole slice is read and hashed before its
  first chunk leaves, so a slice rewritten or replaced badly is refused with
  ``DATA_LOSS`` and not one of its bytes is sent;
- within ``trust_s`` of the last check of the unchanged file: sent without
  hashing (the readers' check guards it, as HDFS's clients guard blocks between
  its data nodes' scans);
- later: hashed as it is read and sent, one chunk ahead of the wire; the last
  chunk (the one carrying the sha256) is withheld when the bytes no longer
  match, the stream ends in ``DATA_LOSS`` and the file is checked whole again
  before it is next served. A match renews the trust.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
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
    """Slice files that matched their manifest, by path: the stamp they had and when they matched.

    ``trust_s``: how long after a check an unchanged file is served without hashing.
    Thread-safe: readers record and forget entries from worker threads.
    """

    def __init__(self, trust_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        if trust_s < 0:
            raise InvalidArgumentError(f"trust_s must be >= 0, got {trust_s}")
        self.trust_s = trust_s
        self._clock = clock
        self._checks: dict[str, tuple[FileStamp, float]] = {}
        self._lock = threading.Lock()

    def standing(self, path: str, stamp: FileStamp) -> str:
        """``"trusted"``, ``"known"`` (matched before, trust lapsed) or ``"unknown"`` (never, or changed)."""
        with self._lock:
            check = self._checks.get(path)
        if check is None or check[0] != stamp:
            return "unknown"
        return "trusted" if self._clock() - check[1] < self.trust_s else "known"

    def record(self, path: str, stamp: FileStamp) -> None:
        with self._lock:
            self._checks[path] = (stamp, self._clock())

    def forget(self, path: str) -> None:
        with self._lock:
            self._checks.pop(path, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._checks)


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
        self._stamp: FileStamp | None = None
        self._digest: hashlib._Hash | None = None
        self._memory: memoryview | None = None
        #: How this stream is checked: "whole" (before the first chunk), "hashed" (as it is
        #: sent) or "trusted" (checked within trust_s, unchanged since); set by ``open``.
        self.mode = ""

    def open(self) -> None:
        """Check the slice whole unless this very file matched before; blocking."""
        try:
            file = open(self._path, "rb")  # held for the stream, closed by close()
        except OSError as exc:
            raise DataLossError(
                f"dataset {self.dataset.name}: cannot read slice {self.index}: {exc}"
            ) from None
        stamp = FileStamp.of(os.fstat(file.fileno()))
        standing = self._verified.standing(self._path, stamp) if stamp.size == self.size else "unknown"
        if standing != "unknown":
            self._file, self._stamp = file, stamp
            self.mode = "trusted" if standing == "trusted" else "hashed"
            if self.mode == "hashed":
                self._digest = hashlib.sha256()
            else:
                file.seek(self.position)
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
        self.mode = "whole"

    def next_chunk(self) -> bytes | None:
        """The next chunk's bytes, ``None`` when the slice is done; blocking. Hashed as it goes,
        the last chunk is returned only if the whole file hashed to the manifest's sha256."""
        if self.position >= self.size:
            return None
        if self._memory is not None:
            data = bytes(self._memory[self.position : self.position + self.chunk_size])
            self.position += len(data)
            return data
        if self._file is None:
            raise RuntimeError("SliceReader.open() was not called")
        try:
            return self._read(self._file)
        except OSError as exc:
            self._fail(f"cannot be read ({exc})")

    def close(self) -> None:
        file, self._file, self._memory = self._file, None, None
        if file is not None:
            file.close()

    def _read(self, file: IO[bytes]) -> bytes:
        digest = self._digest
        if digest is not None and file.tell() < self.position:
            # A resumed stream: the bytes it skips are hashed too.
            while file.tell() < self.position:
                block = file.read(min(_PREFIX_BLOCK, self.position - file.tell()))
                if not block:
                    self._fail("ends early")
                digest.update(block)
        want = min(self.chunk_size, self.size - self.position)
        data = file.read(want)
        if len(data) != want:
            self._fail("ends early")
        self.position += len(data)
        if digest is not None:
            digest.update(data)
            if self.position >= self.size:
                if file.read(1) or digest.hexdigest() != self._expected:
                    self._fail("fails its sha256 check")
                assert self._stamp is not None
                self._verified.record(self._path, self._stamp)  # matched again: trusted anew
        return data

    def _fail(self, why: str) -> NoReturn:
        self._verified.forget(self._path)
        self.close()
        raise DataLossError(
            f"dataset {self.dataset.name}: slice {self.index} ({os.path.basename(self._path)}) {why} "
            "while it was streamed; the last chunk was withheld"
        )
