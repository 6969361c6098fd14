"""The job state machine: where every job the scheduler knows stands.

::

    PENDING --> ALLOCATING --> RUNNING --> SUCCEEDED
       ^  \\          |  ^        |   \\
       |   \\         |  +--------+    +--> FAILED / CANCELLED
       |    +--------(+)-----------------> FAILED / CANCELLED
       +--------------+----------+  (back to the queue: a task retry, or a
                                     restart that re-queues)

- PENDING: accepted and persisted, waiting in the queue (or for a retry's
  backoff to pass).
- ALLOCATING: leasing workers through the market.
- RUNNING: dispatched; workers report progress.
- RUNNING -> ALLOCATING: a DiLoCo job lost a worker and leases a replacement
  while the others carry on (the job is not restarted).
- RUNNING/ALLOCATING -> PENDING: a task attempt ended in a way its retry
  policy retries (timeout, worker loss, non-zero exit), or an allocation
  found nothing and the job goes back to the queue.
- SUCCEEDED, FAILED and CANCELLED are terminal: nothing leaves them, so a
  late report from a worker can never revive a finished job.

Pure: no I/O, no clock. The store applies a transition with one conditional
update (``UPDATE ... WHERE state = ?``), checking it here first.
"""

from __future__ import annotations

from enum import StrEnum

from hypha.errors import IllegalTransitionError, InvalidArgumentError
from hypha.v1 import common_pb2


class JobState(StrEnum):
    #: Persisted and queued; nothing leased yet.
    PENDING = "pending"
    #: Leasing workers (first time, or a replacement for a lost one).
    ALLOCATING = "allocating"
    #: Dispatched to its workers.
    RUNNING = "running"
    #: Finished as asked (all rounds done; task exited 0 / wrote its marker).
    SUCCEEDED = "succeeded"
    #: Gave up: see the reason.
    FAILED = "failed"
    #: Stopped on a client's request.
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    def to_proto(self) -> common_pb2.JobState:
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> JobState:
        state = _FROM_PROTO.get(int(value))
        if state is None:
            raise InvalidArgumentError(f"job state {value} is unspecified or unknown")
        return state

    @classmethod
    def parse(cls, name: str) -> JobState:
        """A state from its name as users type it (``running``, ``RUNNING``, ``JOB_STATE_RUNNING``)."""
        key = name.strip().lower().removeprefix("job_state_")
        try:
            return cls(key)
        except ValueError:
            valid = ", ".join(s.value for s in cls)
            raise InvalidArgumentError(f"unknown job state {name!r} (valid: {valid})") from None


_P, _A, _R = JobState.PENDING, JobState.ALLOCATING, JobState.RUNNING
_S, _F, _C = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED

TERMINAL: frozenset[JobState] = frozenset({_S, _F, _C})
ACTIVE: frozenset[JobState] = frozenset({_P, _A, _R})

#: Every move a job may make.
TRANSITIONS: frozenset[tuple[JobState, JobState]] = frozenset(
    {
        (_P, _A),  # the queue hands it to allocation
        (_A, _R),  # workers leased and dispatched
        (_R, _S),  # done
        (_R, _A),  # a worker was lost: lease a replacement, the job goes on
        (_R, _P),  # task retry after a failed attempt / re-queued on restart
        (_A, _P),  # nothing could be leased now: back to the queue
        (_P, _F),  # invalid at dispatch time, or out of retries
        (_A, _F),  # allocation gave up
        (_R, _F),  # an attempt failed and no retry remains
        (_P, _C),  # cancelled by a client
        (_A, _C),
        (_R, _C),
    }
)

_TO_PROTO: dict[JobState, common_pb2.JobState] = {
    _P: common_pb2.JOB_STATE_PENDING,
    _A: common_pb2.JOB_STATE_ALLOCATING,
    _R: common_pb2.JOB_STATE_RUNNING,
    _S: common_pb2.JOB_STATE_SUCCEEDED,
    _F: common_pb2.JOB_STATE_FAILED,
    _C: common_pb2.JOB_STATE_CANCELLED,
}
_FROM_PROTO: dict[int, JobState] = {int(v): k for k, v in _TO_PROTO.items()}


def sources_of(target: JobState) -> frozenset[JobState]:
    """The states a job may be in to move to ``target``."""
    return frozenset(src for src, dst in TRANSITIONS if dst is target)


def transition(current: JobState, target: JobState, job_id: str = "") -> JobState:
    """``target`` if the table allows the move; IllegalTransitionError naming both states otherwise."""
    if (current, target) not in TRANSITIONS:
        raise IllegalTransitionError(f"job {job_id}".strip(), current.value, target.value)
    return target


class Reason:
    """Reasons the scheduler itself writes; orchestration adds its own free text."""

    SUBMITTED = "submitted"
    CANCELLED = "cancelled by {who}"
    SCHEDULER_RESTARTED = "scheduler restarted while the job was {state}"
    REQUEUED_AFTER_RESTART = "scheduler restarted; re-queued (attempt {attempt} of {max_attempts})"
    RESUMED_AFTER_RESTART = "scheduler restarted; resuming from round {round}"
    RETRY_SCHEDULED = "attempt {attempt} {outcome}; retry in {delay_s:.1f}s"
    OUT_OF_RETRIES = "attempt {attempt} {outcome}; no retries left"
    WORKER_LOST = "worker {worker} lost; leasing a replacement"
