"""Task jobs: one command on one worker, retried by the job's policy until it succeeds or gives up.

An attempt: wait for the retry's ``not_before`` (PENDING), lease one worker
by the job's policy (ALLOCATING; nothing offered puts the job back PENDING,
pausing longer each time), dispatch it (RUNNING), then wait for its end — a
status report, the lease's loss, a backstop ``GetJobStatus`` poll, or the
timeout plus a grace. The job ends with the exit code, or goes back PENDING
for the next attempt after the policy's backoff (``hypha.scheduler.retry``).

A task that ships files gets its bundle (kept by sha256 at submit,
``hypha.bundles``) inline with every dispatch. A task that declares
``outputs`` succeeds only once the scheduler pulled them from the worker
(``hypha.scheduler.results``, the same pull as a DiLoCo job's model), so
``hypha fetch`` serves them; a failed pull fails the job with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from hypha.bundles import BundleStore
from hypha.errors import HyphaError
from hypha.market.allocator import HeldLease
from hypha.market.pricing import PriceRange
from hypha.market.resources import Requirements
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.results import keep_result
from hypha.scheduler.retry import AttemptEnd, Outcome, RetryPolicy, attempt_end
from hypha.scheduler.runs import JobFailed, JobRun, RunRegistry, price_range
from hypha.scheduler.store import JobRecord
from hypha.scheduler.worker_calls import REFUSALS, describe
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2

#: Longest pause of a queued task between two attempts to find a worker.


class TaskRun(JobRun):
    """A task job while it runs: its current attempt and the worker running it."""

    kind = "task"

    def __init__(self, job: JobRecord, runs: RunRegistry, bundles: BundleStore, state_dir: Path) -> None:
        super().__init__(job, runs)
        self.bundles = bundles
        self.state_dir = state_dir
        self.attempt = job.attempt
        self.worker_id = ""
        #: Resolved when the current attempt ends.
        self.outcome: asyncio.Future[AttemptEnd] | None = None

    def on_lease_lost(self, lease: HeldLease, reason: str) -> None:
        if lease.worker_id == self.worker_id:
            self._end_attempt((Outcome.WORKER_LOST, -1, f"worker {lease.worker_id} lost: {reason}"))

    def on_status(self, worker_id: str, report: scheduler_pb2.JobStatusReport) -> None:
        if worker_id == self.worker_id and report.attempt == self.attempt:
            self._end_attempt(attempt_end(int(report.state), int(report.exit_code), report.message))

    def _end_attempt(self, end: AttemptEnd) -> None:
        if self.outcome is not None and not self.outcome.done():
            self.outcome.set_result(end)

    async def drive(self, job: JobRecord) -> None:
        """Attempts until one succeeds or ``_after_failure`` ends the job (inference jobs share this)."""
        runs, store = self.runs, self.runs.store
        await self._prepare()
        requirement, price, policy, timeout_s = self._terms()
        misses = 0
        while True:
            job = await store.get(self.job_id)
            if job.state is not JobState.PENDING:
                raise JobFailed(f"job is {job.state.value}, expected pending")
            delay = job.not_before - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await store.transition(self.job_id, JobState.ALLOCATING, expected=JobState.PENDING)
            lease = await runs.lease_one_or_requeue(self, requirement, price, policy, misses, self.what)
            if lease is None:
                misses += 1
                continue
            misses = 0
            ended, code, message = await self._attempt(lease, job.attempt + 1, timeout_s)
            await runs.release_lease(self, lease, cancel=ended not in (Outcome.SUCCEEDED, Outcome.FAILED))
            if ended is Outcome.SUCCEEDED:
                result_path = await self._pull_outputs(lease.worker_id)
                await store.transition(
                    self.job_id,
                    JobState.SUCCEEDED,
                    expected=JobState.RUNNING,
                    reason=message or self.succeeded_reason,
                    exit_code=code,
                    **({"result_path": result_path} if result_path else {}),
                )
                return
            if not await self._after_failure(ended, code, ended.value + (f" ({message})" if message else "")):
                return

    #: What an attempt leases, as reasons name it, and the reason of a success without a message.
    what = "worker"
    succeeded_reason = "exit code 0"

    async def _prepare(self) -> None:
        """Work before the first lease (an inference job looks up its data and packs its model)."""

    @property
    def terms(self) -> common_pb2.TaskJobSpec | common_pb2.InferenceJobSpec:
        """The part of the spec with what an attempt leases: requirements, price, policy, timeout."""
        return self.spec.task

    def _terms(self) -> tuple[Requirements, PriceRange | None, str, float]:
        spec = self.terms
        requirement, price = Requirements.from_proto(spec.requirements), price_range(spec.price)
        return requirement, price, spec.selection_policy, spec.timeout_s

    async def _after_failure(self, ended: Outcome, code: int, described: str) -> bool:
        """The job's retry policy after a failed attempt: back to PENDING for the next one (True), or
        FAILED (False)."""
        store = self.runs.store
        decision = RetryPolicy.from_proto(self.spec.task.retry).decide(self.attempt, ended, time.time())
        if not decision.retry:
            await store.transition(
                self.job_id,
                JobState.FAILED,
                expected=JobState.RUNNING,
                reason=Reason.OUT_OF_RETRIES.format(attempt=self.attempt, outcome=described),
                exit_code=code,
            )
            return False
        await store.transition(
            self.job_id,
            JobState.PENDING,
            expected=JobState.RUNNING,
            reason=Reason.RETRY_SCHEDULED.format(
                attempt=self.attempt, outcome=described, delay_s=decision.delay_s
            ),
            not_before=decision.at,
            exit_code=code,
        )
        return True

    async def _attempt(self, lease: HeldLease, attempt: int, timeout_s: float) -> AttemptEnd:
        """Dispatch attempt number ``attempt`` on ``lease`` (the job goes RUNNING) and wait for its end."""
        self.attempt = attempt
        self.worker_id = lease.worker_id
        self.outcome = asyncio.get_running_loop().create_future()

        async def send() -> None:
            files = b""
            if self.spec.task.files_sha256:
                files = await asyncio.to_thread(self.bundles.get, self.spec.task.files_sha256)
            await self.runs.calls.dispatch(
                lease.worker_id,
                worker_pb2.DispatchJobRequest(
                    job_id=self.job_id,
                    lease_id=lease.lease_id,
                    executor=common_pb2.EXECUTOR_KIND_TASK,
                    spec=self.spec,
                    attempt=attempt,
                    scheduler_addresses=self.runs.market.addresses(),
                    files_bundle=files,
                ),
            )

        return await self._run_dispatched(lease, attempt, timeout_s, send)

    async def _run_dispatched(
        self, lease: HeldLease, attempt: int, timeout_s: float, send: Callable[[], Awaitable[None]]
    ) -> AttemptEnd:
        """``send`` the attempt to its worker, the job goes RUNNING, then wait for the attempt's end.

        A dispatch that did not arrive ends the attempt as the worker's loss (the retry policy
        decides what next); a worker that refuses the job itself (a policy, a malformed spec)
        would refuse every attempt, so the job fails at once with its reason.
        """
        store = self.runs.store
        try:
            await send()
        except (grpc.aio.AioRpcError, HyphaError) as err:
            if isinstance(err, grpc.aio.AioRpcError) and err.code() in REFUSALS:
                raise JobFailed(f"{lease.worker_id} refused the job: {describe(err)}") from err
            await store.transition(
                self.job_id, JobState.RUNNING, expected=JobState.ALLOCATING, attempt=attempt
            )
            return (Outcome.WORKER_LOST, -1, f"dispatch to {lease.worker_id} failed: {describe(err)}")
        await store.transition(
            self.job_id,
            JobState.RUNNING,
            expected=JobState.ALLOCATING,
            reason=f"attempt {attempt} running on {lease.worker_id}",
            attempt=attempt,
            workers=[lease.worker_id],
        )
        return await self._wait_for_end(lease, timeout_s)

    async def _pull_outputs(self, worker_id: str) -> str:
        """The declared outputs, pulled from the worker into the result dir; its path ("" if none)."""
        if not self.spec.task.outputs:
            return ""
        failure = "the task succeeded, but its outputs could not be kept: "
        return str(await keep_result(self.runs, worker_id, self.job_id, self.state_dir, failure=failure))

    async def _wait_for_end(self, lease: HeldLease, timeout_s: float) -> AttemptEnd:
        """Until the attempt ends: a status report, the lease's loss, a poll, or the timeout."""
        assert self.outcome is not None
        jobs_cfg, clock = self.runs.jobs_cfg, self.runs.clock
        limit = timeout_s + jobs_cfg.task_timeout_grace_s if timeout_s > 0 else math.inf
        started = clock()
        while True:
            left = limit - (clock() - started)
            if left <= 0:
                return (Outcome.TIMED_OUT, -1, f"no end reported within {timeout_s:g}s")
            wait = min(jobs_cfg.status_poll_s, left)
            with contextlib.suppress(TimeoutError):
                return await asyncio.wait_for(asyncio.shield(self.outcome), wait)
            polled = await self.runs.calls.poll_status(lease.worker_id, self.job_id)
            if polled is not None:
                return polled


__all__ = ["TaskRun"]
