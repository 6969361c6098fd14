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

A trusted or whole-checked stream's next chunk is usually in memory or in the
page cache: ``read_now`` takes it on the caller's thread (``preadv2`` with
``RWF_NOWAIT`` never waits for the disk) and says when it cannot, so the
servicer only hands a read to a worker thread when it would block or hash.
A thread hop cost 0.2-0.3 ms on a 2-core VM, more than copying a cached
1 MiB chunk (docs/performance.md, "Slices without thread hops").
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import IO, NoReturn

from hypha.datasets.format import Dataset
from hypha.errors import DataLossError, InvalidArgumentError, OutOfRangeError
from hypha.filestamp import FileStamp
from hypha.pagecache import read_cached

log = logging.getLogger(__name__)

#: Bytes read per call while hashing the part of a slice a resumed stream skips.
_PREFIX_BLOCK = 1 << 20


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

    def trusted(self, path: str) -> bool:
        """Whether ``path`` matched within ``trust_s``, whatever its stamp is now (``standing``
        says whether that stamp still holds)."""
        with self._lock:
            check = self._checks.get(path)
        return check is not None and self._clock() - check[1] < self.trust_s

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

    @property
    def known(self) -> bool:
        """Whether this path matched within ``trust_s``: its inode is cached, so ``open`` without
        the whole check does not wait for the disk."""
        return self._verified.trusted(self._path)

    def open(self, *, check_whole: bool = True) -> bool:
        """Check the slice whole unless this very file matched before; blocking. With
        ``check_whole=False`` a file that needs the whole check is left closed and False
        returned (the caller runs ``open()`` in a thread then); True once open."""
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
            return True
        if not check_whole:
            file.close()
            return False
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
        return True

    @property
    def done(self) -> bool:
        return self.position >= self.size

    def next_chunk(self) -> bytes | bytearray | None:
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
            if self._digest is None:
                return self._pread()
            return self._read(self._file)
        except OSError as exc:
            self._fail(f"cannot be read ({exc})")

    def read_now(self) -> bytes | bytearray | None:
        """The next chunk if it can be had without waiting for the disk or hashing it, else ``None``
        (``next_chunk`` in a thread then). Never call it once ``done``."""
        if self._memory is not None:
            return self.next_chunk()
        if self._digest is not None or self._file is None:
            return None
        want = min(self.chunk_size, self.size - self.position)
        try:
            data = read_cached(self._file.fileno(), want, self.position)
        except OSError as exc:
            self._fail(f"cannot be read ({exc})")
        if data is not None:  # else not all in the page cache: a thread waits for the disk
            self.position += want
        return data

    def _pread(self) -> bytearray:
        """A trusted stream's next chunk, read at its offset (no file position is kept)."""
        assert self._file is not None
        want = min(self.chunk_size, self.size - self.position)
        data = bytearray(want)
        if os.preadv(self._file.fileno(), [data], self.position) != want:
            self._fail("ends early")
        self.position += want
        return data

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
