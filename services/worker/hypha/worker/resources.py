"""What this machine can sell: detected capacity, then config overrides and caps.

Detection is best effort and cheap: CPU cores from the process's affinity
mask (a container limited to 2 of 64 cores sells 2), memory from
``/proc/meminfo``, disk from the file system that holds the work dir, GPUs
and their memory from ``torch.cuda``. A value set in ``[worker.resources]``
replaces detection for that field (so nothing is probed for it), and
``[worker.max_resources]`` caps what is left, e.g. to keep a core for the OS.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from hypha.market.resources import Resources

log = logging.getLogger(__name__)

GIB = 1024**3
_FIELDS = ("cpu", "memory_gb", "storage_gb", "gpu", "gpu_memory_gb")


@dataclass(frozen=True)
class ResourceLimits:
    """Per-field values, ``None`` meaning "not set" (detect / no cap)."""

    cpu: float | None = None
    memory_gb: float | None = None
    storage_gb: float | None = None
    gpu: float | None = None
    gpu_memory_gb: float | None = None

    def get(self, name: str) -> float | None:
        value: float | None = getattr(self, name)
        return value


def detect_cpu() -> float:
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return float(os.cpu_count() or 1)


def detect_memory_gb(meminfo: Path = Path("/proc/meminfo")) -> float:
    """Total memory (not "available": leases are about capacity, and jobs own their use)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except (OSError, ValueError, IndexError):
        log.warning("cannot read %s; memory counts as 0 unless set in [worker.resources]", meminfo)
    return 0.0


def detect_storage_gb(work_dir: Path) -> float:
    """Free space where jobs will write; the nearest existing parent when the dir is new."""
    path = work_dir.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free / GIB
    except OSError:
        log.warning("cannot stat %s; storage counts as 0 unless set in [worker.resources]", path)
        return 0.0


def _gpu_driver_present() -> bool:
    # NOTE: importing torch costs seconds and much memory; skip it where no GPU
    # driver can exist (no NVIDIA or ROCm device node), unless it is loaded anyway.
    if "torch" in sys.modules:
        return True
    return any(
        Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd")
    )


def detect_gpus() -> tuple[float, float]:
    """(GPU count, total GPU memory in GB) through torch.cuda, or (0, 0)."""
    if not _gpu_driver_present() or importlib.util.find_spec("torch") is None:
        return 0.0, 0.0
    try:
        import torch

        if not torch.cuda.is_available():
            return 0.0, 0.0
        count = torch.cuda.device_count()
        memory = sum(torch.cuda.get_device_properties(i).total_memory for i in range(count))
        return float(count), memory / GIB
    except Exception as err:  # a broken driver must not stop the worker
        log.warning("GPU detection failed (%r); GPUs count as 0 unless set in [worker.resources]", err)
        return 0.0, 0.0


def detect(work_dir: Path, overrides: ResourceLimits = ResourceLimits()) -> Resources:
    """Detect every field that ``overrides`` leaves unset."""
    values: dict[str, float] = {}
    if overrides.cpu is None:
        values["cpu"] = detect_cpu()
    if overrides.memory_gb is None:
        values["memory_gb"] = detect_memory_gb()
    if overrides.storage_gb is None:
        values["storage_gb"] = detect_storage_gb(work_dir)
    if overrides.gpu is None or overrides.gpu_memory_gb is None:
        values["gpu"], values["gpu_memory_gb"] = detect_gpus()
    for name in _FIELDS:
        value = overrides.get(name)
        if value is not None:
            values[name] = value
    return Resources(**values)


def capacity(work_dir: Path, overrides: ResourceLimits, caps: ResourceLimits) -> Resources:
    """What the worker sells: detected or overridden values, each capped."""
    found = detect(work_dir, overrides)
    capped = {}
    for name in _FIELDS:
        value: float = getattr(found, name)
        cap = caps.get(name)
        capped[name] = value if cap is None else min(value, cap)
    result = Resources(**capped).require_non_negative("worker capacity")
    log.info("capacity: %s", result)
    return result
