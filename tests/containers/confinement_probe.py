"""A client's task job that tries what a confined job must not do, and reports what happened.

Shipped to a compose worker by tests/containers/test_confinement.py and run
there under the worker's sandbox (standard library only: it runs inside the
worker image). argv[1] is a JSON object of targets found from outside:
``keys`` (key files to try by name, whether or not a walk finds them) and
``foreign`` (files of another job on this worker). It writes its findings to
``out/probe.json`` (the job's output) and prints them. Each outcome is "ok" or
the errno's name (``EACCES``, ``EPERM``, ...).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATE_DIR = Path("/var/lib/hypha")


def outcome(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as err:
        return errno.errorcode.get(err.errno or 0, str(err))
    return "ok"


def read(path: str) -> Callable[[], bytes]:
    def go() -> bytes:
        with open(path, "rb") as handle:
            return handle.read(1)

    return go


def create(directory: str) -> str:
    """Whether a new file can be made in ``directory`` (removed again when it could)."""
    path = os.path.join(directory, f".hypha-probe-{os.getpid()}")
    result = outcome(lambda: os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)))
    if result == "ok":
        os.unlink(path)
    return result


def walk_for_keys() -> list[str]:
    """Every ``*-key.pem`` a walk of / (but /proc and /sys) can see; unlistable dirs are skipped."""
    seen = []
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
        seen += [os.path.join(root, name) for name in files if name.endswith("-key.pem")]
    return seen


def worker_pids() -> list[int]:
    """Pids whose command line is ``.../hypha-worker run ...`` (a /proc scan: cmdline is public)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"/hypha-worker") for arg in argv) and b"run" in argv:
            found.append(int(entry))
    return found


def main() -> None:
    targets: dict[str, list[str]] = json.loads(sys.argv[1])
    cwd = Path.cwd()
    pids = worker_pids()
    keys = sorted({*walk_for_keys(), *targets["keys"]})
    # The same keys through a process's root link: the worker's and PID 1's view of the disk.
    through_proc = [f"/proc/{pid}/root{key}" for pid in [*pids, 1] for key in targets["keys"]]
    report: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "uid": os.getuid(),
        "cwd": str(cwd),
        "keys_seen": keys,
        "keys": {path: outcome(read(path)) for path in keys + through_proc},
        "worker_pids": pids,
        "kill": {str(pid): outcome(lambda pid=pid: os.kill(pid, 0)) for pid in [*pids, 1]},
        "environ": {str(pid): outcome(read(f"/proc/{pid}/environ")) for pid in [*pids, 1]},
        "list": {
            path: outcome(lambda path=path: os.listdir(path))
            for path in (str(STATE_DIR), str(cwd.parent), str(STATE_DIR / "work" / "results"), "/pool")
        },
        "foreign": {path: outcome(read(path)) for path in targets["foreign"]},
        "create": {path: create(path) for path in ("/tmp", str(STATE_DIR), "/models", str(cwd.parent))},
        # What a job must still be able to do: the controls that keep the above honest.
        "own_dir": create(str(cwd)),
        "own_status": outcome(read("/proc/self/status")),
    }
    out = cwd / "out"
    out.mkdir(exist_ok=True)
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
