"""Which ``JobRun`` drives each job kind, and what else a kind's run can do (scale).

The core's kind table (``hypha.jobfile.kinds``) says what a kind *is*; this
is the scheduler's side of it, kept apart because the core imports no role.
The orchestrator asks here, never which kind a job or run is: a new kind is
one entry below plus its run module.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hypha.bundles import BUNDLES_DIR, BundleStore
from hypha.errors import FailedPreconditionError
from hypha.jobfile.kinds import DILOCO, INFERENCE, TASK, job_kind
from hypha.scheduler.diloco import elastic
from hypha.scheduler.diloco.round_planner import PlannerFactory
from hypha.scheduler.diloco.run import DilocoRun
from hypha.scheduler.inference_job import InferenceRun
from hypha.scheduler.providers import DatasetProviders
from hypha.scheduler.records import JobRecord
from hypha.scheduler.runs import JobRun, RunRegistry
from hypha.scheduler.task_job import TaskRun


@dataclass(frozen=True)
class RunContext:
    """What the orchestrator holds that a kind's run may need."""

    runs: RunRegistry
    planners: PlannerFactory
    providers: DatasetProviders | None
    state_dir: Path


@dataclass(frozen=True)
class RunKind:
    """The scheduler's side of one job kind."""

    #: The run that drives a job of the kind from PENDING to its end.
    start: Callable[[JobRecord, RunContext], JobRun]
    #: Grows or shrinks a running job to a trainer count (None: its jobs do not scale).
    scale: Callable[[JobRun, int], Awaitable[None]] | None = None


def _diloco_run(job: JobRecord, ctx: RunContext) -> JobRun:
    return DilocoRun(job, ctx.runs, ctx.planners, ctx.providers, ctx.state_dir)


def _scale_diloco(run: JobRun, workers: int) -> Awaitable[None]:
    if not isinstance(run, DilocoRun):
        raise FailedPreconditionError(f"job {run.job_id} is not driven by a DiLoCo run")
    return elastic.scale(run, workers)


RUN_KINDS: Mapping[str, RunKind] = {
    DILOCO.name: RunKind(start=_diloco_run, scale=_scale_diloco),
    TASK.name: RunKind(
        start=lambda job, ctx: TaskRun(job, ctx.runs, BundleStore(ctx.state_dir / BUNDLES_DIR), ctx.state_dir)
    ),
    INFERENCE.name: RunKind(start=lambda job, ctx: InferenceRun(job, ctx.runs, ctx.providers, ctx.state_dir)),
}


def run_kind(name: str) -> RunKind:
    """The scheduler's side of the kind ``name`` (InvalidArgumentError for an unknown one)."""
    job_kind(name)  # the core names the valid kinds
    return RUN_KINDS[name]


def scaling_kinds() -> str:
    """The kinds whose jobs scale, as a message lists them ("DiLoCo")."""
    return ", ".join(job_kind(name).title for name, kind in RUN_KINDS.items() if kind.scale is not None)


__all__ = ["RUN_KINDS", "RunContext", "RunKind", "run_kind", "scaling_kinds"]
