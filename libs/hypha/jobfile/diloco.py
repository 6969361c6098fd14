"""DiLoCo job files: ``[job] kind = "diloco"`` -> ``hypha.v1.DilocoJobSpec``.

The keys of a DiLoCo job (model, preprocessor, dataset, optimizers, rounds,
delta compression, resources of trainers and parameter server), the defaults a
structured submission gets, and the checks both share; the format is
documented in ``hypha.jobfile``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from hypha.jobfile.common import (
    MODEL_TYPES,
    Defaults,
    check_policy,
    check_positive,
    check_price,
    check_resources,
    read_model,
    read_price,
    read_requirements,
)
from hypha.jobfile.table import Table, bad
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2

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


def diloco_table(table: Table) -> common_pb2.DilocoJobSpec:
    d = common_pb2.DilocoJobSpec()
    model = table.table("model")
    if model is None:
        raise bad(table.key("model"), "missing (required)")
    d.model.CopyFrom(read_model(model))
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
    d.max_samples_per_round = table.integer("max_samples_per_round", 0)
    d.min_batch_size = table.integer("min_batch_size", d.min_batch_size or Defaults.MIN_BATCH_SIZE)
    d.max_batch_size = table.integer("max_batch_size", d.max_batch_size or Defaults.MAX_BATCH_SIZE)
    dtype = table.string("delta_dtype", Defaults.DELTA_DTYPE).lower()
    if dtype not in DELTA_DTYPES:
        raise bad(table.key("delta_dtype"), f"unknown dtype {dtype!r} (valid: {', '.join(DELTA_DTYPES)})")
    d.delta_dtype = DELTA_DTYPES[dtype]
    d.delta_topk = table.number("delta_topk", 0.0)
    update_dtype = table.string("update_dtype", Defaults.UPDATE_DTYPE).lower()
    if update_dtype not in DELTA_DTYPES:
        raise bad(
            table.key("update_dtype"), f"unknown dtype {update_dtype!r} (valid: {', '.join(DELTA_DTYPES)})"
        )
    d.update_dtype = DELTA_DTYPES[update_dtype]
    d.streaming_fragments = table.integer("streaming_fragments", 0)
    d.overlap_sync = table.boolean("overlap_sync", Defaults.OVERLAP_SYNC)
    d.quorum = table.number("quorum", Defaults.QUORUM)
    d.round_timeout_s = table.number("round_timeout_s", Defaults.ROUND_TIMEOUT_S)
    d.selection_policy = table.string("selection_policy")
    d.gpu_memory_per_sample_gb = table.number("gpu_memory_per_sample_gb", 0.0)
    executor = table.table("trainer_executor")
    if executor is not None:
        d.trainer_executor.CopyFrom(_trainer_executor(executor))
    return d


#: The executor class a DiLoCo trainer is (the reference system's name for it).
TRAINER_CLASS = "train"


def _trainer_executor(t: Table) -> common_pb2.ExecutorRef:
    """``[job.trainer_executor]``: a worker-configured trainer process, by class and name."""
    ref = common_pb2.ExecutorRef(
        executor_class=t.string("class", TRAINER_CLASS),
        name=t.string("name", required=True),
        builtin_fallback=t.boolean("builtin_fallback", False),
    )
    t.done()
    if ref.executor_class != TRAINER_CLASS:
        raise bad(t.key("class"), f"a DiLoCo trainer's executor class is {TRAINER_CLASS!r}")
    return ref


def _preprocessor(t: Table) -> common_pb2.PreprocessorSpec:
    p = common_pb2.PreprocessorSpec(
        repository=t.string("repository"),
        revision=t.string("revision"),
        filenames=t.strings("filenames"),
        token=t.string("token"),
        local_path=t.string("local_path"),
    )
    t.done()
    if not (p.repository or p.local_path):
        raise bad(t.key("repository"), "missing: set repository or local_path")
    return p


def _dataset(table: Table) -> str:
    value = table.data.get("dataset")
    if isinstance(value, Mapping):
        sub = table.table("dataset")
        assert sub is not None
        name = sub.string("dataset", required=True)
        sub.done()
        return name
    return table.string("dataset", required=True)


def _adamw(t: Table | None) -> common_pb2.AdamWConfig:
    a = common_pb2.AdamWConfig(
        learning_rate=Defaults.INNER_LR,
        beta1=Defaults.BETA1,
        beta2=Defaults.BETA2,
        epsilon=Defaults.EPSILON,
        weight_decay=Defaults.WEIGHT_DECAY,
        min_lr_ratio=Defaults.MIN_LR_RATIO,
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
            raise bad(t.key("betas"), "must be a list of two numbers")
        a.beta1, a.beta2 = float(betas[0]), float(betas[1])
    a.beta1 = t.number("beta1", a.beta1)
    a.beta2 = t.number("beta2", a.beta2)
    a.epsilon = t.number("epsilon", a.epsilon)
    a.weight_decay = t.number("weight_decay", a.weight_decay)
    a.max_grad_norm = t.number("max_grad_norm", a.max_grad_norm)
    a.warmup_steps = t.integer("warmup_steps", a.warmup_steps)
    a.decay_steps = t.integer("decay_steps", a.decay_steps)
    a.min_lr_ratio = t.number("min_lr_ratio", a.min_lr_ratio)
    t.done()
    return a


def _nesterov(t: Table | None) -> common_pb2.NesterovConfig:
    n = common_pb2.NesterovConfig(learning_rate=Defaults.OUTER_LR, momentum=Defaults.MOMENTUM)
    if t is None:
        return n
    n.learning_rate = t.number("learning_rate", n.learning_rate)
    n.momentum = t.number("momentum", n.momentum)
    t.done()
    return n


def _diloco_resources(t: Table | None, path: str, d: common_pb2.DilocoJobSpec) -> None:
    d.num_workers = Defaults.NUM_WORKERS
    d.worker_requirements.executor = common_pb2.EXECUTOR_KIND_DILOCO_TRAINER
    d.parameter_server_requirements.executor = common_pb2.EXECUTOR_KIND_PARAMETER_SERVER
    if t is None:
        return
    d.num_workers = t.integer("num_workers", Defaults.NUM_WORKERS)
    if t.has("worker"):
        d.worker_requirements.CopyFrom(
            read_requirements(t.raw("worker"), t.key("worker"), ExecutorKind.DILOCO_TRAINER)
        )
    if t.has("parameter_server"):
        d.parameter_server_requirements.CopyFrom(
            read_requirements(
                t.raw("parameter_server"), t.key("parameter_server"), ExecutorKind.PARAMETER_SERVER
            )
        )
    d.worker_price.CopyFrom(read_price(t.table("worker_price")))
    d.parameter_server_price.CopyFrom(read_price(t.table("parameter_server_price")))
    t.done()


def diloco_defaults(d: common_pb2.DilocoJobSpec) -> None:
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


def diloco_key(path: str) -> Callable[[str], str]:
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


def check_diloco(d: common_pb2.DilocoJobSpec, key: Callable[[str], str]) -> None:
    m = d.model
    if m.type == common_pb2.MODEL_TYPE_TORCH:
        if not (m.torch_factory or m.local_path or m.repository):
            raise bad(key("model.torch_factory"), "missing: a torch model needs torch_factory or local_path")
    elif not (m.repository or m.local_path):
        raise bad(key("model.repository"), "missing: set repository or local_path")
    if m.type not in MODEL_TYPES.values():
        raise bad(key("model.type"), "unknown model type")
    for name, local in (("model", m.local_path), ("preprocessor", d.preprocessor.local_path)):
        # A path on the workers, not on the submitting machine: nothing can resolve a relative one.
        if local and not local.startswith(("/", "~")):
            raise bad(key(f"{name}.local_path"), f"{local!r} must be absolute (a path on the workers)")
    if not d.dataset.strip():
        raise bad(key("dataset"), "missing (required)")
    executor = d.trainer_executor
    if d.HasField("trainer_executor") and (
        not executor.name or executor.executor_class not in ("", TRAINER_CLASS)
    ):
        raise bad(key("trainer_executor"), f"needs a name, and class {TRAINER_CLASS!r} (the default)")
    check_positive(d.rounds, key("rounds"))
    check_positive(d.samples_per_round, key("samples_per_round"))
    if d.max_samples_per_round and d.max_samples_per_round < d.samples_per_round:
        raise bad(
            key("max_samples_per_round"),
            f"must be 0 (rounds of samples_per_round) or at least samples_per_round ({d.samples_per_round})",
        )
    check_positive(d.num_workers, key("num_workers"))
    if d.num_workers > 1024:
        raise bad(key("num_workers"), "at most 1024")
    check_positive(d.min_batch_size, key("min_batch_size"))
    if d.max_batch_size < d.min_batch_size:
        raise bad(key("max_batch_size"), f"must be at least min_batch_size ({d.min_batch_size})")
    if not 0.0 < d.quorum <= 1.0:
        raise bad(key("quorum"), "must be in (0, 1]")
    if d.round_timeout_s <= 0:
        raise bad(key("round_timeout_s"), "must be positive")
    if d.gpu_memory_per_sample_gb < 0:
        raise bad(key("gpu_memory_per_sample_gb"), "must not be negative")
    if d.delta_dtype not in DELTA_DTYPES.values():
        raise bad(key("delta_dtype"), "unknown dtype")
    if d.update_dtype and d.update_dtype not in DELTA_DTYPES.values():
        raise bad(key("update_dtype"), "unknown dtype")
    if d.delta_topk != 0.0 and not MIN_DELTA_TOPK <= d.delta_topk <= 1.0:
        raise bad(key("delta_topk"), f"must be 0 (off) or in [{MIN_DELTA_TOPK}, 1]")
    if d.streaming_fragments > MAX_STREAMING_FRAGMENTS:
        raise bad(key("streaming_fragments"), f"must be 0 (off) or in [1, {MAX_STREAMING_FRAGMENTS}]")
    check_policy(d.selection_policy, key("selection_policy"))
    inner = d.inner_optimizer
    if inner.learning_rate <= 0:
        raise bad(key("inner_optimizer.learning_rate"), "must be positive")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(inner, name) < 1.0:
            raise bad(key(f"inner_optimizer.{name}"), "betas must be in [0, 1)")
    if inner.epsilon <= 0:
        raise bad(key("inner_optimizer.epsilon"), "must be positive")
    if inner.weight_decay < 0:
        raise bad(key("inner_optimizer.weight_decay"), "must not be negative")
    if not (math.isfinite(inner.max_grad_norm) and inner.max_grad_norm >= 0):
        raise bad(key("inner_optimizer.max_grad_norm"), "must be 0 (no clipping) or positive")
    if inner.decay_steps and inner.decay_steps <= inner.warmup_steps:
        raise bad(
            key("inner_optimizer.decay_steps"),
            f"must be 0 (off) or above warmup_steps ({inner.warmup_steps})",
        )
    if not 0.0 <= inner.min_lr_ratio <= 1.0:
        raise bad(key("inner_optimizer.min_lr_ratio"), "must be in [0, 1]")
    if d.outer_optimizer.learning_rate <= 0:
        raise bad(key("outer_optimizer.learning_rate"), "must be positive")
    if not 0.0 <= d.outer_optimizer.momentum < 1.0:
        raise bad(key("outer_optimizer.momentum"), "must be in [0, 1)")
    for name in ("worker_requirements", "parameter_server_requirements"):
        check_resources(getattr(d, name).minimum, key(name))
    for name in ("worker_price", "parameter_server_price"):
        check_price(getattr(d, name), key(name))


__all__ = [
    "DELTA_DTYPES",
    "MAX_STREAMING_FRAGMENTS",
    "MIN_DELTA_TOPK",
    "check_diloco",
    "diloco_defaults",
    "diloco_key",
    "diloco_table",
]
