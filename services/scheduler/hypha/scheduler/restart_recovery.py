"""What a restarted scheduler does with the jobs its previous process left mid-flight.

A scheduler process can die (crash, kill, upgrade) while jobs are ALLOCATING
or RUNNING; the store still says so, but nothing drives them any more. Their
fate is decided here once, at start-up, before the orchestrator takes any
job, so every job kind is settled by the same rules, by its kind's
``restart`` policy (``hypha.jobfile.kinds.Restart``):

- PENDING jobs stay PENDING and are handed back to be queued again.
- RETRY kinds (tasks) that were ALLOCATING go back to PENDING (no attempt
  was used). Those that were RUNNING: their workers lose their leases when
  nobody renews them and kill the process, so the attempt is lost like a
  worker loss. If the retry policy has attempts left the job is re-queued
  (PENDING, reason says so); otherwise it FAILS with "scheduler restarted".
- Other jobs still ALLOCATING with no saved run state never started: they
  go back to PENDING; the leases they held lapse on the workers, nobody
  renewing them.
- RUNNING jobs of a RESUME kind (DiLoCo) continue when they can: by
  default, when their run saved its state (``save_run_state``: leases,
  trainers, slice assignments, round; ``hypha.scheduler.diloco.resume``),
  else as the caller's ``resumable`` hook says. Such a job goes to
  ALLOCATING with reason "resuming from round N" and the orchestrator
  resumes it: leases still held are renewed, lost ones re-allocated.
- Every other RUNNING job FAILS with "scheduler restarted while the job was
  running" and its kind's ``not_resumed`` reason.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from hypha.jobfile.kinds import Restart, job_kind
from hypha.scheduler.lifecycle import JobState, Reason
from hypha.scheduler.records import JobRecord, RecoveryReport
from hypha.scheduler.sqlite_store import SqliteJobStore


def recover(store: SqliteJobStore, resumable: Callable[[JobRecord], bool] | None = None) -> RecoveryReport:
    """Settle jobs a previous scheduler process left mid-flight (policy in the module docstring).

    ``resumable`` None: a job of a RESUME kind resumes when its run saved its state."""
    if resumable is None:
        resumable = partial(_has_run_state, store)
    report = RecoveryReport()
    for job in store.list_jobs([JobState.ALLOCATING, JobState.RUNNING], limit=1_000_000):
        restarted = Reason.SCHEDULER_RESTARTED.format(state=job.state.value)

        def requeue(reason: str, job: JobRecord = job) -> None:
            report.requeued.append(
                store.transition(
                    job.job_id, JobState.PENDING, expected=job.state, reason=reason, not_before=0.0
                )
            )

        def fail(reason: str, job: JobRecord = job) -> None:
            report.failed.append(
                store.transition(job.job_id, JobState.FAILED, expected=job.state, reason=reason)
            )

        kind = job_kind(job.kind)
        if kind.restart is Restart.RETRY:
            if job.state is JobState.ALLOCATING:
                requeue("scheduler restarted before dispatch; re-queued")
            elif job.attempt < job.max_attempts:
                requeue(
                    Reason.REQUEUED_AFTER_RESTART.format(
                        attempt=job.attempt + 1, max_attempts=job.max_attempts
                    )
                )
            else:
                fail(f"{restarted}; {kind.not_resumed}")
        elif kind.restart is Restart.RESUME and resumable(job):
            reason = Reason.RESUMED_AFTER_RESTART.format(round=job.round)
            if job.state is JobState.RUNNING:
                report.resumed.append(
                    store.transition(
                        job.job_id, JobState.ALLOCATING, expected=job.state, reason=reason, workers="[]"
                    )
                )
            else:
                store.note(job.job_id, reason)
                report.resumed.append(store.get(job.job_id))
        elif job.state is JobState.ALLOCATING:
            requeue(restarted + "; it had not started: re-queued")
        else:
            fail(f"{restarted}; {kind.not_resumed}")
    report.pending = store.list_jobs([JobState.PENDING], limit=1_000_000)
    return report


def _has_run_state(store: SqliteJobStore, job: JobRecord) -> bool:
    return store.run_state(job.job_id) is not None


__all__ = ["recover"]
