"""Reads that never wait for the disk: the page cache's bytes on the caller's thread, or nothing.

A thread hop cost 0.2-0.3 ms on a 2-core VM, more than copying a 1 MiB block
that is already in memory (docs/performance.md, "Slices without thread hops"),
so the data node's slice streams and the worker's pulls of a published tensor
file read on the event loop with ``preadv2(RWF_NOWAIT)``, which returns at once
from the page cache and refuses (EAGAIN) when it would have to wait for the
disk; only then does the read go to a worker thread.
"""

from __future__ import annotations

import errno
import os

#: ``RWF_NOWAIT`` where the platform has it (Linux 4.14+); cleared for good the first time a
#: file system refuses the flag, after which every read goes to a thread.
_nowait: dict[str, bool] = {"supported": hasattr(os, "preadv") and hasattr(os, "RWF_NOWAIT")}


def read_cached(fd: int, size: int, offset: int) -> bytearray | None:
    """``size`` bytes of ``fd`` at ``offset`` if the page cache holds them all, else None: read
    them in a thread then (a short read, partly cached or past the end, is None too, and the
    blocking read tells which). Other ``OSError``s are the caller's."""
    if not _nowait["supported"]:
        return None
    data = bytearray(size)
    try:
        got = os.preadv(fd, [data], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            _nowait["supported"] = False  # this file system (or kernel) has no RWF_NOWAIT
            return None
        raise
    return data if got == size else None


__all__ = ["read_cached"]
