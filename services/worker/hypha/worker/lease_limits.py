"""Each job held to the memory and disk its lease grants: a watchdog per execution.

A lease sells a job ``memory_gb`` and ``storage_gb``, but nothing in the
operating system holds the job to them: a task that allocates 20 GB takes the
whole worker (its container) down with it. A cgroup per job would bound it
exactly (``memory.max``), but a worker in an unprivileged container or a
Kubernetes pod under the restricted policy cannot create cgroups, so the
worker measures instead: every ``memory_poll_s`` the resident memory of the
job's process group (``process_group.group_rss``), every ``disk_poll_s`` the
disk its work dir takes (``work_dir_bytes``, in a thread). A job over either
bound is killed at once (SIGKILL to its group, no grace period in which to
grow further) and fails with what it used (``StopCause.OVER_LEASE``); the
worker and its other jobs go on.

The bound is what the job's lease grants (``Execution.leased``); a lease that
names no memory gets ``default_memory_gb``, none at all leaves it unbounded,
and a lease that names no storage leaves the disk unbounded.

NOTE: what polling cannot do. A spike shorter than a poll passes unseen (and
an allocation fast enough can meet the kernel's OOM killer first); RSS counts
a page shared by several processes once per process, so the sum can only
overstate; memory held outside the processes (files in a tmpfs, the page
cache) is not counted as memory; a process that left the group (``setsid``)
is not counted; what is written between two disk polls can go past the bound
(each file's size is capped where the executor is launched, RLIMIT_FSIZE).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from hypha.market.resources import Resources
from hypha.worker.process_group import group_rss
from hypha.worker.resources import GIB

#: Bytes ``st_blocks`` counts in (POSIX: 512 whatever the file system's block size).
_BLOCK_BYTES = 512


@dataclass(frozen=True)
class Bound:
    """One quantity a job is held to, and how to say it went over."""

    what: str  #: "memory", "disk in its work dir"
    limit_bytes: int
    #: Who granted the limit, for the message: "its lease grants (memory_gb)".
    granted_by: str

    def breach(self, used_bytes: int) -> str | None:
        """Why the job must stop, when ``used_bytes`` is over the limit; None while it is within."""
        if used_bytes <= self.limit_bytes:
            return None
        return (
            f"used {used_bytes / GIB:.3f} GB of {self.what}, "
            f"over the {self.limit_bytes / GIB:.3f} GB {self.granted_by}"
        )


@dataclass(frozen=True)
class LeaseBounds:
    """The job's memory and disk bounds; None: that one is unbounded."""

    memory: Bound | None = None
    disk: Bound | None = None


def lease_bounds(leased: Resources, default_memory_gb: float | None) -> LeaseBounds:
    """The bounds a lease sets; a quantity the lease does not name (0) is unbounded."""
    memory = None
    if leased.memory_gb > 0:
        memory = Bound("memory", int(leased.memory_gb * GIB), "its lease grants (memory_gb)")
    elif default_memory_gb is not None:
        memory = Bound(
            "memory",
            int(default_memory_gb * GIB),
            "worker.jobs.default_memory_gb grants a job whose lease names no memory_gb",
        )
    disk = None
    if leased.storage_gb > 0:
        disk = Bound("disk in its work dir", int(leased.storage_gb * GIB), "its lease grants (storage_gb)")
    return LeaseBounds(memory, disk)


def work_dir_bytes(root: Path) -> int:
    """Disk taken by the files under ``root``, as ``du`` counts it.

    Allocated blocks, not sizes (a sparse file takes what it wrote); each
    file once however many hard links it has; links are not followed. A
    directory the job made unreadable (it owns it under the worker's uid) is
    opened up again, so ``chmod 000`` hides nothing; what vanishes during the
    walk is skipped.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    pending = [os.fspath(root)]
    while pending:
        directory = pending.pop()
        for entry in _entries(directory):
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                pending.append(entry.path)
            key = (info.st_dev, info.st_ino)
            if info.st_nlink > 1:
                if key in seen:
                    continue
                seen.add(key)
            total += info.st_blocks * _BLOCK_BYTES
    return total


def _entries(directory: str) -> list[os.DirEntry[str]]:
    for attempt in range(2):
        try:
            with os.scandir(directory) as listing:
                return list(listing)
        except PermissionError:
            if attempt == 0:
                with contextlib.suppress(OSError):
                    os.chmod(directory, stat.S_IRWXU | os.stat(directory, follow_symlinks=False).st_mode)
        except OSError:
            break
    return []


async def watch_lease(
    bounds: Callable[[], LeaseBounds],
    pgid: int,
    work_dir: Path,
    exited_within: Callable[[float], Awaitable[bool]],
    *,
    memory_poll_s: float,
    disk_poll_s: float,
) -> str | None:
    """Measure the job until it exits; why to stop it when it goes over a bound, None if it exited first.

    ``bounds`` is asked again at every poll: a job taken back under a new
    lease is held to that one. Memory and disk are watched side by side, so a
    long walk of a big work dir does not delay a memory poll.
    """
    watches = [
        asyncio.create_task(
            _poll(lambda: bounds().memory, lambda: group_rss(pgid), memory_poll_s, exited_within)
        ),
        asyncio.create_task(
            _poll(lambda: bounds().disk, lambda: work_dir_bytes(work_dir), disk_poll_s, exited_within)
        ),
    ]
    try:
        for finished in asyncio.as_completed(watches):
            if (reason := await finished) is not None:
                return reason
        return None
    finally:
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)


async def _poll(
    bound_of: Callable[[], Bound | None],
    measure: Callable[[], int],
    every_s: float,
    exited_within: Callable[[float], Awaitable[bool]],
) -> str | None:
    while True:
        bound = bound_of()
        if bound is not None:
            reason = bound.breach(await asyncio.to_thread(measure))
            if reason is not None:
                return reason
        if await exited_within(every_s):
            return None


__all__ = ["Bound", "LeaseBounds", "lease_bounds", "watch_lease", "work_dir_bytes"]
