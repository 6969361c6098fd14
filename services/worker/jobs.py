"""The job manager: one executor process per dispatched job, from work dir to cleanup.

For each ``DispatchJob`` the manager

1. checks capacity (concurrent jobs, GPU slots) and turns the spec into an
   ``ExecutorPlan`` (``executors``);
2. prepares the job's private work dir (0700; ``jobs/<job>.<executor>``,
   reused by a later attempt of the same job so checkpoints survive a
   restart), opens the job's tensor inboxes and starts its bridge;
3. starts the executor as the leader of a new process group, with the
   bridge socket, a thread count that shares the machine's cores, and the
   assigned GPU slots in ``CUDA_VISIBLE_DEVICES``; stdout and stderr are
   read line by line into the job's log forwarder;
4. supervises it: timeout, completion marker, cancellation (SIGTERM to the
   group, SIGKILL after ``stop_grace_s``), lease expiry;
5. when the leader exits, ends whatever is left of its group, settles the
   final state (``job_state``), reports it to the scheduler, keeps the
   result dir, frees the GPU slots and cleans up the work dir per policy.

NOTE: the group is the unit of cleanup; a grandchild that calls setsid()
leaves it and is out of reach (a cgroup per job would close that hole).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from hypha.errors import (
    AlreadyExistsError,
    HyphaError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from hypha.market.resources import ExecutorKind
from hypha.v1 import scheduler_pb2
from hypha.worker import executors
from hypha.worker.bridge import BridgeContext, JobBridge, SliceSource
from hypha.worker.job_state import ExecutionRecord, ExecutionState, JobDispatch, StopCause
from hypha.worker.jobs_config import JobsSection
from hypha.worker.model_fetch import ResourceFetcher
from hypha.worker.scheduler_link import LogForwarder, LogSink, SchedulerLink
from hypha.worker.transfer import TensorExchange

log = logging.getLogger(__name__)

_READ_BLOCK = 1 << 16
_TAIL_LINES = 20


class GpuSlots:
    """GPU indices handed to executions, each GPU shared by at most ``per_gpu`` of them."""

    def __init__(self, gpu_count: int, per_gpu: int) -> None:
        self.gpu_count = gpu_count
        self.per_gpu = per_gpu
        self._holders: dict[int, set[object]] = {gpu: set() for gpu in range(gpu_count)}

    def acquire(self, count: int, owner: object) -> list[int]:
        """``count`` distinct GPUs with a free slot, least shared first; ResourceExhaustedError if not."""
        if count <= 0:
            return []
        free = [gpu for gpu, holders in self._holders.items() if len(holders) < self.per_gpu]
        if len(free) < count:
            raise ResourceExhaustedError(
                f"{count} GPU(s) wanted, {len(free)} of {self.gpu_count} have a free slot "
                f"(max_jobs_per_gpu={self.per_gpu})"
            )
        chosen = sorted(sorted(free, key=lambda gpu: (len(self._holders[gpu]), gpu))[:count])
        for gpu in chosen:
            self._holders[gpu].add(owner)
        return chosen

    def release(self, owner: object) -> None:
        for holders in self._holders.values():
            holders.discard(owner)

    def in_use(self) -> dict[int, int]:
        return {gpu: len(holders) for gpu, holders in self._holders.items()}


#: Builds the scheduler link of one execution (the dispatching scheduler, by id and addresses).
LinkFactory = Callable[[JobDispatch], SchedulerLink]


@dataclass(eq=False)
class _Execution:
    dispatch: JobDispatch
    record: ExecutionRecord
    work_dir: Path
    plan: executors.ExecutorPlan
    gpus: list[int]
    threads: int
    link: SchedulerLink
    logs: LogForwarder
    bridge: JobBridge | None = None
    process: asyncio.subprocess.Process | None = None
    supervisor: asyncio.Task[None] | None = None
    exchange_open: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    helpers: set[asyncio.Task[None]] = field(default_factory=set)


class JobManager:
    """Runs executions; ``start()``/``stop()`` (idempotent) bracket its life, ``async with`` too."""

    def __init__(
        self,
        settings: JobsSection,
        work_root: Path,
        *,
        exchange: TensorExchange,
        link_factory: LinkFactory,
        worker_id: str = "",
        cpu_count: int | None = None,
        gpu_count: int = 0,
        slices: SliceSource | None = None,
        resources: ResourceFetcher | None = None,
        log_sink: LogSink | None = None,
        clock: Callable[[], float] = time.time,
        max_finished: int = 1000,
    ) -> None:
        self.settings = settings
        self.work_root = Path(work_root)
        self.jobs_dir = self.work_root / "jobs"
        self.results_dir = self.work_root / "results"
        self.exchange = exchange
        self.link_factory = link_factory
        self.worker_id = worker_id
        self.cpu_count = max(1, cpu_count or os.cpu_count() or 1)
        self.gpus = GpuSlots(
            settings.gpus if settings.gpus is not None else gpu_count, settings.max_jobs_per_gpu
        )
        self.slices = slices
        self.resources = resources or ResourceFetcher(settings.hub_settings(self.work_root))
        self.log_sink = log_sink
        self._clock = clock
        self._max_finished = max_finished
        self._active: dict[tuple[str, ExecutorKind], _Execution] = {}
        self._finished: OrderedDict[str, _Execution] = OrderedDict()
        self._accepting = False
        self._stopped = False

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        for folder in (self.work_root, self.jobs_dir, self.results_dir):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o700)
        await asyncio.to_thread(self._sweep)
        self._accepting = True

    async def stop(self, reason: str = "worker shutting down") -> None:
        """Stop intake, stop every execution (grace, then kill), wait for their cleanup."""
        self._accepting = False
        if self._stopped:
            return
        self._stopped = True
        running = list(self._active.values())
        for execution in running:
            self._stop(execution, StopCause.CANCEL, reason)
        bound = self.settings.stop_grace_s + self.settings.status_timeout_s + 10.0
        waits = [execution.done.wait() for execution in running]
        if waits:
            try:
                async with asyncio.timeout(bound):
                    await asyncio.gather(*waits)
            except TimeoutError:
                log.warning("%d job(s) did not finish cleaning up within %.0f s", len(running), bound)

    async def __aenter__(self) -> JobManager:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ---- the API the servicer and the lease side call ------------------------------------

    async def dispatch(self, dispatch: JobDispatch) -> ExecutionRecord:
        """Start an execution; its record is returned once the process runs (or failed to start)."""
        if not self._accepting:
            raise UnavailableError("this worker is not accepting jobs (starting or shutting down)")
        dispatch.validate()
        running = self._active.get(dispatch.key)
        if running is not None:
            if _is_rewiring(running.dispatch, dispatch):
                return self._rewire(running, dispatch)
            raise AlreadyExistsError(f"job {dispatch.job_id} ({dispatch.executor.value}) already runs here")
        if len(self._active) >= self.settings.max_concurrent_jobs:
            raise ResourceExhaustedError(f"{len(self._active)} jobs already run on this worker")
        work_dir = self.jobs_dir / f"{dispatch.job_id}.{dispatch.executor.value}"
        plan = executors.plan(
            dispatch.executor,
            dispatch.spec,
            work_dir,
            commands=self.settings.executor_commands,
            default_timeout_s=self.settings.default_task_timeout_s,
            max_timeout_s=self.settings.max_task_timeout_s,
        )
        requirements = dispatch.requirements().minimum
        wanted_gpus = math.ceil(requirements.gpu)
        if dispatch.executor is ExecutorKind.TASK:
            wanted_gpus = max(wanted_gpus, dispatch.spec.task.gpus)
        gpus = self.gpus.acquire(wanted_gpus, dispatch.key)
        now = self._clock()
        record = ExecutionRecord(
            dispatch.job_id, f"{dispatch.job_id}-{dispatch.attempt}-{uuid.uuid4().hex[:8]}", created_at=now
        )
        link = self.link_factory(dispatch)
        execution = _Execution(
            dispatch=dispatch,
            record=record,
            work_dir=work_dir,
            plan=plan,
            gpus=gpus,
            threads=self._threads(requirements.cpu),
            link=link,
            logs=LogForwarder(
                link,
                dispatch.job_id,
                worker_id=self.worker_id,
                attempt=dispatch.attempt,
                max_pending=self.settings.log_queue_max,
                max_line_bytes=self.settings.max_log_line_bytes,
                sink=self.log_sink,
                clock=self._clock,
            ),
        )
        self._active[dispatch.key] = execution
        execution.logs.start()
        try:
            await self._prepare(execution)
            if not record.state.terminal:
                await self._spawn(execution)
        except Exception as err:
            message = err.message if isinstance(err, HyphaError) else f"{type(err).__name__}: {err}"
            log.warning("job %s failed to start: %s", dispatch.job_id, message)
            if not record.state.terminal:
                record.start_failed(self._clock(), f"failed to start: {message}")
        if record.state.terminal:  # failed to start, or cancelled while starting
            await self._finish(execution)
            return record
        execution.supervisor = asyncio.create_task(
            self._supervise(execution), name=f"job-{dispatch.job_id}-{dispatch.executor.value}"
        )
        return record

    def _rewire(self, execution: _Execution, dispatch: JobDispatch) -> ExecutionRecord:
        """Give a running parameter server its new trainer list; nothing restarts.

        NOTE: the scheduler re-dispatches a job's parameter server (same lease,
        same scheduler) after it replaced a lost trainer; the executor reads
        the list again from ``GET /v1/job`` when a delta comes from a peer it
        does not know, and adopts the newcomer in the lost trainer's place.
        """
        execution.dispatch = dispatch
        if execution.bridge is not None:
            execution.bridge.ctx.dispatch = dispatch
        execution.logs.line("system", f"trainers now: {', '.join(dispatch.trainer_ids)}")
        return execution.record

    async def cancel(self, job_id: str, reason: str, *, scheduler_id: str | None = None) -> bool:
        """Stop every execution of ``job_id`` (only those ``scheduler_id`` dispatched, when given)."""
        hit = False
        for execution in list(self._active.values()):
            dispatch = execution.dispatch
            if dispatch.job_id != job_id:
                continue
            if scheduler_id is not None and dispatch.scheduler_id != scheduler_id:
                continue
            self._stop(execution, StopCause.CANCEL, reason or "cancelled")
            hit = True
        return hit

    async def cancel_jobs_for_lease(self, lease_id: str, reason: str) -> list[str]:
        """The lease side's hook: a lease ended, so every job under it stops. Returns their ids."""
        stopped = []
        for execution in list(self._active.values()):
            if execution.dispatch.lease_id == lease_id:
                self._stop(execution, StopCause.CANCEL, reason or f"lease {lease_id} ended")
                stopped.append(execution.dispatch.job_id)
        return stopped

    def get(self, job_id: str) -> ExecutionRecord:
        """The job's execution here: a live one first, else the latest finished; NotFoundError if none."""
        live = [e.record for e in self._active.values() if e.record.job_id == job_id]
        if live:
            return max(live, key=lambda record: record.created_at)
        done = [e.record for e in self._finished.values() if e.record.job_id == job_id]
        if done:
            return max(done, key=lambda record: record.created_at)
        raise NotFoundError(f"no job {job_id!r} on this worker")

    def records(self) -> list[ExecutionRecord]:
        return [e.record for e in self._active.values()] + [e.record for e in self._finished.values()]

    def active_jobs(self) -> list[JobDispatch]:
        return [e.dispatch for e in self._active.values()]

    def result_dir(self, job_id: str) -> Path | None:
        """Where the job's result is (``/v1/result``), if it named one; see ``result_of``."""
        found = self.result_of(job_id)
        return None if found is None else found[0]

    def result_of(self, job_id: str) -> tuple[Path, str] | None:
        """(result dir, dispatching scheduler id) of the job's newest execution that named a result.

        Live executions are searched too: the final status report (after which
        a scheduler may pull the result) goes out just before an execution
        leaves the live set, and the result is already in its kept place then.
        """
        executions = [*self._active.values(), *reversed(self._finished.values())]
        for execution in executions:
            record = execution.record
            if record.job_id == job_id and record.result_dir and Path(record.result_dir).is_dir():
                return Path(record.result_dir), execution.dispatch.scheduler_id
        return None

    async def wait(self, job_id: str, timeout_s: float | None = None) -> ExecutionRecord:
        """Wait until no execution of ``job_id`` runs; its (latest) record."""
        async with asyncio.timeout(timeout_s):
            for execution in [e for e in self._active.values() if e.dispatch.job_id == job_id]:
                await execution.done.wait()
        return self.get(job_id)

    # ---- preparing and starting -------------------------------------------------------------

    def _threads(self, cpu: float) -> int:
        if self.settings.threads_per_job is not None:
            wanted = self.settings.threads_per_job
        elif cpu > 0:
            wanted = math.ceil(cpu)
        else:
            wanted = self.cpu_count // (len(self._active) + 1)  # this job included
        return max(1, min(self.cpu_count, wanted))

    async def _prepare(self, execution: _Execution) -> None:
        work_dir = execution.work_dir
        await asyncio.to_thread(_make_private_dir, work_dir)
        self.exchange.open_job(execution.dispatch.job_id)
        execution.exchange_open = True
        bridge = JobBridge(
            BridgeContext(
                dispatch=execution.dispatch,
                work_dir=work_dir,
                record=execution.record,
                link=execution.link,
                exchange=self.exchange,
                logs=execution.logs,
                resources=self.resources,
                slices=self.slices,
                limits=self.settings.bridge_limits(),
            )
        )
        await bridge.start()
        execution.bridge = bridge

    def _environment(self, execution: _Execution) -> dict[str, str]:
        dispatch = execution.dispatch
        env = {key: os.environ[key] for key in self.settings.env_passthrough if key in os.environ}
        if self.settings.hf_endpoint:
            env["HF_ENDPOINT"] = self.settings.hf_endpoint
        threads = str(execution.threads)
        env.update(
            {
                "OMP_NUM_THREADS": threads,
                "MKL_NUM_THREADS": threads,
                "TMPDIR": str(execution.work_dir / "tmp"),
            }
        )
        env.update(execution.plan.env)
        assert execution.bridge is not None
        env.update(
            {
                "HYPHA_BRIDGE_SOCKET": str(execution.bridge.socket_path),
                "HYPHA_WORK_DIR": str(execution.work_dir),
                "HYPHA_JOB_ID": dispatch.job_id,
                "HYPHA_EXECUTOR": dispatch.executor.value,
                "HYPHA_TORCH_THREADS": threads,
                "CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for gpu in execution.gpus),
            }
        )
        return env

    async def _spawn(self, execution: _Execution) -> None:
        # NOTE: our own pipes, not asyncio's: in Python 3.11 Process.wait() also waits for
        # every pipe to close, so a grandchild holding stdout would hide the leader's exit.
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *execution.plan.argv,
                cwd=execution.work_dir,
                env=self._environment(execution),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out_write,
                stderr=err_write,
                start_new_session=True,
            )
        except BaseException:
            os.close(out_read)
            os.close(err_read)
            raise
        finally:
            os.close(out_write)
            os.close(err_write)
        execution.process = process
        if execution.record.state.terminal:  # cancelled while the process was being created
            _signal_group(process.pid, signal.SIGKILL)
            await process.wait()
            os.close(out_read)
            os.close(err_read)
            return
        execution.record.spawned(self._clock())
        for fd, stream in ((out_read, "stdout"), (err_read, "stderr")):
            self._helper(execution, self._pump(execution, fd, stream), stream)
        gpus = ",".join(map(str, execution.gpus)) or "none"
        execution.logs.line(
            "system",
            f"started {execution.dispatch.executor.value} (pid {process.pid}, threads {execution.threads}, "
            f"GPUs {gpus})",
        )
        self._helper(execution, self._report(execution, self._status_report(execution)), "report-running")

    def _helper(self, execution: _Execution, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"job-{execution.dispatch.job_id}-{name}")
        execution.helpers.add(task)
        task.add_done_callback(execution.helpers.discard)

    async def _pump(self, execution: _Execution, fd: int, stream: str) -> None:
        """Forward one pipe line by line until every writer (the whole group) closed it."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_READ_BLOCK * 4)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        limit = self.settings.max_log_line_bytes
        pending = b""
        try:
            while data := await reader.read(_READ_BLOCK):
                pending += data
                *lines, pending = pending.split(b"\n")
                while len(pending) > limit:  # a line without end: cut it
                    lines.append(pending[:limit])
                    pending = pending[limit:]
                for line in lines:
                    self._emit(execution, stream, line)
            if pending:
                self._emit(execution, stream, pending)
        finally:
            transport.close()

    def _emit(self, execution: _Execution, stream: str, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        execution.tail.append(f"{stream}: {text}")
        execution.logs.line(stream, text)

    # ---- supervising and stopping ------------------------------------------------------------

    async def _supervise(self, execution: _Execution) -> None:
        process = execution.process
        assert process is not None
        plan = execution.plan
        if plan.timeout_s is not None:
            self._helper(execution, self._timeout(execution, plan.timeout_s), "timeout")
        if plan.marker is not None:
            self._helper(execution, self._watch_marker(execution, plan.marker), "marker")
        try:
            code = await process.wait()
            execution.exited.set()
            # The leader is gone; nothing of its group may outlive the job.
            await self._end_group(process.pid, execution)
            pumps = [t for t in execution.helpers if t.get_name().endswith(("stdout", "stderr"))]
            if pumps:
                await asyncio.wait(pumps, timeout=5.0)
            marker_found = None
            if plan.marker is not None:
                marker_found = await asyncio.to_thread(plan.marker.exists)
            state = execution.record.exited(code, self._clock(), marker_found=marker_found)
            if state is ExecutionState.FAILED and execution.record.reported_state != "failed":
                last = next((line for line in reversed(execution.tail) if line.startswith("stderr")), "")
                if last:
                    execution.record.message += f" ({last})"
        except asyncio.CancelledError:
            if execution.process is not None:
                _signal_group(execution.process.pid, signal.SIGKILL)
            raise
        finally:
            await self._finish(execution)

    async def _end_group(self, pgid: int, execution: _Execution) -> None:
        members = await asyncio.to_thread(group_members, pgid)
        if not members:
            return
        grace = self.settings.stop_grace_s
        if execution.record.state is ExecutionState.STOPPING:
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            delay = 0.02
            while members and time.monotonic() < deadline:
                await asyncio.sleep(delay)  # no exit notification exists for a grandchild
                delay = min(delay * 2, 0.2)
                members = await asyncio.to_thread(group_members, pgid)
        if members:
            execution.logs.line("system", f"killing {len(members)} leftover process(es) of the job")
            _signal_group(pgid, signal.SIGKILL)

    def _stop(self, execution: _Execution, cause: StopCause, message: str) -> None:
        record = execution.record
        if not record.request_stop(cause, self._clock(), message):
            return
        execution.logs.line("system", f"stopping ({cause.value}): {message}")
        assert execution.process is not None
        _signal_group(execution.process.pid, signal.SIGTERM)
        self._helper(execution, self._kill_after_grace(execution), "kill")

    async def _kill_after_grace(self, execution: _Execution) -> None:
        try:
            async with asyncio.timeout(self.settings.stop_grace_s):
                await execution.exited.wait()
        except TimeoutError:
            assert execution.process is not None
            execution.logs.line(
                "system", f"still running {self.settings.stop_grace_s:g} s after SIGTERM: SIGKILL"
            )
            _signal_group(execution.process.pid, signal.SIGKILL)

    async def _timeout(self, execution: _Execution, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await execution.exited.wait()
        except TimeoutError:
            self._stop(execution, StopCause.TIMEOUT, f"ran past its timeout of {timeout_s:g} s")

    async def _watch_marker(self, execution: _Execution, marker: Path) -> None:
        # NOTE: polling a file is the portable way (no inotify in the standard library); the
        # interval is a setting and the check is one stat().
        while not execution.exited.is_set():
            if await asyncio.to_thread(marker.exists):
                try:
                    async with asyncio.timeout(self.settings.marker_exit_grace_s):
                        await execution.exited.wait()
                except TimeoutError:
                    self._stop(execution, StopCause.MARKER, "completion marker found; the task kept running")
                return
            try:
                async with asyncio.timeout(self.settings.marker_poll_s):
                    await execution.exited.wait()
            except TimeoutError:
                pass

    # ---- finishing ----------------------------------------------------------------------------

    def _status_report(self, execution: _Execution) -> scheduler_pb2.JobStatusReport:
        record = execution.record
        return scheduler_pb2.JobStatusReport(
            job_id=record.job_id,
            state=_REPORT_STATES[record.state],
            exit_code=record.exit_code or 0,
            message=record.message,
            attempt=execution.dispatch.attempt,
        )

    async def _report(self, execution: _Execution, report: scheduler_pb2.JobStatusReport) -> None:
        """Tell the scheduler, retrying within ``status_timeout_s``; it also polls GetJobStatus."""
        record = execution.record
        try:
            async with asyncio.timeout(self.settings.status_timeout_s):
                while True:
                    try:
                        await execution.link.status(report)
                        return
                    except Exception as err:
                        log.info("job %s: status report failed (%r); retrying", record.job_id, err)
                        await asyncio.sleep(0.5)
        except TimeoutError:
            log.warning("job %s: could not report %s to its scheduler", record.job_id, record.state.value)

    async def _finish(self, execution: _Execution) -> None:
        """Free everything the execution held; runs once, whatever happened."""
        dispatch, record = execution.dispatch, execution.record
        try:
            self.gpus.release(dispatch.key)
            for task in list(execution.helpers):
                if not task.get_name().endswith("report-running"):
                    task.cancel()
            await asyncio.gather(*execution.helpers, return_exceptions=True)
            if execution.bridge is not None:
                await execution.bridge.stop()
            if execution.exchange_open:
                await self.exchange.close_job(dispatch.job_id)
            if record.result_dir:
                record.result_dir = str(await asyncio.to_thread(self._keep_result, execution))
            execution.logs.line("system", f"{record.state.value}: {record.message}".rstrip(": "))
            await self._report(execution, self._status_report(execution))
            await execution.logs.close()
            await execution.link.close()
            await asyncio.to_thread(self._clean_work_dir, execution)
        except Exception:
            log.exception("job %s: cleanup failed", dispatch.job_id)
        finally:
            self._active.pop(dispatch.key, None)
            self._finished[record.execution_id] = execution
            while len(self._finished) > self._max_finished:
                self._finished.popitem(last=False)
            execution.done.set()
            log.info(
                "job %s (%s) %s: %s",
                dispatch.job_id,
                dispatch.executor.value,
                record.state.value,
                record.message,
            )

    def _keep_result(self, execution: _Execution) -> Path:
        source = Path(execution.record.result_dir)
        target = self.results_dir / execution.dispatch.job_id / execution.dispatch.executor.value
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(source, target)
        return target

    def _clean_work_dir(self, execution: _Execution) -> None:
        policy = self.settings.cleanup
        succeeded = execution.record.state is ExecutionState.SUCCEEDED
        if policy == "always" or (policy == "on_success" and succeeded):
            shutil.rmtree(execution.work_dir, ignore_errors=True)

    def _sweep(self) -> None:
        """Remove kept work dirs and results older than ``retain_s`` (not those of running jobs)."""
        cutoff = time.time() - self.settings.retain_s
        busy = {execution.work_dir for execution in self._active.values()}
        for folder in (self.jobs_dir, self.results_dir):
            for path in folder.iterdir() if folder.is_dir() else ():
                try:
                    if path not in busy and path.stat().st_mtime < cutoff:
                        shutil.rmtree(path, ignore_errors=True)
                except OSError:
                    continue


_REPORT_STATES = {
    ExecutionState.STARTING: scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
    ExecutionState.RUNNING: scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
    ExecutionState.STOPPING: scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
    ExecutionState.SUCCEEDED: scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED,
    ExecutionState.FAILED: scheduler_pb2.EXECUTION_STATE_REPORT_FAILED,
    ExecutionState.CANCELLED: scheduler_pb2.EXECUTION_STATE_REPORT_CANCELLED,
    ExecutionState.TIMED_OUT: scheduler_pb2.EXECUTION_STATE_REPORT_TIMED_OUT,
}


def _is_rewiring(running: JobDispatch, new: JobDispatch) -> bool:
    """A second dispatch that only updates a running parameter server's trainer list."""
    return (
        new.executor is ExecutorKind.PARAMETER_SERVER
        and new.lease_id == running.lease_id
        and new.scheduler_id == running.scheduler_id
        and new.trainer_ids != running.trainer_ids
    )


def _make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    (path / "tmp").mkdir(exist_ok=True, mode=0o700)
    os.utime(path)  # a reused dir counts as fresh for the retention sweep


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _proc_entries() -> Iterator[tuple[int, str, int]]:
    """(pid, state, process group) of every process, from /proc."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                stat = handle.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3:
            yield int(entry.name), fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    return [pid for pid, state, group in _proc_entries() if group == pgid and state not in ("Z", "X")]


__all__ = ["GpuSlots", "JobManager", "JobsSection", "LinkFactory", "group_members"]
