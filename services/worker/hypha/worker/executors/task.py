"""The ``task`` executor: any command, run as the job's own process.

Unlike the DiLoCo executors there is no Python program in between: the job
manager starts the command itself (argv, never a shell) in the job's work
dir, with the job's environment on top of the worker's executor
environment and the GPU slots it assigned in ``CUDA_VISIBLE_DEVICES``. The
process is the leader of its own process group, so a cancel or timeout ends
the whole tree. It succeeds by exit code 0 or, when the spec names a
completion marker, by that file existing (a marker that appears while the
task still runs ends it as succeeded after a grace period, for commands
that never exit on their own).
"""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath

from hypha.errors import InvalidArgumentError
from hypha.v1 import common_pb2

log = logging.getLogger(__name__)

#: Variables a job's env cannot set: they are the worker's promises to the executor.
PROTECTED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "HYPHA_BRIDGE_SOCKET",
        "HYPHA_WORK_DIR",
        "HYPHA_JOB_ID",
        "HYPHA_EXECUTOR",
        "HYPHA_TORCH_THREADS",
    }
)


def task_argv(spec: common_pb2.TaskJobSpec) -> list[str]:
    if not spec.command:
        raise InvalidArgumentError("task job without a command")
    return [spec.command, *spec.args]


def task_env(spec: common_pb2.TaskJobSpec) -> dict[str, str]:
    """The job's own variables, minus those the worker controls (logged, not fatal)."""
    env: dict[str, str] = {}
    for key, value in spec.env.items():
        if key in PROTECTED_ENV:
            log.warning("task env %s is set by the worker; the job's value is ignored", key)
            continue
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidArgumentError(f"task env variable {key!r} is malformed")
        env[key] = value
    return env


def marker_path(spec: common_pb2.TaskJobSpec, work_dir: Path) -> Path | None:
    """The completion marker, which must stay inside the work dir."""
    if not spec.completion_marker:
        return None
    relative = PurePosixPath(spec.completion_marker)
    if relative.is_absolute() or ".." in relative.parts:
        raise InvalidArgumentError(
            f"completion marker {spec.completion_marker!r} must be a relative path inside the work dir"
        )
    return work_dir / relative


def task_timeout(spec: common_pb2.TaskJobSpec, default_s: float | None, cap_s: float | None) -> float | None:
    """The job's timeout, else the worker's default; never above the worker's cap."""
    timeout = spec.timeout_s if spec.timeout_s > 0 else default_s
    if cap_s is not None:
        timeout = cap_s if timeout is None else min(timeout, cap_s)
    return timeout
