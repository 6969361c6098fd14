"""The life of one execution of a job on a worker, as a pure state machine.

The scheduler's side of a job (queued, allocating, running, ... across
attempts and workers) is ``hypha.scheduler.lifecycle``; this module is one
attempt's run on one worker, which the scheduler hears about as a status
report.

::

    starting ──► running ──► succeeded | failed          (the process exited by itself)
       │            │
       │            └──► stopping ──► cancelled | timed_out | succeeded | failed
       │                               (we signalled the process group; why decides the end)
       └──► failed | cancelled                            (never started)

``stopping`` exists because ending a process tree takes time (SIGTERM, a
grace period, SIGKILL): the job is no longer allowed to run, but its
resources are not free until the group is gone. The cause of a stop is
recorded when it starts, so the final state does not depend on how the
process happened to die (a trainer that exits 0 on SIGTERM was still
cancelled). A completion marker that appears while the task still runs
stops it as ``succeeded``; a job over the memory or disk its lease grants is
stopped as ``failed``, with what it used as the message.

No I/O, no asyncio: the job manager drives it, tests drive it directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from hypha.errors import IllegalTransitionError, InvalidArgumentError
from hypha.jobfile.kinds import kind_of
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2, worker_pb2
from hypha.worker.executor_profiles import ExecutorProfile, profile

# Job ids become directory names: no separators, no dot-dot, bounded.
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class ExecutionState(StrEnum):
    STARTING = "starting"  # work dir, bridge and environment being prepared; no process yet
    RUNNING = "running"  # the executor process is alive
    STOPPING = "stopping"  # its process group was signalled; waiting for it to go
    SUCCEEDED = "succeeded"  # exit code 0 (or completion marker found), nothing reported failure
    FAILED = "failed"  # non-zero exit, failed start, or the executor reported failure
    CANCELLED = "cancelled"  # stopped on request or because its lease ended
    TIMED_OUT = "timed_out"  # stopped because it ran past its timeout

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    def to_proto(self) -> worker_pb2.ExecutionState:
        return _TO_PROTO[self]


class StopCause(StrEnum):
    """Why the worker stopped a job; decides the state it ends in."""

    CANCEL = "cancel"  # CancelJob, lease expiry or worker shutdown
    TIMEOUT = "timeout"
    MARKER = "marker"  # the task's completion marker appeared while it still ran
    OVER_LEASE = "over_lease"  # it used more memory or disk than its lease grants (``lease_limits``)


_TERMINAL = frozenset(
    {
        ExecutionState.SUCCEEDED,
        ExecutionState.FAILED,
        ExecutionState.CANCELLED,
        ExecutionState.TIMED_OUT,
    }
)

TRANSITIONS: dict[ExecutionState, frozenset[ExecutionState]] = {
    ExecutionState.STARTING: frozenset(
        {ExecutionState.RUNNING, ExecutionState.FAILED, ExecutionState.CANCELLED}
    ),
    ExecutionState.RUNNING: frozenset(
        {ExecutionState.STOPPING, ExecutionState.SUCCEEDED, ExecutionState.FAILED}
    ),
    ExecutionState.STOPPING: frozenset(
        {
            ExecutionState.CANCELLED,
            ExecutionState.TIMED_OUT,
            ExecutionState.SUCCEEDED,
            ExecutionState.FAILED,
        }
    ),
    ExecutionState.SUCCEEDED: frozenset(),
    ExecutionState.FAILED: frozenset(),
    ExecutionState.CANCELLED: frozenset(),
    ExecutionState.TIMED_OUT: frozenset(),
}

_TO_PROTO: dict[ExecutionState, worker_pb2.ExecutionState] = {
    ExecutionState.STARTING: worker_pb2.EXECUTION_STATE_STARTING,
    # The wire has no "stopping": the process is still alive, which is what RUNNING tells a scheduler.
    ExecutionState.RUNNING: worker_pb2.EXECUTION_STATE_RUNNING,
    ExecutionState.STOPPING: worker_pb2.EXECUTION_STATE_RUNNING,
    ExecutionState.SUCCEEDED: worker_pb2.EXECUTION_STATE_SUCCEEDED,
    ExecutionState.FAILED: worker_pb2.EXECUTION_STATE_FAILED,
    ExecutionState.CANCELLED: worker_pb2.EXECUTION_STATE_CANCELLED,
    ExecutionState.TIMED_OUT: worker_pb2.EXECUTION_STATE_TIMED_OUT,
}

_STOP_END: dict[StopCause, ExecutionState] = {
    StopCause.CANCEL: ExecutionState.CANCELLED,
    StopCause.TIMEOUT: ExecutionState.TIMED_OUT,
    StopCause.MARKER: ExecutionState.SUCCEEDED,
    StopCause.OVER_LEASE: ExecutionState.FAILED,
}


@dataclass(frozen=True)
class JobDispatch:
    """What a scheduler asked this worker to run (``DispatchJobRequest`` as a domain value)."""

    job_id: str
    lease_id: str
    executor: ExecutorKind
    spec: common_pb2.JobSpec
    #: The dispatching scheduler, from the TLS session; its job-control calls go there.
    scheduler_id: str
    scheduler_addresses: tuple[str, ...] = ()
    parameter_server_id: str = ""
    parameter_server_addresses: tuple[str, ...] = ()
    trainer_ids: tuple[str, ...] = ()
    batch_size: int = 0
    attempt: int = 0
    start_round: int = 0
    #: A task's files (tar.gz, ``hypha.bundles``), checked against ``spec.task.files_sha256``.
    files_bundle: bytes = b""
    #: Parameter servers the job had before ``parameter_server_id`` (set when a trainer is rewired).
    former_parameter_servers: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, request: worker_pb2.DispatchJobRequest, scheduler_id: str) -> JobDispatch:
        dispatch = cls(
            job_id=request.job_id,
            lease_id=request.lease_id,
            executor=ExecutorKind.from_proto(request.executor),
            spec=request.spec,
            scheduler_id=scheduler_id,
            scheduler_addresses=tuple(request.scheduler_addresses),
            parameter_server_id=request.parameter_server_id,
            parameter_server_addresses=tuple(request.parameter_server_addresses),
            trainer_ids=tuple(request.trainer_ids),
            batch_size=request.batch_size,
            attempt=request.attempt,
            start_round=request.start_round,
            files_bundle=request.files_bundle,
        )
        dispatch.validate()
        return dispatch

    def validate(self) -> None:
        if not _JOB_ID.match(self.job_id):
            raise InvalidArgumentError(f"job id {self.job_id!r} must match {_JOB_ID.pattern}")
        wanted, got = self.profile.job, kind_of(self.spec)
        if got is not wanted:
            named = got.name if got is not None else "none"
            raise InvalidArgumentError(
                f"executor {self.executor.value} needs a {wanted.name} job spec, got {named}"
            )
        self.profile.check(self.spec, self.files_bundle)

    @property
    def profile(self) -> ExecutorProfile:
        """What its executor kind needs (``hypha.worker.executor_profiles``)."""
        return profile(self.executor)

    @property
    def key(self) -> tuple[str, ExecutorKind]:
        """One execution per (job, executor) on a worker: a PS and a trainer of one job may share it."""
        return self.job_id, self.executor

    def route(self, peer_id: str) -> str:
        """Where the executor's tensors for ``peer_id`` go: to the current server for a former one."""
        if peer_id and peer_id in self.former_parameter_servers and self.parameter_server_id:
            return self.parameter_server_id
        return peer_id

    def is_parameter_server(self, peer_id: str) -> bool:
        """``peer_id`` is (or was) the job's parameter server."""
        return bool(peer_id) and (
            peer_id == self.parameter_server_id or peer_id in self.former_parameter_servers
        )

    def addresses_of(self, peer_id: str) -> tuple[str, ...]:
        """Direct addresses this dispatch names for a peer (empty: the relay finds it)."""
        if peer_id and peer_id == self.parameter_server_id:
            return self.parameter_server_addresses
        if peer_id and peer_id == self.scheduler_id:
            return self.scheduler_addresses
        return ()

    def requirements(self) -> common_pb2.Requirements:
        return self.profile.requirements(self.spec)


@dataclass
class ExecutionRecord:
    """State of one execution plus what its final report needs; times are the caller's clock."""

    job_id: str
    execution_id: str
    state: ExecutionState = ExecutionState.STARTING
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    message: str = ""
    stop_cause: StopCause | None = None
    #: What the executor itself said last through the bridge (``/v1/status``).
    reported_state: str = ""
    reported_message: str = ""
    #: The dir the executor named as its final artefacts (``/v1/result``), inside its work dir.
    result_dir: str = ""
    history: list[tuple[ExecutionState, float]] = field(default_factory=list)

    def transition(self, target: ExecutionState, now: float, message: str = "") -> None:
        if target not in TRANSITIONS[self.state]:
            raise IllegalTransitionError("job execution", self.state.value, target.value)
        self.state = target
        self.history.append((target, now))
        if message:
            self.message = message
        if target is ExecutionState.RUNNING:
            self.started_at = now
        if target.terminal:
            self.finished_at = now

    # ---- the job manager's moves --------------------------------------------------

    def spawned(self, now: float) -> None:
        self.transition(ExecutionState.RUNNING, now)

    def start_failed(self, now: float, message: str) -> None:
        self.transition(ExecutionState.FAILED, now, message)

    def request_stop(self, cause: StopCause, now: float, message: str = "") -> bool:
        """Begin stopping; False when there is nothing to stop (not running, or already stopping).

        A job still starting is cancelled on the spot: no process exists yet.
        """
        if self.state is ExecutionState.STARTING and cause is StopCause.CANCEL:
            self.stop_cause = cause
            self.transition(ExecutionState.CANCELLED, now, message)
            return False
        if self.state is not ExecutionState.RUNNING:
            return False
        self.stop_cause = cause
        self.transition(ExecutionState.STOPPING, now, message)
        return True

    def exited(self, exit_code: int, now: float, *, marker_found: bool | None = None) -> ExecutionState:
        """The process group is gone; settle the final state from the stop cause and the outcome.

        ``marker_found`` is None when the job has no completion marker (exit
        code decides), else whether the marker exists (it alone decides).
        """
        self.exit_code = exit_code
        if self.state is ExecutionState.STOPPING:
            assert self.stop_cause is not None
            target = _STOP_END[self.stop_cause]
            self.transition(target, now)
            return target
        if marker_found is None:
            ok = exit_code == 0 and self.reported_state != "failed"
            said = self.reported_message if self.reported_state in ("succeeded", "failed") else ""
            why = said or f"exit code {exit_code}"
        else:
            ok = marker_found
            why = "completion marker found" if ok else f"exit code {exit_code}; completion marker missing"
        target = ExecutionState.SUCCEEDED if ok else ExecutionState.FAILED
        self.transition(target, now, why)
        return target

    def report(self, state: str, message: str) -> None:
        """Record what the executor says about itself; it informs, the exit decides."""
        self.reported_state = state
        self.reported_message = message
