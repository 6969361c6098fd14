"""Job files: TOML in, a validated ``hypha.v1.JobSpec`` out.

A job file holds one ``[job]`` table; a scheduler config's ``[scheduler.job]``
section (the reference system's scheduler-config form) is accepted as well, and the rest of that file (the
scheduler's own settings) is ignored. ``kind`` is ``diloco``, ``task`` or
``inference`` (its keys: ``hypha.jobfile_inference``); when absent it is inferred
(``command`` means a task, ``model_job``/``inputs`` inference, ``model``/``dataset``
DiLoCo). Every error is an ``InvalidArgumentError`` whose message starts
with the dotted key, e.g. ``job.resources.worker_price.bid: must be a
number``; unknown keys are refused by name, so a typo never silently falls
back to a default.

DiLoCo job::

    [job]
    name = "gpt2-small"
    dataset = "tiny-shakespeare"        # or [job.dataset] dataset = "..."
    rounds = 10                          # outer rounds
    samples_per_round = 1024             # samples all trainers process between syncs
    min_batch_size = 1
    max_batch_size = 64
    gpu_memory_per_sample_gb = 0.5       # for per-worker batch sizing; 0: unknown
    delta_dtype = "fp32"                 # fp32 | bf16 | fp16 | int8 (block-wise, error feedback)
    delta_topk = 0.0                     # fraction of each delta's entries sent; 0: all
    streaming_fragments = 0              # F >= 2: each round syncs 1/F of the model (streaming)
    quorum = 0.5                         # fraction of trainers that completes a late round
    round_timeout_s = 300
    selection_policy = ""                # "": the scheduler's default
    [job.model]
    repository = "owner/repo"            # or local_path = "/models/x"
    revision = "main"
    filenames = ["config.json", "model.safetensors"]
    type = "causal-lm"                   # causal-lm | vision-classification | torch
    [job.inner_optimizer]                # AdamW
    learning_rate = 1e-3
    betas = [0.9, 0.999]
    [job.outer_optimizer]                # Nesterov
    learning_rate = 0.7
    momentum = 0.9
    [job.resources]
    num_workers = 2
    worker = { cpu = 1, memory_gb = 2 }  # or the list form: [[...worker]] of {type, min} / {kind}
    worker_price = { bid = 1.0, max = 2.0 }

Task job::

    [job]
    command = "python"
    args = ["train.py", "--epochs", "3"]
    env = { SEED = "1" }
    gpus = 0
    timeout_s = 600                      # 0: none
    completion_marker = "out/done.txt"   # relative to the task's work dir
    files = ["train.py", "data/"]        # shipped: relative to the job file, unpacked into the work dir
    outputs = ["model/", "metrics.json"] # kept after success as the job's result (hypha fetch)
    resources = { cpu = 1, memory_gb = 1 }
    price = { bid = 1.0, max = 2.0 }
    [job.retry]
    max_attempts = 3
    backoff_base_s = 2.0
    backoff_cap_s = 60.0
    retry_on_timeout = true
    retry_on_worker_loss = true

Requirement lists (the reference scheduler config's form) map ``type = "GPU"`` to GPU
memory in GB (that form sizes it in GB), ``CPU`` to cores, ``Memory`` and
``Storage`` to GB, ``GPUs`` to a GPU count; ``kind = "diloco-transformer"``
(the reference system's executor name) means ``diloco-trainer``. In the
table form keys are the ``Resources`` fields: cpu, memory_gb, storage_gb,
gpu (count), gpu_memory_gb.

Prices of 0 (or absent) mean "the scheduler's configured default".
Structured submissions (``SubmitJobRequest.spec``) go through
``normalize_spec``: the same defaults and the same checks, with errors named
by proto field (``spec.diloco.num_workers``).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any

from hypha import jobfile_inference
from hypha.bundles import check_relative
from hypha.errors import InvalidArgumentError
from hypha.market.policies import POLICY_NAMES
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2

#: Largest job file accepted, in bytes (a job file is configuration, not data).
MAX_JOB_FILE_BYTES = 256 * 1024

KINDS = ("diloco", "task", "inference")

MODEL_TYPES: dict[str, common_pb2.ModelType] = {
    "causal-lm": common_pb2.MODEL_TYPE_CAUSAL_LM,
    "vision-classification": common_pb2.MODEL_TYPE_VISION_CLASSIFICATION,
    "image-classification": common_pb2.MODEL_TYPE_VISION_CLASSIFICATION,  # the reference system's name
    "torch": common_pb2.MODEL_TYPE_TORCH,
}
DELTA_DTYPES: dict[str, common_pb2.DeltaDType] = {
    "fp32": common_pb2.DELTA_DTYPE_FP32,
    "bf16": common_pb2.DELTA_DTYPE_BF16,
    "fp16": common_pb2.DELTA_DTYPE_FP16,
    "int8": common_pb2.DELTA_DTYPE_INT8,
}
#: Smallest ``delta_topk`` accepted (hypha.tensors.quant.MIN_TOPK; torch-free here).
MIN_DELTA_TOPK = 1e-4
#: Most streaming fragments a job may ask for (each needs at least one parameter tensor).
MAX_STREAMING_FRAGMENTS = 1024
#: Largest integer a job file may give (every integer field of a JobSpec holds it).
MAX_INTEGER = 2**31 - 1
#: Requirement ``type`` names of the list form -> Resources field.
RESOURCE_TYPES: dict[str, str] = {
    "gpu": "gpu_memory_gb",
    "gpus": "gpu",
    "gpucount": "gpu",
    "cpu": "cpu",
    "memory": "memory_gb",
    "storage": "storage_gb",
}
RESOURCE_FIELDS = ("cpu", "memory_gb", "storage_gb", "gpu", "gpu_memory_gb")
EXECUTOR_ALIASES = {"diloco-transformer": ExecutorKind.DILOCO_TRAINER}


class Defaults:
    """Values a job gets for what its file leaves out."""

    ROUNDS = 10
    SAMPLES_PER_ROUND = 1024
    MIN_BATCH_SIZE = 1
    MAX_BATCH_SIZE = 64
    QUORUM = 0.5
    ROUND_TIMEOUT_S = 300.0
    NUM_WORKERS = 1
    INNER_LR = 1e-3
    BETA1 = 0.9
    BETA2 = 0.999
    EPSILON = 1e-8
    WEIGHT_DECAY = 0.01
    OUTER_LR = 0.7
    MOMENTUM = 0.9
    MAX_ATTEMPTS = 3
    BACKOFF_BASE_S = 2.0
    BACKOFF_CAP_S = 60.0


# ---- reading typed values out of a TOML table, naming the key on error ----------------


def _bad(path: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path}: {message}")


class _Table:
    """A TOML table being read: typed getters that name the dotted key, and a
    final ``done()`` that refuses every key nobody asked for."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise _bad(path, "must be a table")
        self.data = data
        self.path = path
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}"

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str) -> Any:
        self.seen.add(name)
        # TOML has no null; a JSON body's null would otherwise read as "absent".
        if name in self.data and self.data[name] is None:
            raise _bad(self.key(name), "must not be null (leave the key out for its default)")
        return self.data.get(name)

    def string(self, name: str, default: str = "", *, required: bool = False) -> str:
        value = self.raw(name)
        if value is None:
            if required:
                raise _bad(self.key(name), "missing (required)")
            return default
        if not isinstance(value, str):
            raise _bad(self.key(name), "must be a string")
        if required and not value.strip():
            raise _bad(self.key(name), "must not be empty")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _bad(self.key(name), "must be a number")
        if not math.isfinite(value):
            raise _bad(self.key(name), "must be a finite number")
        return float(value)

    def integer(self, name: str, default: int) -> int:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(self.key(name), "must be an integer")
        if value < 0:
            raise _bad(self.key(name), "must not be negative")
        if value > MAX_INTEGER:
            raise _bad(self.key(name), f"must be at most {MAX_INTEGER}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _bad(self.key(name), "must be true or false")
        return value

    def strings(self, name: str) -> list[str]:
        value = self.raw(name)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _bad(self.key(name), "must be a list of strings")
        return list(value)

    def string_map(self, name: str) -> dict[str, str]:
        """A table of scalars, kept as strings (environment, config overrides)."""
        value = self.raw(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise _bad(self.key(name), "must be a table")
        out: dict[str, str] = {}
        for k, v in value.items():
            if isinstance(v, bool):
                out[k] = "true" if v else "false"
            elif isinstance(v, str | int | float):
                out[k] = str(v)
            else:
                raise _bad(f"{self.key(name)}.{k}", "must be a string or number")
        return out

    def table(self, name: str) -> _Table | None:
        value = self.raw(name)
        return None if value is None else _Table(value, self.key(name))

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise _bad(self.key(unknown[0]), f"unknown key (known here: {known})")


# ---- entry points -----------------------------------------------------------------------


def parse_job_toml(text: str) -> common_pb2.JobSpec:
    """Parse a job file's text (``[job]`` or ``[scheduler.job]``) into a validated JobSpec."""
    if len(text.encode("utf-8", errors="replace")) > MAX_JOB_FILE_BYTES:
        raise InvalidArgumentError(f"job file: larger than {MAX_JOB_FILE_BYTES} bytes")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise InvalidArgumentError(f"job file: invalid TOML: {err}") from None
    return parse_job_document(data)


def parse_job_document(data: Mapping[str, Any]) -> common_pb2.JobSpec:
    """A parsed job file (a dict with ``job`` or ``scheduler.job``) -> JobSpec."""
    if "job" in data:
        for key in data:
            if key != "job":
                raise _bad(key, "unknown key (a job file holds one [job] table)")
        return parse_job_table(data["job"], "job")
    scheduler = data.get("scheduler")
    if isinstance(scheduler, Mapping) and "job" in scheduler:
        return parse_job_table(scheduler["job"], "scheduler.job")
    raise _bad("job", "missing: a job file needs a [job] table (or [scheduler.job] as in a scheduler config)")


def parse_job_table(data: Any, path: str = "job", *, kind: str | None = None) -> common_pb2.JobSpec:
    """One job table (as TOML or JSON gives it) -> JobSpec; ``kind`` forces the job kind."""
    table = _Table(data, path)
    declared = table.string("kind") or table.string("type")
    if kind is not None and declared and declared != kind:
        raise _bad(table.key("kind"), f"must be {kind!r} here")
    kind = kind or declared or _infer_kind(table)
    if kind not in KINDS:
        raise _bad(table.key("kind"), f"unknown job kind {kind!r} (valid: {', '.join(KINDS)})")
    name = table.string("name")
    if len(name) > 128:
        raise _bad(table.key("name"), "longer than 128 characters")
    spec = common_pb2.JobSpec(name=name)
    if kind == "diloco":
        spec.diloco.CopyFrom(_diloco(table))
        table.done()
        _check_diloco(spec.diloco, _diloco_key(path))
    elif kind == "inference":
        spec.inference.CopyFrom(jobfile_inference.inference_table(table))
        table.done()
        jobfile_inference.check_inference(spec.inference, jobfile_inference.inference_key(path))
    else:
        spec.task.CopyFrom(_task(table))
        table.done()
        _check_task(spec.task, _task_key(path))
    return spec


def normalize_spec(spec: common_pb2.JobSpec, path: str = "spec") -> common_pb2.JobSpec:
    """A structured JobSpec with defaults filled in for unset (zero) fields, checked like a job file."""
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    if len(out.name) > 128:
        raise _bad(f"{path}.name", "longer than 128 characters")
    which = out.WhichOneof("kind")
    if which == "diloco":
        _diloco_defaults(out.diloco)
        _check_diloco(out.diloco, lambda field: f"{path}.diloco.{field}")
    elif which == "task":
        _task_defaults(out.task)
        _check_task(out.task, lambda field: f"{path}.task.{field}")
    elif which == "inference":
        jobfile_inference.inference_defaults(out.inference)
        jobfile_inference.check_inference(out.inference, lambda field: f"{path}.inference.{field}")
    else:
        raise _bad(f"{path}.kind", "missing: set diloco, task or inference")
    return out


def job_kind(spec: common_pb2.JobSpec) -> str:
    return spec.WhichOneof("kind") or ""


def _infer_kind(table: _Table) -> str:
    if table.has("command"):
        return "task"
    if table.has("model_job") or table.has("inputs"):
        return "inference"
    if table.has("model") or table.has("dataset"):
        return "diloco"
    raise _bad(table.key("kind"), 'missing: set kind = "diloco", "task" or "inference"')


# ---- DiLoCo -------------------------------------------------------------------------------


def _diloco(table: _Table) -> common_pb2.DilocoJobSpec:
    d = common_pb2.DilocoJobSpec()
    model = table.table("model")
    if model is None:
        raise _bad(table.key("model"), "missing (required)")
    d.model.CopyFrom(_model(model))
    pre = table.table("preprocessor")
    if pre is not None:
        d.preprocessor.CopyFrom(_preprocessor(pre))
    d.dataset = _dataset(table)
    d.inner_optimizer.CopyFrom(_adamw(table.table("inner_optimizer")))
    d.outer_optimizer.CopyFrom(_nesterov(table.table("outer_optimizer")))
    _diloco_resources(table.table("resources"), table.key("resources"), d)
    rounds_value = table.data.get("rounds")
    if isinstance(rounds_value, Mapping):
        # The reference system's [job.rounds] table.
        rounds = table.table("rounds")
        assert rounds is not None
        d.rounds = rounds.integer("update_rounds", rounds.integer("count", Defaults.ROUNDS))
        d.samples_per_round = rounds.integer(
            "avg_samples_between_updates", rounds.integer("samples_per_round", Defaults.SAMPLES_PER_ROUND)
        )
        d.min_batch_size = rounds.integer("min_batch_size", Defaults.MIN_BATCH_SIZE)
        d.max_batch_size = rounds.integer("max_batch_size", Defaults.MAX_BATCH_SIZE)
        rounds.done()
    else:
        d.rounds = table.integer("rounds", Defaults.ROUNDS)
    d.samples_per_round = table.integer(
        "samples_per_round", d.samples_per_round or Defaults.SAMPLES_PER_ROUND
    )
    d.min_batch_size = table.integer("min_batch_size", d.min_batch_size or Defaults.MIN_BATCH_SIZE)
    d.max_batch_size = table.integer("max_batch_size", d.max_batch_size or Defaults.MAX_BATCH_SIZE)
    dtype = table.string("delta_dtype", "fp32").lower()
    if dtype not in DELTA_DTYPES:
        raise _bad(table.key("delta_dtype"), f"unknown dtype {dtype!r} (valid: {', '.join(DELTA_DTYPES)})")
    d.delta_dtype = DELTA_DTYPES[dtype]
    d.delta_topk = table.number("delta_topk", 0.0)
    d.streaming_fragments = table.integer("streaming_fragments", 0)
    d.quorum = table.number("quorum", Defaults.QUORUM)
    d.round_timeout_s = table.number("round_timeout_s", Defaults.ROUND_TIMEOUT_S)
    d.selection_policy = table.string("selection_policy")
    d.gpu_memory_per_sample_gb = table.number("gpu_memory_per_sample_gb", 0.0)
    return d


def _model(t: _Table) -> common_pb2.ModelSpec:
    m = common_pb2.ModelSpec(
        repository=t.string("repository"),
        revision=t.string("revision"),
        filenames=t.strings("filenames"),
        token=t.string("token"),
        local_path=t.string("local_path"),
        torch_factory=t.string("torch_factory"),
    )
    kind = t.string("type", "causal-lm")
    if kind not in MODEL_TYPES:
        raise _bad(
            t.key("type"), f"unknown model type {kind!r} (valid: causal-lm, vision-classification, torch)"
        )
    m.type = MODEL_TYPES[kind]
    m.config_overrides.update(t.string_map("config_overrides"))
    t.done()
    return m


def _preprocessor(t: _Table) -> common_pb2.PreprocessorSpec:
    p = common_pb2.PreprocessorSpec(
        repository=t.string("repository"),
        revision=t.string("revision"),
        filenames=t.strings("filenames"),
        token=t.string("token"),
        local_path=t.string("local_path"),
    )
    t.done()
    if not (p.repository or p.local_path):
        raise _bad(t.key("repository"), "missing: set repository or local_path")
    return p


def _dataset(table: _Table) -> str:
    value = table.data.get("dataset")
    if isinstance(value, Mapping):
        sub = table.table("dataset")
        assert sub is not None
        name = sub.string("dataset", required=True)
        sub.done()
        return name
    return table.string("dataset", required=True)


def _adamw(t: _Table | None) -> common_pb2.AdamWConfig:
    a = common_pb2.AdamWConfig(
        learning_rate=Defaults.INNER_LR,
        beta1=Defaults.BETA1,
        beta2=Defaults.BETA2,
        epsilon=Defaults.EPSILON,
        weight_decay=Defaults.WEIGHT_DECAY,
    )
    if t is None:
        return a
    a.learning_rate = t.number("learning_rate", a.learning_rate)
    betas = t.raw("betas")
    if betas is not None:
        if (
            not isinstance(betas, list)
            or len(betas) != 2
            or any(isinstance(b, bool) or not isinstance(b, int | float) for b in betas)
        ):
            raise _bad(t.key("betas"), "must be a list of two numbers")
        a.beta1, a.beta2 = float(betas[0]), float(betas[1])
    a.beta1 = t.number("beta1", a.beta1)
    a.beta2 = t.number("beta2", a.beta2)
    a.epsilon = t.number("epsilon", a.epsilon)
    a.weight_decay = t.number("weight_decay", a.weight_decay)
    t.done()
    return a


def _nesterov(t: _Table | None) -> common_pb2.NesterovConfig:
    n = common_pb2.NesterovConfig(learning_rate=Defaults.OUTER_LR, momentum=Defaults.MOMENTUM)
    if t is None:
        return n
    n.learning_rate = t.number("learning_rate", n.learning_rate)
    n.momentum = t.number("momentum", n.momentum)
    t.done()
    return n


def _diloco_resources(t: _Table | None, path: str, d: common_pb2.DilocoJobSpec) -> None:
    d.num_workers = Defaults.NUM_WORKERS
    d.worker_requirements.executor = common_pb2.EXECUTOR_KIND_DILOCO_TRAINER
    d.parameter_server_requirements.executor = common_pb2.EXECUTOR_KIND_PARAMETER_SERVER
    if t is None:
        return
    d.num_workers = t.integer("num_workers", Defaults.NUM_WORKERS)
    if t.has("worker"):
        d.worker_requirements.CopyFrom(
            _requirements(t.raw("worker"), t.key("worker"), ExecutorKind.DILOCO_TRAINER)
        )
    if t.has("parameter_server"):
        d.parameter_server_requirements.CopyFrom(
            _requirements(t.raw("parameter_server"), t.key("parameter_server"), ExecutorKind.PARAMETER_SERVER)
        )
    d.worker_price.CopyFrom(_price(t.table("worker_price")))
    d.parameter_server_price.CopyFrom(_price(t.table("parameter_server_price")))
    t.done()


def _requirements(value: Any, path: str, executor: ExecutorKind) -> common_pb2.Requirements:
    """A requirement table ({cpu = 1, ...}) or the list form ([{type, min}, {kind}])."""
    minimum: dict[str, float] = {}
    kind_name: str | None = None
    kind_path = path
    if isinstance(value, list):
        for i, item in enumerate(value):
            entry = _Table(item, f"{path}[{i}]")
            if entry.has("kind"):
                kind_name, kind_path = entry.string("kind", required=True), entry.key("kind")
            else:
                rtype = entry.string("type", required=True)
                field = RESOURCE_TYPES.get(rtype.lower())
                if field is None:
                    raise _bad(
                        entry.key("type"),
                        f"unknown resource type {rtype!r} (valid: GPU, GPUs, CPU, Memory, Storage)",
                    )
                if not entry.has("min"):
                    raise _bad(entry.key("min"), "missing (required)")
                minimum[field] = entry.number("min", 0.0)
            entry.done()
    elif isinstance(value, Mapping):
        table = _Table(value, path)
        for field in RESOURCE_FIELDS:
            if table.has(field):
                minimum[field] = table.number(field, 0.0)
        for alias in ("executor", "kind"):
            if table.has(alias):
                kind_name, kind_path = table.string(alias, required=True), table.key(alias)
        table.done()
    else:
        raise _bad(path, "must be a table or a list of requirement tables")
    for field, amount in minimum.items():
        if amount < 0:
            raise _bad(path, f"{field} must not be negative")
    if kind_name is not None:
        kind = EXECUTOR_ALIASES.get(kind_name)
        if kind is None:
            try:
                kind = ExecutorKind.parse(kind_name)
            except InvalidArgumentError as err:
                raise _bad(kind_path, err.message) from None
        if kind is not executor:
            raise _bad(kind_path, f"must be {executor.value} here, not {kind.value}")
    return common_pb2.Requirements(minimum=common_pb2.Resources(**minimum), executor=executor.to_proto())


def _price(t: _Table | None) -> common_pb2.PriceRange:
    if t is None:
        return common_pb2.PriceRange()
    bid = t.number("bid", -1.0) if t.has("bid") else None
    cap = t.number("max", -1.0) if t.has("max") else None
    t.done()
    if bid is None and cap is None:
        return common_pb2.PriceRange()
    bid = cap if bid is None else bid
    cap = bid if cap is None else cap
    assert bid is not None and cap is not None
    return common_pb2.PriceRange(bid=bid, max=cap)


def _diloco_defaults(d: common_pb2.DilocoJobSpec) -> None:
    """Fill unset (zero) fields of a structured DiLoCo spec."""
    d.rounds = d.rounds or Defaults.ROUNDS
    d.samples_per_round = d.samples_per_round or Defaults.SAMPLES_PER_ROUND
    d.min_batch_size = d.min_batch_size or Defaults.MIN_BATCH_SIZE
    d.max_batch_size = d.max_batch_size or Defaults.MAX_BATCH_SIZE
    d.num_workers = d.num_workers or Defaults.NUM_WORKERS
    d.quorum = d.quorum or Defaults.QUORUM
    d.round_timeout_s = d.round_timeout_s or Defaults.ROUND_TIMEOUT_S
    d.delta_dtype = d.delta_dtype or common_pb2.DELTA_DTYPE_FP32
    d.model.type = d.model.type or common_pb2.MODEL_TYPE_CAUSAL_LM
    # A message left out gets every default; one that is set keeps its zeros
    # (a momentum or beta of 0 is a legitimate choice), except where 0 is invalid.
    if not d.HasField("inner_optimizer"):
        d.inner_optimizer.CopyFrom(_adamw(None))
    d.inner_optimizer.learning_rate = d.inner_optimizer.learning_rate or Defaults.INNER_LR
    d.inner_optimizer.epsilon = d.inner_optimizer.epsilon or Defaults.EPSILON
    if not d.HasField("outer_optimizer"):
        d.outer_optimizer.CopyFrom(_nesterov(None))
    d.outer_optimizer.learning_rate = d.outer_optimizer.learning_rate or Defaults.OUTER_LR
    d.worker_requirements.executor = common_pb2.EXECUTOR_KIND_DILOCO_TRAINER
    d.parameter_server_requirements.executor = common_pb2.EXECUTOR_KIND_PARAMETER_SERVER


def _diloco_key(path: str) -> Callable[[str], str]:
    """Proto field path -> the job file key a user would fix."""
    renames = {
        "num_workers": "resources.num_workers",
        "worker_requirements": "resources.worker",
        "parameter_server_requirements": "resources.parameter_server",
        "worker_price": "resources.worker_price",
        "parameter_server_price": "resources.parameter_server_price",
        "inner_optimizer.beta1": "inner_optimizer.betas",
        "inner_optimizer.beta2": "inner_optimizer.betas",
    }

    def key(field: str) -> str:
        for proto, toml_key in renames.items():
            if field == proto or field.startswith(proto + "."):
                return f"{path}.{toml_key}{field[len(proto) :]}"
        return f"{path}.{field}"

    return key


def _check_diloco(d: common_pb2.DilocoJobSpec, key: Callable[[str], str]) -> None:
    m = d.model
    if m.type == common_pb2.MODEL_TYPE_TORCH:
        if not (m.torch_factory or m.local_path or m.repository):
            raise _bad(key("model.torch_factory"), "missing: a torch model needs torch_factory or local_path")
    elif not (m.repository or m.local_path):
        raise _bad(key("model.repository"), "missing: set repository or local_path")
    if m.type not in MODEL_TYPES.values():
        raise _bad(key("model.type"), "unknown model type")
    for name, local in (("model", m.local_path), ("preprocessor", d.preprocessor.local_path)):
        # A path on the workers, not on the submitting machine: nothing can resolve a relative one.
        if local and not local.startswith(("/", "~")):
            raise _bad(key(f"{name}.local_path"), f"{local!r} must be absolute (a path on the workers)")
    if not d.dataset.strip():
        raise _bad(key("dataset"), "missing (required)")
    _positive(d.rounds, key("rounds"))
    _positive(d.samples_per_round, key("samples_per_round"))
    _positive(d.num_workers, key("num_workers"))
    if d.num_workers > 1024:
        raise _bad(key("num_workers"), "at most 1024")
    _positive(d.min_batch_size, key("min_batch_size"))
    if d.max_batch_size < d.min_batch_size:
        raise _bad(key("max_batch_size"), f"must be at least min_batch_size ({d.min_batch_size})")
    if not 0.0 < d.quorum <= 1.0:
        raise _bad(key("quorum"), "must be in (0, 1]")
    if d.round_timeout_s <= 0:
        raise _bad(key("round_timeout_s"), "must be positive")
    if d.gpu_memory_per_sample_gb < 0:
        raise _bad(key("gpu_memory_per_sample_gb"), "must not be negative")
    if d.delta_dtype not in DELTA_DTYPES.values():
        raise _bad(key("delta_dtype"), "unknown dtype")
    if d.delta_topk != 0.0 and not MIN_DELTA_TOPK <= d.delta_topk <= 1.0:
        raise _bad(key("delta_topk"), f"must be 0 (off) or in [{MIN_DELTA_TOPK}, 1]")
    if d.streaming_fragments > MAX_STREAMING_FRAGMENTS:
        raise _bad(key("streaming_fragments"), f"must be 0 (off) or in [1, {MAX_STREAMING_FRAGMENTS}]")
    _check_policy(d.selection_policy, key("selection_policy"))
    inner = d.inner_optimizer
    if inner.learning_rate <= 0:
        raise _bad(key("inner_optimizer.learning_rate"), "must be positive")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(inner, name) < 1.0:
            raise _bad(key(f"inner_optimizer.{name}"), "betas must be in [0, 1)")
    if inner.epsilon <= 0:
        raise _bad(key("inner_optimizer.epsilon"), "must be positive")
    if inner.weight_decay < 0:
        raise _bad(key("inner_optimizer.weight_decay"), "must not be negative")
    if d.outer_optimizer.learning_rate <= 0:
        raise _bad(key("outer_optimizer.learning_rate"), "must be positive")
    if not 0.0 <= d.outer_optimizer.momentum < 1.0:
        raise _bad(key("outer_optimizer.momentum"), "must be in [0, 1)")
    for name in ("worker_requirements", "parameter_server_requirements"):
        _check_resources(getattr(d, name).minimum, key(name))
    for name in ("worker_price", "parameter_server_price"):
        _check_price(getattr(d, name), key(name))


# ---- task ---------------------------------------------------------------------------------


def _task(table: _Table) -> common_pb2.TaskJobSpec:
    t = common_pb2.TaskJobSpec(
        command=table.string("command", required=True),
        args=table.strings("args"),
        timeout_s=table.number("timeout_s", 0.0),
        completion_marker=table.string("completion_marker"),
        selection_policy=table.string("selection_policy"),
        gpus=table.integer("gpus", 0),
        files=table.strings("files"),
        outputs=table.strings("outputs"),
    )
    t.env.update(table.string_map("env"))
    if table.has("resources"):
        t.requirements.CopyFrom(
            _requirements(table.raw("resources"), table.key("resources"), ExecutorKind.TASK)
        )
    else:
        t.requirements.executor = common_pb2.EXECUTOR_KIND_TASK
    if t.gpus and not t.requirements.minimum.gpu:
        t.requirements.minimum.gpu = t.gpus
    t.price.CopyFrom(_price(table.table("price")))
    t.retry.CopyFrom(_retry(table.table("retry")))
    return t


def _retry(t: _Table | None) -> common_pb2.RetryPolicy:
    r = common_pb2.RetryPolicy(
        max_attempts=Defaults.MAX_ATTEMPTS,
        backoff_base_s=Defaults.BACKOFF_BASE_S,
        backoff_cap_s=Defaults.BACKOFF_CAP_S,
        retry_on_timeout=True,
        retry_on_worker_loss=True,
    )
    if t is None:
        return r
    r.max_attempts = t.integer("max_attempts", r.max_attempts)
    # The task API's older names (backoff_base, backoff_max, retry_on_worker_failure) are aliases.
    r.backoff_base_s = t.number("backoff_base_s", t.number("backoff_base", r.backoff_base_s))
    r.backoff_cap_s = t.number("backoff_cap_s", t.number("backoff_max", r.backoff_cap_s))
    r.retry_on_timeout = t.boolean("retry_on_timeout", r.retry_on_timeout)
    r.retry_on_worker_loss = t.boolean(
        "retry_on_worker_loss", t.boolean("retry_on_worker_failure", r.retry_on_worker_loss)
    )
    t.done()
    return r


def _task_defaults(t: common_pb2.TaskJobSpec) -> None:
    t.requirements.executor = common_pb2.EXECUTOR_KIND_TASK
    if t.gpus and not t.requirements.minimum.gpu:
        t.requirements.minimum.gpu = t.gpus
    if not t.HasField("retry"):
        t.retry.CopyFrom(_retry(None))
    else:
        t.retry.max_attempts = t.retry.max_attempts or Defaults.MAX_ATTEMPTS
        t.retry.backoff_cap_s = t.retry.backoff_cap_s or max(Defaults.BACKOFF_CAP_S, t.retry.backoff_base_s)


def _task_key(path: str) -> Callable[[str], str]:
    def key(field: str) -> str:
        if field.startswith("requirements"):
            return f"{path}.resources"
        return f"{path}.{field}"

    return key


def _check_task(t: common_pb2.TaskJobSpec, key: Callable[[str], str]) -> None:
    if not t.command.strip():
        raise _bad(key("command"), "missing (required)")
    if t.timeout_s < 0:
        raise _bad(key("timeout_s"), "must not be negative (0: no timeout)")
    marker = t.completion_marker
    if marker:
        pure = PurePosixPath(marker)
        if pure.is_absolute() or ".." in pure.parts:
            raise _bad(key("completion_marker"), "must be a relative path inside the task's work dir")
    for name in ("files", "outputs"):
        for i, value in enumerate(getattr(t, name)):
            check_relative(value, f"{key(name)}[{i}]")
    _check_policy(t.selection_policy, key("selection_policy"))
    _check_resources(t.requirements.minimum, key("requirements"))
    if t.gpus and t.requirements.minimum.gpu and t.requirements.minimum.gpu != t.gpus:
        raise _bad(key("gpus"), "differs from the gpu count in resources")
    _check_price(t.price, key("price"))
    r = t.retry
    _positive(r.max_attempts, key("retry.max_attempts"))
    if r.backoff_base_s < 0:
        raise _bad(key("retry.backoff_base_s"), "must not be negative")
    if r.backoff_cap_s < r.backoff_base_s:
        raise _bad(key("retry.backoff_cap_s"), "must be at least backoff_base_s")


# ---- shared checks ------------------------------------------------------------------------


def _positive(value: int, path: str) -> None:
    if value < 1:
        raise _bad(path, "must be at least 1")


def _check_policy(name: str, path: str) -> None:
    if name and name not in POLICY_NAMES:
        raise _bad(path, f"unknown selection policy {name!r} (valid: {', '.join(POLICY_NAMES)})")


def _check_resources(r: common_pb2.Resources, path: str) -> None:
    for field in RESOURCE_FIELDS:
        value = getattr(r, field)
        if not math.isfinite(value) or value < 0:
            raise _bad(path, f"{field} must be a finite, non-negative number")


def _check_price(p: common_pb2.PriceRange, path: str) -> None:
    if not (math.isfinite(p.bid) and math.isfinite(p.max)):
        raise _bad(f"{path}.bid", "must be a finite number")
    if p.bid < 0:
        raise _bad(f"{path}.bid", "must not be negative")
    if p.max < p.bid:
        raise _bad(f"{path}.max", f"must be at least bid ({p.bid})")
