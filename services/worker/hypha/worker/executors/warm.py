"""``python -P -m hypha.worker.executors.warm``: a spare executor process with torch imported.

The worker starts it ahead of any job (``hypha.worker.warm_executor``), through
the same launcher and sandbox as every executor, and it waits. When a
built-in executor starts, the worker writes one JSON line to its stdin:
``{"module": ..., "env": {...}, "max_file_bytes": N | null}``; this process
takes that environment as its own, moves into the work dir it names (its own
dir, renamed: the sandbox's rules followed it), caps its file size at the
storage lease and runs the module as ``__main__``, exactly as ``python -m``
would have. An empty stdin (the worker retired it) ends it.

What is imported ahead must not read the environment at import time in a way
that matters later: torch reads its thread counts when told
(``configure_process``) and CUDA's devices when CUDA starts, and tempfile's
directory is forgotten below so the job's ``TMPDIR`` applies.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import runpy
import sys
import tempfile

from hypha.worker.confine import make_non_dumpable

#: The first bytes on stdout (``hypha.worker.warm_executor.READY``, which checks them).
READY = b"hypha-warm-executor: confined\n"

#: What a spare imports while it waits: the heavy part of every built-in executor's start.
WARM_IMPORTS = (
    "torch",
    "transformers",
    "hypha.worker.executors.diloco_trainer",
    "hypha.worker.executors.parameter_server",
    "hypha.worker.executors.inference",
)


def become(order: dict[str, object]) -> None:
    """Take the execution's environment, work dir and file-size cap; then run its module."""
    module, env, max_file_bytes = order["module"], order["env"], order.get("max_file_bytes")
    if not isinstance(module, str) or not isinstance(env, dict):
        raise SystemExit(f"warm executor: malformed order {sorted(order)}")
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    tempfile.tempdir = None
    os.chdir(os.environ["HYPHA_WORK_DIR"])
    if isinstance(max_file_bytes, int):
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    sys.argv = [module]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    make_non_dumpable()
    # The launcher confined this process before it ran us: the worker may hand our dir on now.
    os.write(sys.stdout.fileno(), READY)
    for name in WARM_IMPORTS:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line.strip():
        return  # retired before it was needed
    become(json.loads(line))


if __name__ == "__main__":
    main()
