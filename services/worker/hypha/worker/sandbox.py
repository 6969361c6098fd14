"""Where an executor runs: a bubblewrap sandbox that shows it only its own work dir, or nothing.

A job is code from whoever holds a client certificate; it must not become
the worker. In ``bwrap`` mode (bubblewrap, from the distribution's packages)
each executor gets its own user, mount, PID, IPC and UTS namespaces and a
root file system that holds only

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
capabilities. The network is shared: executors reach peers only through
their bridge, but task jobs may need it.

``none`` runs the executor as the worker's user with the worker's view of the
disk; it must be chosen explicitly. ``auto`` takes bubblewrap when it works
here and otherwise refuses to start, so a missing package never silently
turns the sandbox off.

Both modes make executors die with their worker: bubblewrap's
``--die-with-parent``, and ``setpriv --pdeathsig KILL`` without it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hypha.errors import ConfigError, NotFoundError
from hypha.worker.jobs_config import SandboxMode

log = logging.getLogger(__name__)

#: The uid/gid an executor has inside the sandbox ("nobody"): no capabilities, owns nothing.
SANDBOX_ID = 65534
#: Top-level system directories bound read-only (or recreated as the symlinks they are).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
#: What of /etc a program needs: users, name resolution, TLS roots, the linker's cache, time zone.
_ETC_FILES = (
    "passwd",
    "group",
    "hosts",
    "resolv.conf",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "ssl",
    "ca-certificates",
    "pki",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "alternatives",
    "mime.types",
    "os-release",
)
_PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Sandbox:
    """A resolved mode and how to wrap an executor's command line with it."""

    mode: Literal["bwrap", "none"]
    #: The bubblewrap (``bwrap`` mode) or setpriv (``none`` mode, when present) binary.
    tool: str | None = None
    #: Extra read-only paths (the operator's ``sandbox_paths``).
    readonly: tuple[Path, ...] = ()
    #: Paths that must stay out of sight even when they lie under a bound path.
    hidden: tuple[Path, ...] = ()
    devices: tuple[Path, ...] = field(default_factory=lambda: tuple(_gpu_devices()))

    def wrap(self, argv: Sequence[str], work_dir: Path, search_path: str | None = None) -> list[str]:
        """The command line that runs ``argv`` (in ``work_dir``) under this sandbox.

        A command that does not exist is refused here (NotFoundError), so it
        fails to start rather than becoming the wrapper's exit status.
        """
        if not argv:
            raise NotFoundError("no command to run")
        command = argv[0] if "/" not in argv[0] else str(work_dir / argv[0])  # (absolute stays absolute)
        if shutil.which(command, path=search_path) is None:
            raise NotFoundError(f"no such command: {argv[0]}")
        if self.mode == "none":
            prefix = [self.tool, "--pdeathsig", "KILL", "--"] if self.tool else []
            return [*prefix, *argv]
        assert self.tool is not None
        return [self.tool, *bwrap_args(work_dir, self.readonly, self.hidden, self.devices), "--", *argv]

    @property
    def wrapper_leads(self) -> bool:
        """Whether the process group's leader is the wrapper, not the executor (see ``signal_group``)."""
        return self.mode == "bwrap"

    def environment(self, env: dict[str, str], work_dir: Path) -> dict[str, str]:
        """The executor's environment adjusted to what it can see (its home is its work dir)."""
        if self.mode == "bwrap":
            return {**env, "HOME": str(work_dir)}
        return env


def resolve(requested: SandboxMode, *, readonly: Iterable[Path] = (), hidden: Iterable[Path] = ()) -> Sandbox:
    """The sandbox for ``requested``; ConfigError when it cannot work on this machine.

    Blocking (it runs bubblewrap once to see that namespaces work here): call it in a thread.
    """
    extra = tuple(Path(p) for p in readonly)
    hide = tuple(Path(p) for p in hidden)
    if requested == "none":
        log.warning("executor sandbox: none (jobs run as this worker's user and can read its files)")
        return Sandbox("none", shutil.which("setpriv"), extra, hide)
    bwrap = shutil.which("bwrap")
    problem = _probe(bwrap) if bwrap else "bubblewrap (bwrap) is not installed"
    if problem is None:
        assert bwrap is not None
        log.info("executor sandbox: bwrap (%s)", bwrap)
        return Sandbox("bwrap", bwrap, extra, hide)
    raise ConfigError(
        f"worker.jobs.sandbox = {requested!r}: no sandbox works here ({problem}); install bubblewrap "
        "(apt-get install bubblewrap) or set worker.jobs.sandbox = 'none' to run jobs unconfined"
    )


def bwrap_args(
    work_dir: Path, readonly: Sequence[Path], hidden: Sequence[Path], devices: Sequence[Path]
) -> list[str]:
    """bubblewrap's options: namespaces, the read-only system, the work dir, masks, devices.

    NOTE: no ``--new-session``: the worker already starts the sandbox in a
    session of its own with no terminal, and a second one would take the job
    out of the process group through which it is stopped and killed.
    """
    args = [
        "--die-with-parent",
        "--unshare-all",
        "--share-net",
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
    for name in _SYSTEM_DIRS:
        path = Path(name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            args += ["--ro-bind", name, name]
            bound.append(path)
    for name in _ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    args += ["--ro-bind-try", "/sys", "/sys"]
    for path in _python_paths() + [Path(p).absolute() for p in readonly]:
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


def _python_paths() -> list[Path]:
    """The interpreter's installation, the environment and every import path, outermost first."""
    candidates = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent]
    candidates += [Path(entry) for entry in sys.path if entry and Path(entry).is_absolute()]
    kept: list[Path] = []
    for path in sorted({p.resolve() for p in candidates}, key=lambda p: len(p.parts)):
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def _gpu_devices() -> list[Path]:
    dev = Path("/dev")
    return sorted(dev.glob("nvidia*")) + ([dev / "dri"] if (dev / "dri").is_dir() else [])


def _probe(bwrap: str) -> str | None:
    """Why bubblewrap cannot sandbox here (no user namespaces, a seccomp profile…), or None."""
    argv = [bwrap, *bwrap_args(Path("/tmp"), (), (), ()), "--", sys.executable, "-c", "pass"]
    try:
        result = subprocess.run(argv, capture_output=True, timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap did not run: {err}"
    if result.returncode != 0:
        return f"bwrap failed: {result.stderr.decode(errors='replace').strip()[:200]}"
    return None


__all__ = ["SANDBOX_ID", "Sandbox", "SandboxMode", "bwrap_args", "resolve"]
