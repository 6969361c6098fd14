"""What a worker runs for each executor kind: the plan the job manager turns into a process.

``diloco-trainer``, ``parameter-server`` and ``inference`` are Python programs of this
package, run with the worker's own interpreter; ``task`` runs the job's
command directly (``executors.task``). Operators may replace a built-in
program's command (``executor_commands`` in the jobs settings), e.g. to run
it inside a container or another virtualenv.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2
from hypha.worker.executor_profiles import PROFILES
from hypha.worker.executors import task

#: The module each built-in executor runs as (``python -m MODULE``; its executor profile names it).
BUILTIN_MODULES: dict[ExecutorKind, str] = {kind: p.module for kind, p in PROFILES.items() if p.module}


@dataclass(frozen=True)
class ExecutorPlan:
    """How to start one executor process."""

    argv: list[str]
    #: Variables from the job itself, applied over the worker's executor environment.
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    #: Success means this file exists (task jobs that configure one).
    marker: Path | None = None


def plan(
    kind: ExecutorKind,
    spec: common_pb2.JobSpec,
    work_dir: Path,
    *,
    commands: Mapping[str, Sequence[str]] | None = None,
    default_timeout_s: float | None = None,
    max_timeout_s: float | None = None,
) -> ExecutorPlan:
    if kind is ExecutorKind.TASK:
        return ExecutorPlan(
            argv=task.task_argv(spec.task),
            env=task.task_env(spec.task),
            timeout_s=task.task_timeout(spec.task, default_timeout_s, max_timeout_s),
            marker=task.marker_path(spec.task, work_dir),
        )
    override = (commands or {}).get(kind.value)
    argv = list(override) if override else [sys.executable, "-m", BUILTIN_MODULES[kind]]
    return ExecutorPlan(argv=argv, env={"PYTHONUNBUFFERED": "1"}, timeout_s=max_timeout_s)


__all__ = ["BUILTIN_MODULES", "ExecutorPlan", "plan"]
