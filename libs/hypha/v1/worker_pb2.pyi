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

class ExecutionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTION_STATE_UNSPECIFIED: _ClassVar[ExecutionState]
    EXECUTION_STATE_STARTING: _ClassVar[ExecutionState]
    EXECUTION_STATE_RUNNING: _ClassVar[ExecutionState]
    EXECUTION_STATE_SUCCEEDED: _ClassVar[ExecutionState]
    EXECUTION_STATE_FAILED: _ClassVar[ExecutionState]
    EXECUTION_STATE_CANCELLED: _ClassVar[ExecutionState]
    EXECUTION_STATE_TIMED_OUT: _ClassVar[ExecutionState]
EXECUTION_STATE_UNSPECIFIED: ExecutionState
EXECUTION_STATE_STARTING: ExecutionState
EXECUTION_STATE_RUNNING: ExecutionState
EXECUTION_STATE_SUCCEEDED: ExecutionState
EXECUTION_STATE_FAILED: ExecutionState
EXECUTION_STATE_CANCELLED: ExecutionState
EXECUTION_STATE_TIMED_OUT: ExecutionState

class AcceptOfferRequest(_message.Message):
    __slots__ = ("offer_id", "lease_ttl_s")
    OFFER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    offer_id: str
    lease_ttl_s: float
    def __init__(self, offer_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class ReleaseOfferRequest(_message.Message):
    __slots__ = ("offer_id",)
    OFFER_ID_FIELD_NUMBER: _ClassVar[int]
    offer_id: str
    def __init__(self, offer_id: _Optional[str] = ...) -> None: ...

class ReleaseOfferResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DispatchJobRequest(_message.Message):
    __slots__ = ("job_id", "lease_id", "executor", "spec", "parameter_server_id", "parameter_server_addresses", "trainer_ids", "scheduler_addresses", "batch_size", "attempt", "start_round", "cuda_devices", "files_bundle")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SERVER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_IDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    START_ROUND_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICES_FIELD_NUMBER: _ClassVar[int]
    FILES_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lease_id: str
    executor: _common_pb2.ExecutorKind
    spec: _common_pb2.JobSpec
    parameter_server_id: str
    parameter_server_addresses: _containers.RepeatedScalarFieldContainer[str]
    trainer_ids: _containers.RepeatedScalarFieldContainer[str]
    scheduler_addresses: _containers.RepeatedScalarFieldContainer[str]
    batch_size: int
    attempt: int
    start_round: int
    cuda_devices: _containers.RepeatedScalarFieldContainer[str]
    files_bundle: bytes
    def __init__(self, job_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., executor: _Optional[_Union[_common_pb2.ExecutorKind, str]] = ..., spec: _Optional[_Union[_common_pb2.JobSpec, _Mapping]] = ..., parameter_server_id: _Optional[str] = ..., parameter_server_addresses: _Optional[_Iterable[str]] = ..., trainer_ids: _Optional[_Iterable[str]] = ..., scheduler_addresses: _Optional[_Iterable[str]] = ..., batch_size: _Optional[int] = ..., attempt: _Optional[int] = ..., start_round: _Optional[int] = ..., cuda_devices: _Optional[_Iterable[str]] = ..., files_bundle: _Optional[bytes] = ...) -> None: ...

class DispatchJobResponse(_message.Message):
    __slots__ = ("execution_id",)
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    def __init__(self, execution_id: _Optional[str] = ...) -> None: ...

class CancelExecutionRequest(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class GetJobStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WorkerJobStatus(_message.Message):
    __slots__ = ("job_id", "state", "exit_code", "message", "started_at", "finished_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: ExecutionState
    exit_code: int
    message: str
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[ExecutionState, str]] = ..., exit_code: _Optional[int] = ..., message: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("job_id", "round", "kind", "samples", "chunk")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    kind: str
    samples: int
    chunk: _common_pb2.Chunk
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[str] = ..., samples: _Optional[int] = ..., chunk: _Optional[_Union[_common_pb2.Chunk, _Mapping]] = ...) -> None: ...

class PushTensorsResponse(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PullTensorsRequest(_message.Message):
    __slots__ = ("job_id", "kind", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class GetWorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("peer_id", "name", "capacity", "free", "leases", "jobs", "executors", "price", "floor")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    name: str
    capacity: _common_pb2.Resources
    free: _common_pb2.Resources
    leases: _containers.RepeatedCompositeFieldContainer[_common_pb2.Lease]
    jobs: _containers.RepeatedCompositeFieldContainer[WorkerJobStatus]
    executors: _containers.RepeatedScalarFieldContainer[_common_pb2.ExecutorKind]
    price: float
    floor: float
    def __init__(self, peer_id: _Optional[str] = ..., name: _Optional[str] = ..., capacity: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., free: _Optional[_Union[_common_pb2.Resources, _Mapping]] = ..., leases: _Optional[_Iterable[_Union[_common_pb2.Lease, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[WorkerJobStatus, _Mapping]]] = ..., executors: _Optional[_Iterable[_Union[_common_pb2.ExecutorKind, str]]] = ..., price: _Optional[float] = ..., floor: _Optional[float] = ...) -> None: ...
