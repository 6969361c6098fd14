"""What of the host an executor may use, in every sandbox: one list, so bwrap and Landlock agree.

bubblewrap binds these paths into an otherwise empty root; Landlock grants
read (and execute) access beneath them. Landlock cannot take a subtree back
out of a grant, so ``exposed`` finds the worker's own files that a grant
would show, for ``sandbox.resolve`` to refuse.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

#: Top-level system directories bound read-only (or recreated as the symlinks they are).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
#: What of /etc a program needs: users, name resolution, TLS roots, the linker's cache, time zone.
ETC_FILES = (
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
#: Device files every program may open read-write (bubblewrap's ``--dev`` makes the same).
BASIC_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
#: Shared memory: torch's data loaders and NCCL pass tensors through it.
SHARED_MEMORY = "/dev/shm"


def python_paths() -> list[Path]:
    """The interpreter's installation, the environment and every import path, outermost first."""
    candidates = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable).resolve().parent]
    candidates += [Path(entry) for entry in sys.path if entry and Path(entry).is_absolute()]
    kept: list[Path] = []
    for path in sorted({p.resolve() for p in candidates}, key=lambda p: len(p.parts)):
        if not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def gpu_devices() -> list[Path]:
    dev = Path("/dev")
    return sorted(dev.glob("nvidia*")) + ([dev / "dri"] if (dev / "dri").is_dir() else [])


def landlock_readable(readonly: Iterable[Path]) -> list[Path]:
    """Every path a Landlock-confined executor may read beneath (that exists), operator's included."""
    paths = [Path(name) for name in SYSTEM_DIRS]
    paths += [Path("/etc", name) for name in ETC_FILES]
    paths += [Path("/proc"), Path("/sys"), *python_paths(), *(Path(p).absolute() for p in readonly)]
    kept: list[Path] = []
    for path in paths:
        if path.exists() and path not in kept:
            kept.append(path)
    return kept


def exposed(hidden: Iterable[Path], granted: Sequence[Path]) -> list[tuple[Path, Path]]:
    """(hidden path, the grant it lies beneath) for each hidden path a grant would show.

    Both sides are compared resolved, so a symlink on either side does not
    hide the overlap.
    """
    grants = [(g, g.resolve()) for g in granted]
    found: list[tuple[Path, Path]] = []
    for path in dict.fromkeys(Path(p) for p in hidden):
        real = path.resolve()
        for grant, real_grant in grants:
            if real.is_relative_to(real_grant):
                found.append((path, grant))
                break
    return found


__all__ = [
    "BASIC_DEVICES",
    "ETC_FILES",
    "SHARED_MEMORY",
    "SYSTEM_DIRS",
    "exposed",
    "gpu_devices",
    "landlock_readable",
    "python_paths",
]
