"""What ``stat`` says of a file's content without reading it: the one test of "unchanged".

Two places skip a hash they took before when a file has not changed since: the
data node serving a slice it checked (``hypha.data.slices``) and a worker
serving a published tensor file to every pull (``hypha.worker.tensor_files``).
Both ask the same question the same way, so it lives here. Any write through
the file system moves ``ctime`` and a replacement changes the inode; a write
within one tick of the kernel's coarse clock may leave both unchanged, which is
why the readers at the other end check the sha256 they are sent in any case.
"""

from __future__ import annotations

import os
from typing import NamedTuple


class FileStamp(NamedTuple):
    """A file's inode, size, mtime and ctime (nanoseconds)."""

    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


__all__ = ["FileStamp"]
