"""``python -P -m hypha.worker.confine [OPTIONS] -- ARGV``: the launcher every executor starts through.

The worker cannot change a child between fork and exec from asyncio, so each
executor's command line starts with this launcher (``sandbox.Sandbox.wrap``).
It restricts its own process and then ``execvp``s ARGV: the job replaces the
launcher (same pid), so the process group the worker signals and the
environment ``process_group.orphans`` looks for stay the job's. In every mode:

- ``oom_score_adj`` 1000: when memory runs out the kernel kills a job, never
  the worker that holds every other job's state;
- no core dumps (a job's memory stays its own), and ``RLIMIT_FSIZE`` at
  ``--max-file-bytes`` (the storage the job leased) so one file cannot fill the
  disk every job shares;
- SIGKILL when the parent dies (``PR_SET_PDEATHSIG``), checked against a parent
  that died before it was armed: a job never outlives a SIGKILLed worker.

``--landlock`` adds a Landlock ruleset (kernel ≥ 5.13, no privilege, no
namespaces): every file-system right the kernel's ABI knows is handled, and
granted back only beneath ``--rw`` (everything), ``--ro`` (read, execute) and
``--dev`` (read, write, ioctl) paths; from ABI 6 signals and abstract Unix
sockets are scoped to the job's own domain (and from ABI 1 Landlock forbids
ptrace attach to processes outside it); ``--no-tcp`` (ABI 4) leaves TCP bind
and connect handled with no rule, i.e. no TCP at all. Every capability is
dropped too, so a worker run as root hands none on: with CAP_SYS_PTRACE a
landlocked job was measured to read the worker's ``/proc/PID/environ``
anyway. (Unconfined, same-user jobs are kept out of those files by the worker
being non-dumpable, ``make_non_dumpable``.) It fails closed: a ruleset that
cannot be enforced ends the launcher (exit ``EXIT_CONFINE``) and nothing runs.

NOTE: only the standard library and ``landlockpy`` (imported only with
``--landlock``): this runs before every job, so it must start fast, and it
takes every path from its command line rather than computing them.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

PROG = "hypha-confine"
#: Exit status when the process could not be confined (nothing was run).
EXIT_CONFINE = 125
#: Exit statuses of a command that cannot be run, as shells use them.
EXIT_NOT_FOUND = 127
EXIT_CANNOT_RUN = 126

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522
#: Landlock ABI that scopes signals and abstract Unix sockets / handles TCP.
SCOPE_ABI = 6
NET_ABI = 4


class ConfineError(Exception):
    """The process cannot be confined as asked; the launcher exits without running anything."""


@dataclass
class Options:
    argv: list[str]
    landlock: bool = False
    no_tcp: bool = False
    rw: list[str] = field(default_factory=list)
    ro: list[str] = field(default_factory=list)
    dev: list[str] = field(default_factory=list)
    max_file_bytes: int | None = None
    #: The pid the parent must still be once the death signal is armed (default: the parent at start).
    parent: int | None = None


_FLAGS = {"--landlock": "landlock", "--no-tcp": "no_tcp"}
_LISTS = {"--rw": "rw", "--ro": "ro", "--dev": "dev"}
_INTS = {"--max-file-bytes": "max_file_bytes", "--parent": "parent"}


def parse(args: Sequence[str]) -> Options:
    """Options up to ``--``, then the command; ConfineError naming what is wrong."""
    options = Options(argv=[])
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            options.argv = list(args[i + 1 :])
            break
        if arg in _FLAGS:
            setattr(options, _FLAGS[arg], True)
        elif arg in _LISTS or arg in _INTS:
            if i + 1 >= len(args):
                raise ConfineError(f"{arg} needs a value")
            value = args[i + 1]
            if arg in _LISTS:
                getattr(options, _LISTS[arg]).append(value)
            else:
                try:
                    setattr(options, _INTS[arg], int(value))
                except ValueError:
                    raise ConfineError(f"{arg} {value!r}: not an integer") from None
            i += 1
        else:
            raise ConfineError(f"unknown option {arg!r} (usage: {PROG} [OPTIONS] -- COMMAND [ARGS])")
        i += 1
    if not options.argv:
        raise ConfineError("no command after '--'")
    return options


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def make_non_dumpable() -> None:
    """Make this process's ``/proc/PID`` files (environ, mem, fd, …) root's and refuse ptrace.

    A job runs as the same user as the worker (and our executors) in every
    mode but bwrap; without this it could read their environment and memory.
    Cleared again by ``execve``, so it must be called by the process it protects.
    """
    _prctl(_PR_SET_DUMPABLE, 0)


def limit_process(max_file_bytes: int | None) -> None:
    """First to be killed by the OOM killer, no core dumps, files no larger than the lease."""
    oom = "/proc/self/oom_score_adj"
    with open(oom, encoding="ascii") as handle:
        already = handle.read().strip() == "1000"
    if not already:  # (set by an outer launcher, whose Landlock domain may keep /proc read-only)
        with open(oom, "w", encoding="ascii") as handle:
            handle.write("1000")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if max_file_bytes is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        limit = max_file_bytes if hard == resource.RLIM_INFINITY else min(max_file_bytes, hard)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; ConfineError if it has died already."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # died before the signal was armed: reparented, nobody would kill us
        raise ConfineError(f"the parent process {parent} is gone")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> None:
    """No capability now or after exec, even for a worker run as root.

    Landlock does not take capabilities away: a root job would keep
    CAP_SYS_PTRACE (with it, a landlocked job read the worker's /proc/PID/environ),
    CAP_SYS_MODULE and the rest. Emptying the bounding set needs CAP_SETPCAP;
    without it there is nothing to empty (no_new_privs, set with the ruleset,
    keeps file capabilities from granting any).
    """
    libc = _libc()
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL: past the last capability; EPERM: not ours to drop
    if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot clear ambient capabilities: {os.strerror(err)}")
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    if libc.capset(ctypes.byref(header), (_CapData * 2)()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot drop capabilities: {os.strerror(err)}")


def apply_landlock(options: Options) -> int:
    """Enforce the ruleset ``options`` describe on this process; the kernel's Landlock ABI."""
    try:
        import landlockpy
        from landlockpy import AccessFS, AccessNet, Ruleset, Scope
    except ImportError as err:
        raise ConfineError(f"Landlock is unavailable: {err} (install landlockpy)") from None
    try:
        abi = landlockpy.abi_version()
    except OSError as err:
        raise ConfineError(f"Landlock is unavailable: {err}") from None
    if abi < 1:
        raise ConfineError(
            "Landlock is unavailable: the kernel is older than 5.13 or it was not enabled at boot (lsm=)"
        )
    handled = landlockpy.fs_for_abi(abi)
    file_rights = handled & (
        AccessFS.EXECUTE | AccessFS.READ_FILE | AccessFS.WRITE_FILE | AccessFS.TRUNCATE | AccessFS.IOCTL_DEV
    )
    read = AccessFS.EXECUTE | AccessFS.READ_FILE | AccessFS.READ_DIR
    device = (
        AccessFS.READ_FILE | AccessFS.WRITE_FILE | AccessFS.TRUNCATE | AccessFS.IOCTL_DEV | AccessFS.READ_DIR
    )
    net = AccessNet.BIND_TCP | AccessNet.CONNECT_TCP if options.no_tcp and abi >= NET_ABI else AccessNet.NONE
    scoped = Scope.SIGNAL | Scope.ABSTRACT_UNIX_SOCKET if abi >= SCOPE_ABI else Scope.NONE
    try:
        with Ruleset(handled_fs=handled, handled_net=net, scoped=scoped, best_effort=False) as ruleset:
            for paths, rights in ((options.rw, handled), (options.ro, read), (options.dev, device)):
                for path in paths:
                    try:
                        is_dir = os.path.isdir(path)
                        ruleset.allow_path(path, (rights & handled) if is_dir else (rights & file_rights))
                    except FileNotFoundError:
                        continue  # nothing there to grant
            ruleset.restrict()
        drop_capabilities()
    except OSError as err:
        raise ConfineError(f"Landlock ruleset not enforced: {err}") from None
    return abi


def confine(options: Options) -> None:
    """Everything but the exec: limits, death signal, Landlock when asked."""
    parent = options.parent if options.parent is not None else os.getppid()
    try:
        limit_process(options.max_file_bytes)
        die_with_parent(parent)
    except (OSError, ValueError) as err:
        raise ConfineError(str(err)) from None
    if options.landlock:
        apply_landlock(options)


def main(args: Sequence[str] | None = None) -> int:
    """Confine this process and exec the command; returns only when that failed."""
    try:
        options = parse(sys.argv[1:] if args is None else args)
        confine(options)
    except ConfineError as err:
        print(f"{PROG}: not started: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFINE
    # Python ignores these two; a program started from a shell expects them at their defaults.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(options.argv[0], options.argv)
    except FileNotFoundError:
        print(f"{PROG}: no such command: {options.argv[0]}", file=sys.stderr, flush=True)
        return EXIT_NOT_FOUND
    except OSError as err:
        print(f"{PROG}: cannot run {options.argv[0]}: {err}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_RUN
    return EXIT_CANNOT_RUN  # not reached: execvp returns only by raising


if __name__ == "__main__":
    raise SystemExit(main())
