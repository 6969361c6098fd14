"""What an ended execution gives back, step by step, each step guarded on its own.

A step that fails (a bridge that does not stop, a result that cannot be
moved) is logged and the others still run: the scheduler always gets the
final report, the link is always closed and the work dir cleaned up per
policy. The job manager then forgets the execution (``JobManager._finish``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from hypha.worker.execution import RUNNING_REPORT, Execution
from hypha.worker.execution_state import ExecutionState
from hypha.worker.gpu_slots import GpuSlots
from hypha.worker.jobs_config import JobsSection
from hypha.worker.supervisor import Supervisor
from hypha.worker.transfer import TensorExchange
from hypha.worker.work_dirs import WorkDirs

log = logging.getLogger(__name__)


class ExecutionCleanup:
    """The job manager's cleanup of one ended execution (``run``), in the order the steps need."""

    def __init__(
        self, gpus: GpuSlots, exchange: TensorExchange, dirs: WorkDirs, settings: JobsSection
    ) -> None:
        self.gpus = gpus
        self.exchange = exchange
        self.dirs = dirs
        self.settings = settings

    async def run(self, execution: Execution) -> None:
        """Every step, in order; a failing one is logged and skipped, never the ones after it."""
        for step in (
            self.drop_warm,
            self.free_gpus,
            self.stop_helpers,
            self.stop_bridge,
            self.close_inboxes,
            self.keep_result,
            self.report_final,
            self.close_link,
            self.clean_work_dir,
        ):
            try:
                await step(execution)
            except Exception:
                log.exception("job %s: cleanup step %s failed", execution.dispatch.job_id, step.__name__)

    async def drop_warm(self, execution: Execution) -> None:
        """A warm executor claimed but never told what to become (the start failed) ends."""
        await Supervisor.drop_warm(execution)

    async def free_gpus(self, execution: Execution) -> None:
        self.gpus.release(execution.dispatch.key)

    async def stop_helpers(self, execution: Execution) -> None:
        """Cancel the execution's helper tasks, except a running report still in flight."""
        for task in execution.helpers:
            if not task.get_name().endswith(RUNNING_REPORT):
                task.cancel()
        await asyncio.gather(*execution.helpers, return_exceptions=True)

    async def stop_bridge(self, execution: Execution) -> None:
        if execution.bridge is not None:
            await execution.bridge.stop()

    async def close_inboxes(self, execution: Execution) -> None:
        if execution.exchange_open:
            await self.exchange.close_job(execution.dispatch.job_id)

    async def keep_result(self, execution: Execution) -> None:
        """Move a named result out of the work dir before the work dir is cleaned up."""
        dispatch, record = execution.dispatch, execution.record
        if record.result_dir:
            kept = await asyncio.to_thread(
                self.dirs.keep_result, Path(record.result_dir), dispatch.job_id, dispatch.executor.value
            )
            record.result_dir = str(kept)

    async def report_final(self, execution: Execution) -> None:
        record = execution.record
        execution.logs.line("system", f"{record.state.value}: {record.message}".rstrip(": "))
        await execution.report(execution.status_report(), self.settings.status_timeout_s)

    async def close_link(self, execution: Execution) -> None:
        """Flush the logs, then close the link (even when the flush fails)."""
        try:
            await execution.logs.close()
        finally:
            await execution.link.close()

    async def clean_work_dir(self, execution: Execution) -> None:
        succeeded = execution.record.state is ExecutionState.SUCCEEDED
        await asyncio.to_thread(self.dirs.clean, execution.work_dir, self.settings.cleanup, succeeded)


__all__ = ["ExecutionCleanup"]
