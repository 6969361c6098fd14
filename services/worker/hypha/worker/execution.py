"""One execution as the job manager holds it: how it is re-pointed and reported to the scheduler.

``Execution`` bundles what one run of an executor owns while it lives: its
dispatch and state record (``execution_state``), work dir, plan, GPU slots,
scheduler link, log forwarder, bridge, process and helper tasks. The job
manager creates it on dispatch, re-points it in place when its scheduler
dispatches it again (``is_rewiring``, ``is_reattach``: the process keeps
running), and drops it, after cleanup, into its list of finished executions.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypha import factories
from hypha.market.resources import Resources
from hypha.service import BackgroundTasks
from hypha.v1 import scheduler_pb2
from hypha.worker.bridge import JobBridge
from hypha.worker.execution_state import ExecutionRecord, ExecutionState, JobDispatch
from hypha.worker.executor_profiles import Rewiring
from hypha.worker.executors import ExecutorPlan
from hypha.worker.jobs_config import JobsSection
from hypha.worker.scheduler_link import LogForwarder, SchedulerLink

if TYPE_CHECKING:
    from hypha.worker.warm_executor import Spare

log = logging.getLogger(__name__)

#: Output lines kept to explain a failure (the last stderr line goes into the message).
TAIL_LINES = 20
#: Helper task names the manager and its supervisor treat specially.
PUMP_NAMES = ("stdout", "stderr")
RUNNING_REPORT = "report-running"


def worker_environment(settings: JobsSection) -> dict[str, str]:
    """The part of every executor's environment that is the worker's, not the execution's (a
    warm executor starts with it: ``warm_executor``)."""
    env = {key: os.environ[key] for key in settings.env_passthrough if key in os.environ}
    if settings.hf_endpoint:
        env["HF_ENDPOINT"] = settings.hf_endpoint
    env[factories.ENV_VAR] = factories.to_env(settings.model_factories)
    return env


@dataclass(eq=False)
class Execution:
    dispatch: JobDispatch
    record: ExecutionRecord
    work_dir: Path
    plan: ExecutorPlan
    gpus: list[int]
    threads: int
    link: SchedulerLink
    logs: LogForwarder
    bridge: JobBridge | None = None
    process: asyncio.subprocess.Process | None = None
    #: The warm executor claimed for it (its work dir is the spare's), until it is spawned.
    warm: Spare | None = None
    supervisor: asyncio.Task[None] | None = None
    exchange_open: bool = False
    #: Set when the group leader has exited (the group may still be ending).
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when cleanup is over and the execution left the live set.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    helpers: BackgroundTasks = field(default_factory=BackgroundTasks)
    #: The lease that expired under it while it waits for its scheduler to take it back ("": none).
    orphaned: str = ""
    #: What its lease grants: the memory and disk it is held to (``lease_limits``).
    leased: Resources = field(default_factory=Resources)

    def helper(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``coro`` as one of the execution's helper tasks, named for the job and ``name``."""
        self.helpers.spawn(coro, f"job-{self.dispatch.job_id}-{name}")

    def helper_tasks(self, *suffixes: str) -> list[asyncio.Task[object]]:
        """The live helper tasks whose names end in one of ``suffixes``."""
        return [task for task in self.helpers if task.get_name().endswith(suffixes)]

    def last_stderr(self) -> str:
        return next((line for line in reversed(self.tail) if line.startswith("stderr")), "")

    async def exited_within(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the group leader to exit; whether it did."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.exited.wait()
        except TimeoutError:
            return False
        return True

    def rewire(self, dispatch: JobDispatch) -> None:
        """Re-point the running execution; nothing restarts (see ``is_rewiring``)."""
        running = self.dispatch
        if dispatch.profile.rewiring is Rewiring.PARAMETER_SERVER:
            former = (*running.former_parameter_servers, running.parameter_server_id)
            former = tuple(p for p in dict.fromkeys(former) if p != dispatch.parameter_server_id)
            dispatch = replace(dispatch, former_parameter_servers=former)
            line = f"parameter server restored on {dispatch.parameter_server_id}"
        else:
            line = f"trainers now: {', '.join(dispatch.trainer_ids)}"
        self.dispatch = dispatch
        if self.bridge is not None:
            self.bridge.rewire(dispatch)
        self.logs.line("system", line)

    def reattach(self, dispatch: JobDispatch) -> None:
        """Adopt the new lease (and attempt) of a restarted scheduler; nothing restarts (``is_reattach``)."""
        expired, self.orphaned = self.orphaned, ""
        running = self.dispatch
        if (
            dispatch.parameter_server_id != running.parameter_server_id
            or dispatch.trainer_ids != running.trainer_ids
        ):
            self.rewire(dispatch)  # the server or the trainers changed meanwhile
        else:
            # The restarted scheduler does not know which servers this execution's tensors
            # went to before (a restore it made earlier): the routes to them are kept.
            former = (*running.former_parameter_servers, *dispatch.former_parameter_servers)
            dispatch = replace(dispatch, former_parameter_servers=tuple(dict.fromkeys(former)))
            self.dispatch = dispatch
            if self.bridge is not None:
                self.bridge.ctx.dispatch = dispatch
        line = f"taken back by its scheduler under lease {dispatch.lease_id} (lease {expired} expired)"
        self.logs.line("system", line)
        log.info("job %s (%s) %s", dispatch.job_id, dispatch.executor.value, line)

    def environment(self, settings: JobsSection) -> dict[str, str]:
        """The executor's whole environment: nothing of the worker's but ``env_passthrough``."""
        dispatch = self.dispatch
        worker = worker_environment(settings)
        env = dict(worker)
        threads = str(self.threads)
        env.update(
            {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TMPDIR": str(self.work_dir / "tmp")}
        )
        env.update(self.plan.env)
        assert self.bridge is not None
        env.update(
            {
                "HYPHA_BRIDGE_SOCKET": str(self.bridge.socket_path),
                "HYPHA_WORK_DIR": str(self.work_dir),
                "HYPHA_JOB_ID": dispatch.job_id,
                "HYPHA_EXECUTOR": dispatch.executor.value,
                "HYPHA_TORCH_THREADS": threads,
                "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in self.gpus),
                # After the job's own variables: a task cannot widen the worker's list.
                factories.ENV_VAR: worker[factories.ENV_VAR],
            }
        )
        return env

    async def report(self, report: scheduler_pb2.JobStatusReport, timeout_s: float) -> None:
        """Tell the scheduler, retrying within ``timeout_s``; it also polls GetJobStatus."""
        job_id = self.record.job_id
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    try:
                        await self.link.status(report)
                        return
                    except Exception as err:
                        log.info("job %s: status report failed (%r); retrying", job_id, err)
                        await asyncio.sleep(0.5)
        except TimeoutError:
            log.warning("job %s: could not report %s to its scheduler", job_id, self.record.state.value)

    def status_report(self) -> scheduler_pb2.JobStatusReport:
        record = self.record
        return scheduler_pb2.JobStatusReport(
            job_id=record.job_id,
            state=_REPORT_STATES[record.state],
            exit_code=record.exit_code or 0,
            message=record.message,
            attempt=self.dispatch.attempt,
        )


_REPORT_STATES = {
    ExecutionState.STARTING: scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
    ExecutionState.RUNNING: scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
    ExecutionState.STOPPING: scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
    ExecutionState.SUCCEEDED: scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED,
    ExecutionState.FAILED: scheduler_pb2.EXECUTION_STATE_REPORT_FAILED,
    ExecutionState.CANCELLED: scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED,
    ExecutionState.TIMED_OUT: scheduler_pb2.EXECUTION_STATE_REPORT_TIMED_OUT,
}


def is_rewiring(running: JobDispatch, new: JobDispatch) -> bool:
    """A second dispatch that only re-points a running execution (same lease, scheduler and attempt).

    NOTE: two cases. The scheduler re-dispatches a job's parameter server
    with a new trainer list after it replaced a lost trainer; the executor
    reads the list again from ``GET /v1/job`` when a delta comes from a peer
    it does not know, and adopts the newcomer in the lost trainer's place.
    And it re-dispatches each trainer after it restored the parameter server
    (``docs/fault-tolerance.md``): the bridge abandons the trainer's tensor
    calls to the server in flight, so it asks again (and sends its delta
    again), and routes those for a former server to the new one
    (``JobDispatch.route``). A new attempt is a new execution, never a rewiring.
    """
    if (
        new.lease_id != running.lease_id
        or new.scheduler_id != running.scheduler_id
        or new.attempt != running.attempt
    ):
        return False
    rewiring = new.profile.rewiring
    if rewiring is Rewiring.TRAINERS:
        return new.trainer_ids != running.trainer_ids
    return rewiring is Rewiring.PARAMETER_SERVER and bool(new.parameter_server_id)


def is_reattach(execution: Execution, new: JobDispatch) -> bool:
    """A dispatch that takes back a running DiLoCo execution whose lease expired.

    NOTE: its scheduler was away (restarting) and did not renew the lease; the
    execution kept running for ``reattach_grace_s``. The same scheduler (same
    identity) dispatching the job here again, under whatever lease and attempt
    it now holds, adopts the execution instead of starting a second one: the
    trainer keeps its inner optimizer and data, the server its θ_global.
    """
    running = execution.dispatch
    return (
        bool(execution.orphaned)
        and execution.record.state is ExecutionState.RUNNING
        and new.profile.reattachable
        and new.scheduler_id == running.scheduler_id
    )


__all__ = [
    "PUMP_NAMES",
    "RUNNING_REPORT",
    "TAIL_LINES",
    "Execution",
    "is_reattach",
    "is_rewiring",
]
