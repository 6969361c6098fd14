"""``hypha-worker probe --machine``: what this machine offers a worker, before any config exists.

An operator choosing ``worker.jobs.sandbox`` (or a deployment's readiness
check) wants to know which sandbox works here and why the others do not:
the same probes ``sandbox.resolve`` runs at start, and the capacity
``resources`` would detect.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from hypha.errors import ConfigError
from hypha.worker import resources
from hypha.worker.sandbox import landlock_abi, probe_bwrap, resolve


def describe(work_dir: Path = Path(".")) -> dict[str, Any]:
    """The sandbox ``auto`` picks (or why none works), Landlock's ABI, bubblewrap, detected resources."""
    report: dict[str, Any] = {}
    try:
        report["sandbox"] = resolve("auto").mode
    except ConfigError as err:
        report["sandbox"] = None
        report["sandbox_error"] = err.message
    report["landlock_abi"] = landlock_abi()
    if report["sandbox"] == "bwrap":
        report["bwrap"] = "works"
    else:
        bwrap = shutil.which("bwrap")
        report["bwrap"] = (probe_bwrap(bwrap) or "works") if bwrap else "bubblewrap (bwrap) is not installed"
    gpus, gpu_memory_gb = resources.detect_gpus()
    report.update(
        cpu=resources.detect_cpu(),
        memory_gb=round(resources.detect_memory_gb(), 2),
        storage_gb=round(resources.detect_storage_gb(work_dir), 2),
        gpus=gpus,
        gpu_memory_gb=round(gpu_memory_gb, 2),
    )
    return report


__all__ = ["describe"]
