import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_GATEWAY: _ClassVar[Role]
    ROLE_SCHEDULER: _ClassVar[Role]
    ROLE_WORKER: _ClassVar[Role]
    ROLE_DATA: _ClassVar[Role]
    ROLE_CLIENT: _ClassVar[Role]
    ROLE_ADMIN: _ClassVar[Role]

class ExecutorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXECUTOR_KIND_UNSPECIFIED: _ClassVar[ExecutorKind]
    EXECUTOR_KIND_DILOCO_TRAINER: _ClassVar[ExecutorKind]
    EXECUTOR_KIND_PARAMETER_SERVER: _ClassVar[ExecutorKind]
    EXECUTOR_KIND_TASK: _ClassVar[ExecutorKind]
    EXECUTOR_KIND_INFERENCE: _ClassVar[ExecutorKind]

class OfferStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OFFER_STRATEGY_UNSPECIFIED: _ClassVar[OfferStrategy]
    OFFER_STRATEGY_WHOLE: _ClassVar[OfferStrategy]
    OFFER_STRATEGY_FLEXIBLE: _ClassVar[OfferStrategy]

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_TEMPORARY: _ClassVar[LeaseState]
    LEASE_STATE_ACTIVE: _ClassVar[LeaseState]
    LEASE_STATE_RELEASED: _ClassVar[LeaseState]
    LEASE_STATE_EXPIRED: _ClassVar[LeaseState]

class ModelType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_TYPE_UNSPECIFIED: _ClassVar[ModelType]
    MODEL_TYPE_CAUSAL_LM: _ClassVar[ModelType]
    MODEL_TYPE_VISION_CLASSIFICATION: _ClassVar[ModelType]
    MODEL_TYPE_TORCH: _ClassVar[ModelType]

class DeltaDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_DTYPE_UNSPECIFIED: _ClassVar[DeltaDType]
    DELTA_DTYPE_FP32: _ClassVar[DeltaDType]
    DELTA_DTYPE_BF16: _ClassVar[DeltaDType]
    DELTA_DTYPE_FP16: _ClassVar[DeltaDType]
    DELTA_DTYPE_INT8: _ClassVar[DeltaDType]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_ALLOCATING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
ROLE_UNSPECIFIED: Role
ROLE_GATEWAY: Role
ROLE_SCHEDULER: Role
ROLE_WORKER: Role
ROLE_DATA: Role
ROLE_CLIENT: Role
ROLE_ADMIN: Role
EXECUTOR_KIND_UNSPECIFIED: ExecutorKind
EXECUTOR_KIND_DILOCO_TRAINER: ExecutorKind
EXECUTOR_KIND_PARAMETER_SERVER: ExecutorKind
EXECUTOR_KIND_TASK: ExecutorKind
EXECUTOR_KIND_INFERENCE: ExecutorKind
OFFER_STRATEGY_UNSPECIFIED: OfferStrategy
OFFER_STRATEGY_WHOLE: OfferStrategy
OFFER_STRATEGY_FLEXIBLE: OfferStrategy
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_TEMPORARY: LeaseState
LEASE_STATE_ACTIVE: LeaseState
LEASE_STATE_RELEASED: LeaseState
LEASE_STATE_EXPIRED: LeaseState
MODEL_TYPE_UNSPECIFIED: ModelType
MODEL_TYPE_CAUSAL_LM: ModelType
MODEL_TYPE_VISION_CLASSIFICATION: ModelType
MODEL_TYPE_TORCH: ModelType
DELTA_DTYPE_UNSPECIFIED: DeltaDType
DELTA_DTYPE_FP32: DeltaDType
DELTA_DTYPE_BF16: DeltaDType
DELTA_DTYPE_FP16: DeltaDType
DELTA_DTYPE_INT8: DeltaDType
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_ALLOCATING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "role", "name", "addresses", "gateway_id", "manifest_sha256")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    role: Role
    name: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    gateway_id: str
    manifest_sha256: str
    def __init__(self, peer_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., name: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., gateway_id: _Optional[str] = ..., manifest_sha256: _Optional[str] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("cpu", "memory_gb", "storage_gb", "gpu", "gpu_memory_gb")
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    STORAGE_GB_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_GB_FIELD_NUMBER: _ClassVar[int]
    cpu: float
    memory_gb: float
    storage_gb: float
    gpu: float
    gpu_memory_gb: float
    def __init__(self, cpu: _Optional[float] = ..., memory_gb: _Optional[float] = ..., storage_gb: _Optional[float] = ..., gpu: _Optional[float] = ..., gpu_memory_gb: _Optional[float] = ...) -> None: ...

class Requirements(_message.Message):
    __slots__ = ("minimum", "executor")
    MINIMUM_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    minimum: Resources
    executor: ExecutorKind
    def __init__(self, minimum: _Optional[_Union[Resources, _Mapping]] = ..., executor: _Optional[_Union[ExecutorKind, str]] = ...) -> None: ...

class PriceRange(_message.Message):
    __slots__ = ("bid", "max")
    BID_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    bid: float
    max: float
    def __init__(self, bid: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class Advertisement(_message.Message):
    __slots__ = ("request_id", "scheduler_id", "scheduler_addresses", "requirements", "bid", "deadline", "count", "offer_probability")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    BID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    OFFER_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    scheduler_id: str
    scheduler_addresses: _containers.RepeatedScalarFieldContainer[str]
    requirements: Requirements
    bid: float
    deadline: _timestamp_pb2.Timestamp
    count: int
    offer_probability: float
    def __init__(self, request_id: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., scheduler_addresses: _Optional[_Iterable[str]] = ..., requirements: _Optional[_Union[Requirements, _Mapping]] = ..., bid: _Optional[float] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., count: _Optional[int] = ..., offer_probability: _Optional[float] = ...) -> None: ...

class Offer(_message.Message):
    __slots__ = ("offer_id", "request_id", "worker_id", "worker_addresses", "resources", "price", "expires_at", "executor", "samples_per_second", "success_rate", "active_leases", "capacity")
    OFFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_RATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    offer_id: str
    request_id: str
    worker_id: str
    worker_addresses: _containers.RepeatedScalarFieldContainer[str]
    resources: Resources
    price: float
    expires_at: _timestamp_pb2.Timestamp
    executor: ExecutorKind
    samples_per_second: float
    success_rate: float
    active_leases: int
    capacity: Resources
    def __init__(self, offer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., worker_addresses: _Optional[_Iterable[str]] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., price: _Optional[float] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., executor: _Optional[_Union[ExecutorKind, str]] = ..., samples_per_second: _Optional[float] = ..., success_rate: _Optional[float] = ..., active_leases: _Optional[int] = ..., capacity: _Optional[_Union[Resources, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "scheduler_id", "worker_id", "resources", "price", "expires_at", "state", "executor")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    scheduler_id: str
    worker_id: str
    resources: Resources
    price: float
    expires_at: _timestamp_pb2.Timestamp
    state: LeaseState
    executor: ExecutorKind
    def __init__(self, lease_id: _Optional[str] = ..., scheduler_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., price: _Optional[float] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., state: _Optional[_Union[LeaseState, str]] = ..., executor: _Optional[_Union[ExecutorKind, str]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data", "total_size", "sha256", "last", "content_type", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    sha256: str
    last: bool
    content_type: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ..., last: _Optional[bool] = ..., content_type: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("repository", "revision", "filenames", "token", "local_path", "type", "torch_factory", "config_overrides")
    class ConfigOverridesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILENAMES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TORCH_FACTORY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    repository: str
    revision: str
    filenames: _containers.RepeatedScalarFieldContainer[str]
    token: str
    local_path: str
    type: ModelType
    torch_factory: str
    config_overrides: _containers.ScalarMap[str, str]
    def __init__(self, repository: _Optional[str] = ..., revision: _Optional[str] = ..., filenames: _Optional[_Iterable[str]] = ..., token: _Optional[str] = ..., local_path: _Optional[str] = ..., type: _Optional[_Union[ModelType, str]] = ..., torch_factory: _Optional[str] = ..., config_overrides: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PreprocessorSpec(_message.Message):
    __slots__ = ("repository", "revision", "filenames", "token", "local_path")
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILENAMES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    repository: str
    revision: str
    filenames: _containers.RepeatedScalarFieldContainer[str]
    token: str
    local_path: str
    def __init__(self, repository: _Optional[str] = ..., revision: _Optional[str] = ..., filenames: _Optional[_Iterable[str]] = ..., token: _Optional[str] = ..., local_path: _Optional[str] = ...) -> None: ...

class AdamWConfig(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "epsilon", "weight_decay", "max_grad_norm", "warmup_steps", "decay_steps", "min_lr_ratio")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    epsilon: float
    weight_decay: float
    max_grad_norm: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., epsilon: _Optional[float] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., decay_steps: _Optional[int] = ..., min_lr_ratio: _Optional[float] = ...) -> None: ...

class NesterovConfig(_message.Message):
    __slots__ = ("learning_rate", "momentum")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    momentum: float
    def __init__(self, learning_rate: _Optional[float] = ..., momentum: _Optional[float] = ...) -> None: ...

class DilocoJobSpec(_message.Message):
    __slots__ = ("model", "preprocessor", "dataset", "inner_optimizer", "outer_optimizer", "num_workers", "worker_requirements", "parameter_server_requirements", "worker_price", "parameter_server_price", "rounds", "samples_per_round", "min_batch_size", "max_batch_size", "delta_dtype", "quorum", "round_timeout_s", "selection_policy", "gpu_memory_per_sample_gb", "delta_topk", "streaming_fragments", "overlap_sync", "trainer_executor", "update_dtype", "max_samples_per_round")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSOR_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    INNER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SERVER_REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_PRICE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SERVER_PRICE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    MIN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DELTA_DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SELECTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_PER_SAMPLE_GB_FIELD_NUMBER: _ClassVar[int]
    DELTA_TOPK_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_SYNC_FIELD_NUMBER: _ClassVar[int]
    TRAINER_EXECUTOR_FIELD_NUMBER: _ClassVar[int]
    UPDATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    preprocessor: PreprocessorSpec
    dataset: str
    inner_optimizer: AdamWConfig
    outer_optimizer: NesterovConfig
    num_workers: int
    worker_requirements: Requirements
    parameter_server_requirements: Requirements
    worker_price: PriceRange
    parameter_server_price: PriceRange
    rounds: int
    samples_per_round: int
    min_batch_size: int
    max_batch_size: int
    delta_dtype: DeltaDType
    quorum: float
    round_timeout_s: float
    selection_policy: str
    gpu_memory_per_sample_gb: float
    delta_topk: float
    streaming_fragments: int
    overlap_sync: bool
    trainer_executor: ExecutorRef
    update_dtype: DeltaDType
    max_samples_per_round: int
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., preprocessor: _Optional[_Union[PreprocessorSpec, _Mapping]] = ..., dataset: _Optional[str] = ..., inner_optimizer: _Optional[_Union[AdamWConfig, _Mapping]] = ..., outer_optimizer: _Optional[_Union[NesterovConfig, _Mapping]] = ..., num_workers: _Optional[int] = ..., worker_requirements: _Optional[_Union[Requirements, _Mapping]] = ..., parameter_server_requirements: _Optional[_Union[Requirements, _Mapping]] = ..., worker_price: _Optional[_Union[PriceRange, _Mapping]] = ..., parameter_server_price: _Optional[_Union[PriceRange, _Mapping]] = ..., rounds: _Optional[int] = ..., samples_per_round: _Optional[int] = ..., min_batch_size: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., delta_dtype: _Optional[_Union[DeltaDType, str]] = ..., quorum: _Optional[float] = ..., round_timeout_s: _Optional[float] = ..., selection_policy: _Optional[str] = ..., gpu_memory_per_sample_gb: _Optional[float] = ..., delta_topk: _Optional[float] = ..., streaming_fragments: _Optional[int] = ..., overlap_sync: _Optional[bool] = ..., trainer_executor: _Optional[_Union[ExecutorRef, _Mapping]] = ..., update_dtype: _Optional[_Union[DeltaDType, str]] = ..., max_samples_per_round: _Optional[int] = ...) -> None: ...

class ExecutorRef(_message.Message):
    __slots__ = ("executor_class", "name", "builtin_fallback")
    EXECUTOR_CLASS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUILTIN_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    executor_class: str
    name: str
    builtin_fallback: bool
    def __init__(self, executor_class: _Optional[str] = ..., name: _Optional[str] = ..., builtin_fallback: _Optional[bool] = ...) -> None: ...

class RetryPolicy(_message.Message):
    __slots__ = ("max_attempts", "backoff_base_s", "backoff_cap_s", "retry_on_timeout", "retry_on_worker_loss")
    MAX_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_BASE_S_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_CAP_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_ON_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    RETRY_ON_WORKER_LOSS_FIELD_NUMBER: _ClassVar[int]
    max_attempts: int
    backoff_base_s: float
    backoff_cap_s: float
    retry_on_timeout: bool
    retry_on_worker_loss: bool
    def __init__(self, max_attempts: _Optional[int] = ..., backoff_base_s: _Optional[float] = ..., backoff_cap_s: _Optional[float] = ..., retry_on_timeout: _Optional[bool] = ..., retry_on_worker_loss: _Optional[bool] = ...) -> None: ...

class TaskJobSpec(_message.Message):
    __slots__ = ("command", "args", "env", "requirements", "price", "timeout_s", "retry", "completion_marker", "selection_policy", "gpus", "files", "files_sha256", "files_size", "outputs")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_MARKER_FIELD_NUMBER: _ClassVar[int]
    SELECTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FILES_SHA256_FIELD_NUMBER: _ClassVar[int]
    FILES_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    command: str
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    requirements: Requirements
    price: PriceRange
    timeout_s: float
    retry: RetryPolicy
    completion_marker: str
    selection_policy: str
    gpus: int
    files: _containers.RepeatedScalarFieldContainer[str]
    files_sha256: str
    files_size: int
    outputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, command: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., requirements: _Optional[_Union[Requirements, _Mapping]] = ..., price: _Optional[_Union[PriceRange, _Mapping]] = ..., timeout_s: _Optional[float] = ..., retry: _Optional[_Union[RetryPolicy, _Mapping]] = ..., completion_marker: _Optional[str] = ..., selection_policy: _Optional[str] = ..., gpus: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., files_sha256: _Optional[str] = ..., files_size: _Optional[int] = ..., outputs: _Optional[_Iterable[str]] = ...) -> None: ...

class InferenceInput(_message.Message):
    __slots__ = ("prompt", "answer")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    answer: str
    def __init__(self, prompt: _Optional[str] = ..., answer: _Optional[str] = ...) -> None: ...

class InferenceJobSpec(_message.Message):
    __slots__ = ("model", "model_job", "model_bundle_sha256", "dataset", "inputs", "max_samples", "max_new_tokens", "batch_size", "requirements", "price", "timeout_s", "selection_policy")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_JOB_FIELD_NUMBER: _ClassVar[int]
    MODEL_BUNDLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUIREMENTS_FIELD_NUMBER: _ClassVar[int]
    PRICE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SELECTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    model: ModelSpec
    model_job: str
    model_bundle_sha256: str
    dataset: str
    inputs: _containers.RepeatedCompositeFieldContainer[InferenceInput]
    max_samples: int
    max_new_tokens: int
    batch_size: int
    requirements: Requirements
    price: PriceRange
    timeout_s: float
    selection_policy: str
    def __init__(self, model: _Optional[_Union[ModelSpec, _Mapping]] = ..., model_job: _Optional[str] = ..., model_bundle_sha256: _Optional[str] = ..., dataset: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[InferenceInput, _Mapping]]] = ..., max_samples: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., batch_size: _Optional[int] = ..., requirements: _Optional[_Union[Requirements, _Mapping]] = ..., price: _Optional[_Union[PriceRange, _Mapping]] = ..., timeout_s: _Optional[float] = ..., selection_policy: _Optional[str] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("name", "diloco", "task", "inference")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DILOCO_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    diloco: DilocoJobSpec
    task: TaskJobSpec
    inference: InferenceJobSpec
    def __init__(self, name: _Optional[str] = ..., diloco: _Optional[_Union[DilocoJobSpec, _Mapping]] = ..., task: _Optional[_Union[TaskJobSpec, _Mapping]] = ..., inference: _Optional[_Union[InferenceJobSpec, _Mapping]] = ...) -> None: ...

class WorkerMetrics(_message.Message):
    __slots__ = ("worker_id", "samples_per_second", "samples", "loss", "batch_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    samples_per_second: float
    samples: int
    loss: float
    batch_size: int
    def __init__(self, worker_id: _Optional[str] = ..., samples_per_second: _Optional[float] = ..., samples: _Optional[int] = ..., loss: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...
