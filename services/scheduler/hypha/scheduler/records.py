"""What the job store holds and hands out: plain values, converted to protobuf at the edge.

``JobRecord`` is a job as the store knows it (spec, state, progress, who
submitted it); ``JobEventRecord`` one entry of its history; ``LogRecord`` /
``LogEntry`` log lines read / to append; ``MetricRecord`` one reported figure
of one round; ``WorkerMetric`` a trainer's latest throughput and loss.
Secrets in a spec are kept for the workers but redacted in every proto that
leaves the scheduler, in one place (``JobRecord.to_proto``, the only way a
job leaves): Hugging Face tokens always, a task's ``env`` values unless the
viewer is the job's submitter or an admin (other clients see the keys, with
``***`` for each value: every client may list every job, and an environment
is where a task's author puts an API key).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hypha.jobfile.kinds import job_kind, kind_of
from hypha.pki.identity import PeerIdentity, Role
from hypha.scheduler.lifecycle import JobState
from hypha.timestamps import to_timestamp
from hypha.v1 import common_pb2, scheduler_pb2

REDACTED = "***"


def redacted(spec: common_pb2.JobSpec, *, env: bool = True) -> common_pb2.JobSpec:
    """A copy without secrets, for anything that leaves the scheduler.

    The tokens of the model sources its kind names (``JobKind.sources``)
    always become ``***``; its private environment's values too when ``env``
    (a task's ``env``: its keys stay, so a viewer still sees what it sets).
    """
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    kind = kind_of(out)
    if kind is None:
        return out
    for source in kind.sources(out).values():
        if source.token:
            source.token = REDACTED
    if env:
        private = kind.private_env(out)
        # Over a copy of the keys: writing into a protobuf map while iterating it may
        # skip entries (upb rehashes), which once let one value through unredacted.
        for key in list(private):
            private[key] = REDACTED
    return out


# ---- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerMetric:
    """One trainer's latest figures in a job."""

    worker_id: str
    samples_per_second: float = 0.0
    samples: int = 0
    loss: float = 0.0
    batch_size: int = 0

    def to_proto(self) -> common_pb2.WorkerMetrics:
        return common_pb2.WorkerMetrics(
            worker_id=self.worker_id,
            samples_per_second=self.samples_per_second,
            samples=self.samples,
            loss=self.loss,
            batch_size=self.batch_size,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.WorkerMetrics) -> WorkerMetric:
        return cls(msg.worker_id, msg.samples_per_second, msg.samples, msg.loss, msg.batch_size)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "samples_per_second": self.samples_per_second,
            "samples": self.samples,
            "loss": self.loss,
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> WorkerMetric:
        return cls(
            str(body["worker_id"]),
            float(body.get("samples_per_second", 0.0)),
            int(body.get("samples", 0)),
            float(body.get("loss", 0.0)),
            int(body.get("batch_size", 0)),
        )


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    kind: str
    spec: common_pb2.JobSpec
    state: JobState
    reason: str
    created_at: float
    updated_at: float
    round: int = 0
    loss: float = 0.0
    workers: tuple[str, ...] = ()
    attempt: int = 0
    exit_code: int = 0
    submitted_by: str = ""
    #: A PENDING job is not dispatched before this time (a retry's backoff).
    not_before: float = 0.0
    #: Where the job's result lives on the scheduler (set by orchestration).
    result_path: str = ""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rounds(self) -> int:
        return job_kind(self.kind).rounds(self.spec)

    @property
    def max_attempts(self) -> int:
        return job_kind(self.kind).max_attempts(self.spec)

    def shows_env_to(self, viewer: PeerIdentity | None) -> bool:
        """Whether ``viewer`` may read this job's ``env`` values: its submitter or an admin."""
        if viewer is None:
            return False
        return viewer.role is Role.ADMIN or (bool(self.submitted_by) and viewer.peer_id == self.submitted_by)

    def to_proto(self, viewer: PeerIdentity | None = None) -> scheduler_pb2.Job:
        """The job as ``viewer`` may see it (None: anyone; every secret redacted)."""
        return scheduler_pb2.Job(
            job_id=self.job_id,
            spec=redacted(self.spec, env=not self.shows_env_to(viewer)),
            state=self.state.to_proto(),
            reason=self.reason,
            created_at=to_timestamp(self.created_at),
            updated_at=to_timestamp(self.updated_at),
            round=self.round,
            rounds=self.rounds,
            loss=self.loss,
            workers=list(self.workers),
            attempt=self.attempt,
            exit_code=self.exit_code,
            submitted_by=self.submitted_by,
        )


@dataclass(frozen=True)
class JobEventRecord:
    """One entry of a job's history; ``kind`` is state, progress or info."""

    seq: int
    job_id: str
    at: float
    kind: str
    state: JobState
    round: int
    loss: float
    message: str
    workers: tuple[WorkerMetric, ...] = ()


@dataclass(frozen=True)
class LogRecord:
    seq: int
    job_id: str
    at: float
    stream: str
    line: str
    worker_id: str = ""
    attempt: int = 0
    worker_name: str = ""
    executor: str = ""

    def to_proto(self) -> scheduler_pb2.LogLine:
        return scheduler_pb2.LogLine(
            job_id=self.job_id,
            stream=self.stream,
            line=self.line,
            at=to_timestamp(self.at),
            worker_id=self.worker_id,
            attempt=self.attempt,
            worker_name=self.worker_name,
            executor=self.executor,
        )


@dataclass(frozen=True)
class LogEntry:
    """A log line to append; ``at`` 0 means now."""

    line: str
    stream: str = "stdout"
    worker_id: str = ""
    attempt: int = 0
    at: float = 0.0
    worker_name: str = ""
    executor: str = ""

    @classmethod
    def from_proto(cls, msg: scheduler_pb2.LogLine) -> LogEntry:
        at = msg.at.seconds + msg.at.nanos / 1e9 if msg.HasField("at") else 0.0
        return cls(
            msg.line, msg.stream or "stdout", msg.worker_id, msg.attempt, at, msg.worker_name, msg.executor
        )


@dataclass(frozen=True)
class MetricRecord:
    job_id: str
    round: int
    worker_id: str
    name: str
    value: float
    at: float


@dataclass
class RecoveryReport:
    """What ``recover`` did; the orchestrator takes ``pending`` and ``resumed`` over."""

    pending: list[JobRecord] = field(default_factory=list)
    requeued: list[JobRecord] = field(default_factory=list)
    resumed: list[JobRecord] = field(default_factory=list)
    failed: list[JobRecord] = field(default_factory=list)


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]
