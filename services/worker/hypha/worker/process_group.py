"""An executor's process group: start it, read its output, end all of it.

Each execution runs as the leader of a new process group (``setsid``), so the
group is the unit of cleanup: when the leader exits, whatever it left behind
(a data loader worker, a shell's children) is found in ``/proc`` and ended,
politely first when the job is being stopped, with SIGKILL otherwise.

NOTE: a grandchild that calls setsid() itself leaves the group and is out of
reach of the group signals (a cgroup per job would close that hole); in the
bubblewrap sandbox it still dies with the sandbox's PID namespace.

Executors die with their worker (``sandbox``: bubblewrap's
``--die-with-parent``, and in every mode the parent-death signal the launcher
``confine`` sets). What escaped anyway, a process of a worker that was
SIGKILLed before that existed or a grandchild outside the sandbox, is found at
the next start by the work dir its environment names (``orphans``) and killed
before resources are offered.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from hypha.net.backoff import Backoff

_READ_BLOCK = 1 << 16
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
#: ``rss`` (field 24 of /proc/PID/stat, in pages), counted from the field after the command name.
_RSS_FIELD = 21


async def spawn_group_leader(
    argv: Sequence[str], cwd: Path, env: Mapping[str, str], stdin: int = asyncio.subprocess.DEVNULL
) -> tuple[asyncio.subprocess.Process, int, int]:
    """Start ``argv`` as a new process group's leader; (process, stdout fd, stderr fd) to read.

    NOTE: our own pipes, not asyncio's: in Python 3.11 Process.wait() also waits
    for every pipe to close, so a grandchild holding stdout would hide the
    leader's exit. The caller owns (and must close or pump) the two read ends.
    """
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=dict(env),
            stdin=stdin,
            stdout=out_write,
            stderr=err_write,
            start_new_session=True,
        )
    except BaseException:
        os.close(out_read)
        os.close(err_read)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    return process, out_read, err_read


async def pump_lines(fd: int, max_line_bytes: int, emit: Callable[[bytes], None]) -> None:
    """Hand ``emit`` each line read from ``fd`` until every writer (the whole group) closed it.

    A line longer than ``max_line_bytes`` is cut into pieces of that size;
    ``fd`` is closed at the end.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_READ_BLOCK * 4)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    pending = b""
    try:
        while data := await reader.read(_READ_BLOCK):
            pending += data
            *lines, pending = pending.split(b"\n")
            while len(pending) > max_line_bytes:  # a line without end: cut it
                lines.append(pending[:max_line_bytes])
                pending = pending[max_line_bytes:]
            for line in lines:
                emit(line)
        if pending:
            emit(pending)
    finally:
        transport.close()


async def end_group(pgid: int, *, grace_s: float | None) -> int:
    """End what is left of a group whose leader has exited; the number of processes killed.

    With ``grace_s`` the group gets SIGTERM and that long to exit before
    SIGKILL; without it, SIGKILL at once.
    """
    members = await asyncio.to_thread(group_members, pgid)
    if members and grace_s is not None:
        signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        pause = Backoff(0.02, 0.2)
        while members and time.monotonic() < deadline:
            await asyncio.sleep(pause.next_delay())  # no exit notification exists for a grandchild
            members = await asyncio.to_thread(group_members, pgid)
    if members:
        signal_group(pgid, signal.SIGKILL)
    return len(members)


def signal_group(pgid: int, sig: signal.Signals, *, spare_leader: bool = False) -> None:
    """Send ``sig`` to every process of the group; a group that is gone is not an error.

    ``spare_leader``: the leader is a sandbox's wrapper (bubblewrap), which
    would die of SIGTERM at once and take the sandbox with it; the executor
    inside gets the signal and its whole grace period, and the wrapper exits
    with it.
    """
    if not spare_leader:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        return
    for pid in group_members(pgid):
        if pid != pgid:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    return [pid for pid, state, group, _ in _proc_entries() if group == pgid and state not in ("Z", "X")]


def group_rss(pgid: int) -> int:
    """Bytes resident of a process group: each live member's RSS, summed.

    NOTE: from the same one read of ``/proc/PID/stat`` per process that finds
    the group's members, so watching a job's memory costs one /proc scan. A
    page shared between members (fork's copy-on-write, shared memory) counts
    once per process that maps it: the sum can only overstate.
    """
    pages = sum(rss for _, state, group, rss in _proc_entries() if group == pgid and state not in ("Z", "X"))
    return pages * _PAGE_BYTES


def orphans(jobs_dir: Path) -> list[int]:
    """Processes (not this one) whose ``HYPHA_WORK_DIR`` lies under ``jobs_dir``: a previous run's executors.

    NOTE: the environment a process started with is what ``/proc/PID/environ``
    shows; an executor can change its own copy but only to hide itself, not to
    make the worker kill someone else's process (it names a work dir of ours).
    """
    prefix = b"HYPHA_WORK_DIR=" + os.fsencode(jobs_dir) + b"/"
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if any(item.startswith(prefix) for item in environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def kill_orphans(jobs_dir: Path) -> list[int]:
    """SIGKILL every ``orphans`` process; the pids found."""
    found = orphans(jobs_dir)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


def _proc_entries() -> Iterator[tuple[int, str, int, int]]:
    """(pid, state, process group, resident pages) of every process, from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > _RSS_FIELD:
            yield int(entry.name), fields[0], int(fields[2]), int(fields[_RSS_FIELD])


__all__ = [
    "end_group",
    "group_members",
    "group_rss",
    "kill_orphans",
    "orphans",
    "pump_lines",
    "signal_group",
    "spawn_group_leader",
]
