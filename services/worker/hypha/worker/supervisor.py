"""The executor process of each execution: started in its sandbox, watched, stopped, its exit settled.

The job manager decides which executions run and frees what they held; this
is the part that deals with the operating system's timing, apart from that
bookkeeping. Each executor starts as the leader of a new process group
(``process_group``) inside its sandbox (``sandbox``, resolved once at start,
after the executors a previous run left behind were killed), with the bridge
socket, a thread count that shares the machine's cores, and the assigned GPU
slots in ``CUDA_VISIBLE_DEVICES``; stdout and stderr are read line by line
into the job's log forwarder. It is watched for its timeout, its completion
marker and the memory and disk its lease grants (``lease_limits``: over them
it is killed at once), and stopped with SIGTERM to the group and SIGKILL
after ``stop_grace_s``. When the leader exits, whatever is left of its group is
ended, and the exit code, the marker and a task's declared outputs settle
the final state (``execution_state``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from hypha.worker.execution import PUMP_NAMES, RUNNING_REPORT, Execution, worker_environment
from hypha.worker.execution_state import ExecutionState, StopCause
from hypha.worker.jobs_config import JobsSection
from hypha.worker.lease_limits import lease_bounds, watch_lease
from hypha.worker.process_group import end_group, kill_orphans, pump_lines, signal_group, spawn_group_leader
from hypha.worker.resources import GIB
from hypha.worker.sandbox import Sandbox, resolve
from hypha.worker.warm_executor import WarmExecutor

log = logging.getLogger(__name__)


class Supervisor:
    """Starts, watches and stops executor processes; ``start()`` comes before the first ``spawn``."""

    def __init__(self, settings: JobsSection, *, hidden: Sequence[Path], clock: Callable[[], float]) -> None:
        """``hidden``: what no sandbox may show (the work root, the worker's own files)."""
        self.settings = settings
        self._hidden = hidden
        self._clock = clock
        self.sandbox: Sandbox | None = None
        self.warm: WarmExecutor | None = None

    async def start(self, jobs_dir: Path) -> None:
        """Resolve the sandbox and kill the executors a previous run left behind under ``jobs_dir``."""
        self.sandbox = await asyncio.to_thread(
            resolve, self.settings.sandbox, readonly=self.settings.sandbox_paths, hidden=self._hidden
        )
        killed = await asyncio.to_thread(kill_orphans, jobs_dir)
        if killed:
            log.warning("killed %d executor process(es) a previous run left behind", len(killed))

    async def start_warm(self, jobs_dir: Path) -> None:
        """Start the warm executor (``worker.jobs.warm_executor``) once the jobs dir exists."""
        assert self.sandbox is not None, "start() resolves the sandbox"
        if not self.settings.warm_executor:
            return
        if not WarmExecutor.supported(self.sandbox):
            log.info("warm executor off: the %s sandbox cannot take one", self.sandbox.mode)
            return
        self.warm = WarmExecutor(self.sandbox, jobs_dir, worker_environment(self.settings))
        await self.warm.start()

    async def stop_warm(self) -> None:
        if self.warm is not None:
            await self.warm.stop()

    def claim_warm(self, execution: Execution) -> None:
        """Give a fresh execution the warm executor (its work dir becomes the spare's), if it can be."""
        if self.warm is not None:
            execution.warm = self.warm.claim(execution.plan.argv, execution.work_dir)

    @staticmethod
    async def drop_warm(execution: Execution) -> None:
        """End a warm executor claimed by an execution that never got to spawn it."""
        spare, execution.warm = execution.warm, None
        if spare is not None:
            await spare.end()

    # ---- starting ---------------------------------------------------------------------------

    async def spawn(self, execution: Execution) -> None:
        """Start the execution's process (its bridge runs already) and read its output."""
        sandbox = self.sandbox
        assert sandbox is not None, "start() resolves the sandbox"
        env = sandbox.environment(execution.environment(self.settings), execution.work_dir)
        storage_gb = execution.leased.storage_gb
        argv = sandbox.wrap(
            execution.plan.argv,
            execution.work_dir,
            env.get("PATH"),
            # Only a job's own command (a task) may use the network; our executors use their bridge.
            network=execution.dispatch.profile.own_network,
            # One file no larger than the storage the lease grants (lease_limits watches the sum).
            max_file_bytes=int(storage_gb * GIB) if storage_gb > 0 else None,
        )
        spare, execution.warm = execution.warm, None
        if spare is not None:
            max_file_bytes = int(storage_gb * GIB) if storage_gb > 0 else None
            await WarmExecutor.order(spare, execution.plan.argv[2], env, max_file_bytes)
            process, out_read, err_read = spare.process, spare.stdout, spare.stderr
        else:
            process, out_read, err_read = await spawn_group_leader(argv, execution.work_dir, env)
        execution.process = process
        if execution.record.state.terminal:  # cancelled while the process was being created
            signal_group(process.pid, signal.SIGKILL)
            await process.wait()
            os.close(out_read)
            os.close(err_read)
            return
        execution.record.spawned(self._clock())
        for fd, stream in ((out_read, "stdout"), (err_read, "stderr")):
            execution.helper(self._pump(execution, fd, stream), stream)
        gpus = ",".join(map(str, execution.gpus)) or "none"
        execution.logs.line(
            "system",
            f"started {execution.dispatch.executor.value} (pid {process.pid}, threads {execution.threads}, "
            f"GPUs {gpus}{', warm' if spare is not None else ''})",
        )
        execution.helper(
            execution.report(execution.status_report(), self.settings.status_timeout_s),
            RUNNING_REPORT,
        )

    async def _pump(self, execution: Execution, fd: int, stream: str) -> None:
        await pump_lines(
            fd, self.settings.max_log_line_bytes, lambda line: self._emit(execution, stream, line)
        )

    def _emit(self, execution: Execution, stream: str, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        execution.tail.append(f"{stream}: {text}")
        execution.logs.line(stream, text)

    # ---- supervising and stopping ------------------------------------------------------------

    async def supervise(self, execution: Execution) -> None:
        """Watch the spawned process until its leader exits; end its group, settle the final state.

        Cancelled, it kills the group. The caller frees what the execution held afterwards.
        """
        process = execution.process
        assert process is not None
        plan = execution.plan
        if plan.timeout_s is not None:
            execution.helper(self._timeout(execution, plan.timeout_s), "timeout")
        if plan.marker is not None:
            execution.helper(self._watch_marker(execution, plan.marker), "marker")
        execution.helper(self._hold_to_lease(execution), "lease")
        try:
            code = await process.wait()
            execution.exited.set()
            # The leader is gone; nothing of its group may outlive the job.
            await self._end_group(process.pid, execution)
            pumps = execution.helper_tasks(*PUMP_NAMES)
            if pumps:
                await asyncio.wait(pumps, timeout=5.0)
            marker_found = None
            if plan.marker is not None:
                marker_found = await asyncio.to_thread(plan.marker.exists)
            keep = execution.dispatch.profile.keep
            if keep is not None and (marker_found if marker_found is not None else code == 0):
                kept, missing = await asyncio.to_thread(keep, execution.dispatch.spec, execution.work_dir)
                if kept is not None:
                    execution.record.result_dir = str(kept)
                if missing:
                    execution.record.report("failed", missing)
                    marker_found = None if marker_found is None else False
            state = execution.record.exited(code, self._clock(), marker_found=marker_found)
            if state is ExecutionState.FAILED and execution.record.reported_state != "failed":
                if last := execution.last_stderr():
                    execution.record.message += f" ({last})"
        except asyncio.CancelledError:
            if execution.process is not None:
                signal_group(execution.process.pid, signal.SIGKILL)
            raise

    async def _end_group(self, pgid: int, execution: Execution) -> None:
        """The leader is gone: end the rest of its group (politely only if we were stopping it)."""
        stopping = execution.record.state is ExecutionState.STOPPING
        killed = await end_group(pgid, grace_s=self.settings.stop_grace_s if stopping else None)
        if killed:
            execution.logs.line("system", f"killed {killed} leftover process(es) of the job")

    def stop(self, execution: Execution, cause: StopCause, message: str) -> None:
        """SIGTERM to the execution's group, SIGKILL after ``stop_grace_s`` (see ``request_stop``)."""
        record = execution.record
        if not record.request_stop(cause, self._clock(), message):
            return
        execution.logs.line("system", f"stopping ({cause.value}): {message}")
        assert execution.process is not None and self.sandbox is not None
        signal_group(execution.process.pid, signal.SIGTERM, spare_leader=self.sandbox.wrapper_leads)
        execution.helper(self._kill_after_grace(execution), "kill")

    async def _kill_after_grace(self, execution: Execution) -> None:
        if not await execution.exited_within(self.settings.stop_grace_s):
            assert execution.process is not None
            execution.logs.line(
                "system", f"still running {self.settings.stop_grace_s:g} s after SIGTERM: SIGKILL"
            )
            signal_group(execution.process.pid, signal.SIGKILL)

    async def _timeout(self, execution: Execution, timeout_s: float) -> None:
        if not await execution.exited_within(timeout_s):
            self.stop(execution, StopCause.TIMEOUT, f"ran past its timeout of {timeout_s:g} s")

    async def _hold_to_lease(self, execution: Execution) -> None:
        """Kill the job at once, and fail it, when it goes over the memory or disk its lease grants."""
        process = execution.process
        assert process is not None
        reason = await watch_lease(
            lambda: lease_bounds(execution.leased, self.settings.default_memory_gb),
            process.pid,
            execution.work_dir,
            execution.exited_within,
            memory_poll_s=self.settings.memory_poll_s,
            disk_poll_s=self.settings.disk_poll_s,
        )
        if reason is None or execution.exited.is_set():
            return
        # Already stopping for another cause (its grace running), it keeps that cause but not its grace.
        execution.record.request_stop(StopCause.OVER_LEASE, self._clock(), reason)
        execution.logs.line("system", f"over its lease, killed at once: {reason}")
        signal_group(process.pid, signal.SIGKILL)

    async def _watch_marker(self, execution: Execution, marker: Path) -> None:
        # NOTE: polling a file is the portable way (no inotify in the standard library); the
        # interval is a setting and the check is one stat().
        while not execution.exited.is_set():
            if await asyncio.to_thread(marker.exists):
                if not await execution.exited_within(self.settings.marker_exit_grace_s):
                    self.stop(execution, StopCause.MARKER, "completion marker found; the task kept running")
                return
            await execution.exited_within(self.settings.marker_poll_s)


__all__ = ["Supervisor"]
