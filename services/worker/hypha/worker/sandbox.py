"""Where an executor runs: a bubblewrap sandbox, a Landlock sandbox, or unconfined.

A job is code from whoever holds a client certificate; it must not become
the worker. Every executor starts through the launcher ``confine`` (``python
-P -m hypha.worker.confine``), which makes it the OOM killer's first choice,
caps its file size at its storage lease, forbids core dumps and makes it die
with its worker. The modes differ in what the job can reach:

``bwrap`` (bubblewrap, from the distribution's packages) gives each executor
its own user, mount, PID, IPC and UTS namespaces and a root file system that
holds only

- the job's work dir (read-write: its bridge socket, tmp/, fetched files),
- the Python environment the worker runs (``sys.prefix``, ``sys.base_prefix``,
  every ``sys.path`` entry) and the system's ``/usr`` (read-only),
- a few files of ``/etc`` (name resolution, TLS roots, the dynamic linker's cache),
  a fresh ``/proc``, a minimal ``/dev``, a private ``/tmp``, and ``/dev/nvidia*``
  when the machine has them,
- whatever the operator adds (``sandbox_paths``).

The worker's key, certificates, config, state dir and other jobs' work dirs
are simply not there; anything of theirs that lies under a path that is
bound is covered with an empty tmpfs. Inside, the job is uid 65534 with no
capabilities. Task jobs share the host's network; the bridge-only executors
(trainer, parameter server, inference) get a network namespace of their own.

``landlock`` confines the executor with a Landlock ruleset (Linux ≥ 5.13)
instead (``confine``): the same paths are readable (``sandbox_paths``: the
system dirs, the Python environment, the /etc files, /proc, /sys, the
operator's paths), the work dir and /dev/shm writable, the basic and GPU
devices usable, and nothing else, the worker's files and /tmp included. The
job keeps the worker's user but no capability; it cannot ptrace the worker
or read its /proc files, nor signal it (ABI ≥ 6), and a bridge-only executor
opens no TCP socket (ABI ≥ 4). Landlock needs no namespaces, no capabilities
and no custom seccomp profile, so it works inside a container under Docker's
default profile and Kubernetes' ``restricted`` policy (RuntimeDefault),
where bubblewrap cannot create user namespaces. (The alternatives need what
those forbid: a uid per job needs CAP_SETUID, a seccomp profile admitting
user namespaces must be installed on every host.) Landlock cannot carve a
subtree out of a grant, so a worker whose own files lie beneath a granted
path refuses to start (``resolve``): keys in the current dir of a node
started without ``python -P``, or under /opt, say.

``none`` runs the executor as the worker's user with the worker's view of the
disk (only the worker's /proc files stay closed: it is non-dumpable,
``confine.make_non_dumpable``); it must be chosen explicitly. ``auto`` takes bubblewrap when it works
here, else Landlock, and otherwise refuses to start, so a missing package or
kernel feature never silently turns the sandbox off.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hypha.errors import ConfigError, NotFoundError
from hypha.worker.jobs_config import SandboxMode
from hypha.worker.sandbox_paths import (
    BASIC_DEVICES,
    ETC_FILES,
    SHARED_MEMORY,
    SYSTEM_DIRS,
    exposed,
    gpu_devices,
    landlock_readable,
    python_paths,
)

log = logging.getLogger(__name__)

#: The uid/gid an executor has inside the sandbox ("nobody"): no capabilities, owns nothing.
SANDBOX_ID = 65534
_PROBE_TIMEOUT_S = 10.0


def launcher() -> list[str]:
    """The launcher's command line (``confine``); ``-P``: a job's work dir, the cwd, never shadows it."""
    return [sys.executable, "-P", "-m", "hypha.worker.confine"]


@dataclass(frozen=True)
class Sandbox:
    """A resolved mode and how to wrap an executor's command line with it."""

    mode: Literal["bwrap", "landlock", "none"]
    #: The bubblewrap binary (``bwrap`` mode).
    tool: str | None = None
    #: Extra read-only paths (the operator's ``sandbox_paths``).
    readonly: tuple[Path, ...] = ()
    #: Paths that must stay out of sight even when they lie under a bound path.
    hidden: tuple[Path, ...] = ()
    devices: tuple[Path, ...] = field(default_factory=lambda: tuple(gpu_devices()))

    def wrap(
        self,
        argv: Sequence[str],
        work_dir: Path,
        search_path: str | None = None,
        *,
        network: bool,
        max_file_bytes: int | None = None,
    ) -> list[str]:
        """The command line that runs ``argv`` (in ``work_dir``) under this sandbox.

        ``network``: whether the executor may use the network itself (task
        jobs) or only its bridge; ``max_file_bytes``: the largest file it may
        write (its storage lease). A command that does not exist is refused
        here (NotFoundError), so it fails to start rather than becoming the
        wrapper's exit status.
        """
        if not argv:
            raise NotFoundError("no command to run")
        command = argv[0] if "/" not in argv[0] else str(work_dir / argv[0])  # (absolute stays absolute)
        if shutil.which(command, path=search_path) is None:
            raise NotFoundError(f"no such command: {argv[0]}")
        confine = launcher()
        if max_file_bytes is not None:
            confine += ["--max-file-bytes", str(max_file_bytes)]
        if self.mode == "bwrap":
            assert self.tool is not None
            args = bwrap_args(work_dir, self.readonly, self.hidden, self.devices, network=network)
            return [self.tool, *args, "--", *confine, "--", *argv]
        confine += ["--parent", str(os.getpid())]
        if self.mode == "landlock":
            confine += landlock_args(work_dir, self.readonly, self.devices, network=network)
        return [*confine, "--", *argv]

    @property
    def wrapper_leads(self) -> bool:
        """Whether the process group's leader is the wrapper, not the executor (see ``signal_group``)."""
        return self.mode == "bwrap"

    def environment(self, env: dict[str, str], work_dir: Path) -> dict[str, str]:
        """The executor's environment adjusted to what it can reach (its home is its work dir)."""
        if self.mode in ("bwrap", "landlock"):
            return {**env, "HOME": str(work_dir)}
        return env


def resolve(requested: SandboxMode, *, readonly: Iterable[Path] = (), hidden: Iterable[Path] = ()) -> Sandbox:
    """The sandbox for ``requested``; ConfigError when it cannot work on this machine.

    Blocking (it runs bubblewrap and the launcher once to see that they work here): call it in a thread.
    """
    extra = tuple(Path(p) for p in readonly)
    hide = tuple(Path(p) for p in hidden)
    if requested == "none":
        log.warning("executor sandbox: none (jobs run as this worker's user and can read its files)")
        return Sandbox("none", None, extra, hide)
    bwrap_problem = ""
    if requested in ("auto", "bwrap"):
        bwrap = shutil.which("bwrap")
        problem = probe_bwrap(bwrap) if bwrap else "bubblewrap (bwrap) is not installed"
        if problem is None:
            assert bwrap is not None
            log.info("executor sandbox: bwrap (%s)", bwrap)
            return Sandbox("bwrap", bwrap, extra, hide)
        if requested == "bwrap":
            raise ConfigError(
                f"worker.jobs.sandbox = 'bwrap': bubblewrap cannot sandbox here ({problem}); install "
                "bubblewrap (apt-get install bubblewrap) where user namespaces are allowed, or set "
                "worker.jobs.sandbox = 'landlock' ('auto': whichever works), or worker.jobs.sandbox = "
                "'none' to run jobs unconfined"
            )
        bwrap_problem = problem
    problem = probe_landlock(extra)
    if problem is not None:
        raise ConfigError(
            f"worker.jobs.sandbox = {requested!r}: no sandbox works here ("
            + (f"bubblewrap: {bwrap_problem}; " if bwrap_problem else "")
            + f"Landlock: {problem}); install bubblewrap (apt-get install bubblewrap) where user "
            "namespaces are allowed, or run on a kernel with Landlock (Linux 5.13+, in the lsm= list), "
            "or set worker.jobs.sandbox = 'none' to run jobs unconfined"
        )
    sandbox = Sandbox("landlock", None, extra, hide)
    check_landlock_grants(sandbox)
    abi = landlock_abi() or 0
    log.info("executor sandbox: landlock (Landlock ABI %d)", abi)
    if abi < 4:
        log.warning("Landlock ABI %d < 4: bridge-only executors can open TCP connections", abi)
    if abi < 6:
        log.warning("Landlock ABI %d < 6: executors can signal this worker's user's processes", abi)
    return sandbox


def landlock_args(
    work_dir: Path, readonly: Sequence[Path], devices: Sequence[Path], *, network: bool
) -> list[str]:
    """The launcher's options for ``landlock`` mode: what the ruleset grants (``confine``)."""
    args = ["--landlock", "--rw", str(work_dir), "--rw", SHARED_MEMORY]
    for path in landlock_readable(readonly):
        args += ["--ro", str(path)]
    for device in [*BASIC_DEVICES, *map(str, devices)]:
        args += ["--dev", device]
    return args if network else [*args, "--no-tcp"]


def check_landlock_grants(sandbox: Sandbox) -> None:
    """ConfigError naming each of the worker's own files a Landlock grant would show a job."""
    granted = [*landlock_readable(sandbox.readonly), Path(SHARED_MEMORY), *sandbox.devices]
    found = exposed(sandbox.hidden, granted)
    if found:
        listed = "; ".join(f"{path} lies beneath {grant}" for path, grant in found)
        raise ConfigError(
            f"worker.jobs.sandbox = 'landlock': jobs could read this worker's own files ({listed}): "
            "Landlock cannot hide a path beneath one it grants (the system dirs, the Python "
            "environment and its import paths, worker.jobs.sandbox_paths); move them elsewhere "
            "(e.g. the key and state dir out of the current dir and /opt), or use bubblewrap "
            "(worker.jobs.sandbox = 'bwrap')"
        )


def landlock_abi() -> int | None:
    """The kernel's Landlock ABI version (0: none), or None without the landlockpy package."""
    try:
        import landlockpy
    except ImportError:
        return None
    return int(landlockpy.abi_version())


def bwrap_args(
    work_dir: Path,
    readonly: Sequence[Path],
    hidden: Sequence[Path],
    devices: Sequence[Path],
    *,
    network: bool = True,
) -> list[str]:
    """bubblewrap's options: namespaces, the read-only system, the work dir, masks, devices.

    NOTE: no ``--new-session``: the worker already starts the sandbox in a
    session of its own with no terminal, and a second one would take the job
    out of the process group through which it is stopped and killed.
    """
    args = [
        "--die-with-parent",
        "--unshare-all",
        *(["--share-net"] if network else []),
        "--unshare-user",
        "--uid",
        str(SANDBOX_ID),
        "--gid",
        str(SANDBOX_ID),
        # First, so that binds below /tmp (a test's work dir, an operator's path) land on it.
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
    ]
    bound: list[Path] = []
    for name in SYSTEM_DIRS:
        path = Path(name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            args += ["--ro-bind", name, name]
            bound.append(path)
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--ro-bind-try", "/sys", "/sys"]
    for path in python_paths() + [Path(p).absolute() for p in readonly]:
        if path.exists() and not any(path.is_relative_to(b) for b in bound):
            args += ["--ro-bind", str(path), str(path)]
            bound.append(path)
    for device in devices:
        args += ["--dev-bind-try", str(device), str(device)]
    for path in hidden:
        if any(path.is_relative_to(b) for b in bound):
            args += ["--tmpfs", str(path)] if path.is_dir() else ["--ro-bind", "/dev/null", str(path)]
    args += ["--bind", str(work_dir), str(work_dir), "--chdir", str(work_dir)]
    return args


def probe_bwrap(bwrap: str) -> str | None:
    """Why bubblewrap cannot sandbox here (no user namespaces, a seccomp profile…), or None."""
    args = bwrap_args(Path("/tmp"), (), (), (), network=False)
    return _probe([bwrap, *args, "--", *launcher(), "--", sys.executable, "-c", "pass"], "bwrap")


def probe_landlock(readonly: Sequence[Path] = ()) -> str | None:
    """Why the launcher cannot enforce a Landlock ruleset here (old kernel, disabled…), or None."""
    with tempfile.TemporaryDirectory(prefix="hypha-landlock-probe-") as tmp:
        confine = [*launcher(), *landlock_args(Path(tmp), readonly, (), network=False)]
        return _probe([*confine, "--", sys.executable, "-c", "pass"], "the Landlock launcher", cwd=tmp)


def _probe(argv: list[str], what: str, cwd: str | None = None) -> str | None:
    try:
        result = subprocess.run(argv, capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"{what} did not run: {err}"
    if result.returncode != 0:
        return f"{what} failed: {result.stderr.decode(errors='replace').strip()[:300]}"
    return None


__all__ = ["SANDBOX_ID", "Sandbox", "SandboxMode", "bwrap_args", "landlock_args", "launcher", "resolve"]
