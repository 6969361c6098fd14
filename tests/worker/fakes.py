"""Fakes and builders shared by the worker's job tests: a scheduler link that records, dispatches."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2, scheduler_pb2
from hypha.worker.execution_state import JobDispatch
from hypha.worker.process_group import orphans

PYTHON = sys.executable


class FakeSchedulerLink:
    """Records every job-control call; answers progress with a fixed directive."""

    def __init__(
        self,
        directive: scheduler_pb2.Directive | None = None,
        slices: Sequence[scheduler_pb2.NextSliceResponse] = (),
        reply: Callable[[scheduler_pb2.ProgressReport], scheduler_pb2.Directive] | None = None,
    ) -> None:
        self.directive = directive or scheduler_pb2.Directive(kind=scheduler_pb2.DIRECTIVE_KIND_CONTINUE)
        self.reply = reply
        self.slices = list(slices)
        self.progress_reports: list[scheduler_pb2.ProgressReport] = []
        self.slice_requests: list[scheduler_pb2.NextSliceRequest] = []
        self.metrics_reports: list[scheduler_pb2.MetricsReport] = []
        self.log_lines: list[scheduler_pb2.LogLine] = []
        self.statuses: list[scheduler_pb2.JobStatusReport] = []
        self.closed = False

    async def progress(self, report: scheduler_pb2.ProgressReport) -> scheduler_pb2.Directive:
        self.progress_reports.append(report)
        return self.reply(report) if self.reply is not None else self.directive

    async def next_slice(self, request: scheduler_pb2.NextSliceRequest) -> scheduler_pb2.NextSliceResponse:
        self.slice_requests.append(request)
        if self.slices:
            return self.slices.pop(0)
        return scheduler_pb2.NextSliceResponse(available=False)

    async def metrics(self, report: scheduler_pb2.MetricsReport) -> None:
        self.metrics_reports.append(report)

    async def logs(self, lines: Sequence[scheduler_pb2.LogLine]) -> None:
        self.log_lines.extend(lines)

    async def status(self, report: scheduler_pb2.JobStatusReport) -> None:
        self.statuses.append(report)

    async def close(self) -> None:
        self.closed = True

    def lines(self, stream: str | None = None) -> list[str]:
        return [entry.line for entry in self.log_lines if stream is None or entry.stream == stream]


def task_dispatch(
    job_id: str,
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 0.0,
    marker: str = "",
    gpus: int = 0,
    cpu: float = 0.0,
    lease_id: str = "lease-1",
    scheduler_id: str = "scheduler-1",
) -> JobDispatch:
    spec = common_pb2.JobSpec(
        name=job_id,
        task=common_pb2.TaskJobSpec(
            command=argv[0],
            args=list(argv[1:]),
            env=env or {},
            timeout_s=timeout_s,
            completion_marker=marker,
            gpus=gpus,
            requirements=common_pb2.Requirements(minimum=common_pb2.Resources(cpu=cpu)),
        ),
    )
    return JobDispatch(job_id, lease_id, ExecutorKind.TASK, spec, scheduler_id)


def python_task(job_id: str, code: str, **kwargs: object) -> JobDispatch:
    return task_dispatch(job_id, [PYTHON, "-c", code], **kwargs)  # type: ignore[arg-type]


def job_processes(work_root: Path) -> list[int]:
    """Live processes of any job under ``work_root``, as the host sees them (sandbox or not)."""
    return [pid for pid in orphans(work_root / "jobs") if pid_alive(pid)]


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie has ended; only its entry is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"
