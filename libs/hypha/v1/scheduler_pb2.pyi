import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from hypha.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DirectiveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIRECTIVE_KIND_UNSPECIFIED: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_CONTINUE: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_SYNC_AFTER: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_SYNC_NOW: _ClassVar[DirectiveKind]
    DIRECTIVE_KIND_DONE: _ClassVar[DirectiveKind]

class ExecutionStateReport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTION_STATE_REPORT_UNSPECIFIED: _ClassVar[ExecutionStateReport]
    EXECUTION_STATE_REPORT_RUNNING: _ClassVar[ExecutionStateReport]
    EXECUTION_STATE_REPORT_SUCCEEDED: _ClassVar[ExecutionStateReport]
    EXECUTION_STATE_REPORT_FAILED: _ClassVar[ExecutionStateReport]
    EXECUTION_STATE_REPORT_CANCELLED: _ClassVar[ExecutionStateReport]
    EXECUTION_STATE_REPORT_TIMED_OUT: _ClassVar[ExecutionStateReport]
DIRECTIVE_KIND_UNSPECIFIED: DirectiveKind
DIRECTIVE_KIND_CONTINUE: DirectiveKind
DIRECTIVE_KIND_SYNC_AFTER: DirectiveKind
DIRECTIVE_KIND_SYNC_NOW: DirectiveKind
DIRECTIVE_KIND_DONE: DirectiveKind
EXECUTION_STATE_REPORT_UNSPECIFIED: ExecutionStateReport
EXECUTION_STATE_REPORT_RUNNING: ExecutionStateReport
EXECUTION_STATE_REPORT_SUCCEEDED: ExecutionStateReport
EXECUTION_STATE_REPORT_FAILED: ExecutionStateReport
EXECUTION_STATE_REPORT_CANCELLED: ExecutionStateReport
EXECUTION_STATE_REPORT_TIMED_OUT: ExecutionStateReport

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec", "toml", "files_bundle")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TOML_FIELD_NUMBER: _ClassVar[int]
    FILES_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.JobSpec
    toml: str
    files_bundle: bytes
    def __init__(self, spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., toml: _Optional[str] = ..., files_bundle: _Optional[bytes] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "spec", "state", "reason", "created_at", "updated_at", "round", "rounds", "loss", "workers", "attempt", "exit_code", "submitted_by")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_BY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec: _common_pb2.JobSpec
    state: _common_pb2.JobState
    reason: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    round: int
    rounds: int
    loss: float
    workers: _containers.RepeatedScalarFieldContainer[str]
    attempt: int
    exit_code: int
    submitted_by: str
    def __init__(self, job_id: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.JobState, str]] = ..., reason: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., round: _Optional[int] = ..., rounds: _Optional[int] = ..., loss: _Optional[float] = ..., workers: _Optional[_Iterable[str]] = ..., attempt: _Optional[int] = ..., exit_code: _Optional[int] = ..., submitted_by: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[_common_pb2.JobState]
    def __init__(self, states: _Optional[_Iterable[_Union[_common_pb2.JobState, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "all")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    all: bool
    def __init__(self, job_id: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class CancelJobsResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cancelled: _Optional[_Iterable[str]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job", "at", "message", "workers")
    JOB_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    job: Job
    at: _timestamp_pb2.Timestamp
    message: str
    workers: _containers.RepeatedCompositeFieldContainer[_common_pb2.WorkerMetrics]
    def __init__(self, job: _Optional[_Union[Job, _Mapping]] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[_common_pb2.WorkerMetrics, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerView(_message.Message):
    __slots__ = ("peer", "capacity", "leased", "leases", "healthy", "samples_per_second", "job_id", "last_seen")
    PEER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    peer: _common_pb2.PeerInfo
    capacity: _common_pb2.Resources
    leased: _common_pb2.Resources
    leases: _containers.RepeatedCompositeFieldContainer[_common_pb2.Lease]
    healthy: bool
    samples_per_second: float
    job_id: str
    last_seen: _timestamp_pb2.Timestamp
    def __init__(self, peer: _Optional[_Union[_common_pb2.PeerInfo, _Mapping]] = ..., capacity: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., leased: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., leases: _Optional[_Iterable[_Union[_common_pb2.Lease, _Mapping]]] = ..., healthy: _Optional[bool] = ..., samples_per_second: _Optional[float] = ..., job_id: _Optional[str] = ..., last_seen: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerView]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerView, _Mapping]]] = ...) -> None: ...

class GetLogsRequest(_message.Message):
    __slots__ = ("job_id", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class LogLine(_message.Message):
    __slots__ = ("job_id", "stream", "line", "at", "worker_id", "attempt", "worker_name", "executor")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    stream: str
    line: str
    at: _timestamp_pb2.Timestamp
    worker_id: str
    attempt: int
    worker_name: str
    executor: str
    def __init__(self, job_id: _Optional[str] = ..., stream: _Optional[str] = ..., line: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., worker_id: _Optional[str] = ..., attempt: _Optional[int] = ..., worker_name: _Optional[str] = ..., executor: _Optional[str] = ...) -> None: ...

class FetchResultRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "chunk")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    path: str
    chunk: _common_pb2.Chunk
    def __init__(self, path: _Optional[str] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class GetJobMetricsRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ScaleJobRequest(_message.Message):
    __slots__ = ("job_id", "workers")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    workers: int
    def __init__(self, job_id: _Optional[str] = ..., workers: _Optional[int] = ...) -> None: ...

class MetricPoint(_message.Message):
    __slots__ = ("round", "worker_id", "name", "value", "at")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    round: int
    worker_id: str
    name: str
    value: float
    at: _timestamp_pb2.Timestamp
    def __init__(self, round: _Optional[int] = ..., worker_id: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[float] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class JobMetrics(_message.Message):
    __slots__ = ("points",)
    POINTS_FIELD_NUMBER: _ClassVar[int]
    points: _containers.RepeatedCompositeFieldContainer[MetricPoint]
    def __init__(self, points: _Optional[_Iterable[_Union[MetricPoint, _Mapping]]] = ...) -> None: ...

class SubmitOfferResponse(_message.Message):
    __slots__ = ("received",)
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    received: bool
    def __init__(self, received: _Optional[bool] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("job_id", "round", "batches", "samples", "loss", "batch_seconds", "batch_size", "next_batch_started")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCH_STARTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    batches: int
    samples: int
    loss: float
    batch_seconds: float
    batch_size: int
    next_batch_started: bool
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., batches: _Optional[int] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., batch_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., next_batch_started: _Optional[bool] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("kind", "batches", "round")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    kind: DirectiveKind
    batches: int
    round: int
    def __init__(self, kind: _Optional[_Union[DirectiveKind, str]] = ..., batches: _Optional[int] = ..., round: _Optional[int] = ...) -> None: ...

class NextSliceRequest(_message.Message):
    __slots__ = ("job_id", "used")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    used: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, job_id: _Optional[str] = ..., used: _Optional[_Iterable[int]] = ...) -> None: ...

class NextSliceResponse(_message.Message):
    __slots__ = ("available", "index", "epoch", "dataset", "providers")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    available: bool
    index: int
    epoch: int
    dataset: str
    providers: _containers.RepeatedCompositeFieldContainer[_common_pb2.PeerInfo]
    def __init__(self, available: _Optional[bool] = ..., index: _Optional[int] = ..., epoch: _Optional[int] = ..., dataset: _Optional[str] = ..., providers: _Optional[_Iterable[_Union[_common_pb2.PeerInfo, _Mapping]]] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("job_id", "round", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    values: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricsAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobStatusReport(_message.Message):
    __slots__ = ("job_id", "state", "exit_code", "message", "attempt")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: ExecutionStateReport
    exit_code: int
    message: str
    attempt: int
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[ExecutionStateReport, str]] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class JobStatusAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LogsAck(_message.Message):
    __slots__ = ("lines",)
    LINES_FIELD_NUMBER: _ClassVar[int]
    lines: int
    def __init__(self, lines: _Optional[int] = ...) -> None: ...
