"""Job files: TOML in, a validated ``hypha.v1.JobSpec`` out.

A job file holds one ``[job]`` table; a scheduler config's ``[scheduler.job]``
section (the reference system's scheduler-config form) is accepted as well, and the rest of that file (the
scheduler's own settings) is ignored. ``kind`` is ``diloco``, ``task`` or
``inference`` (its keys: ``hypha.jobfile.inference``); when absent it is inferred
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
    delta_dtype = "int8"                 # fp32 | bf16 | fp16 | int8 (block-wise, error feedback)
    delta_topk = 0.0                     # fraction of each delta's entries sent; 0: all
    update_dtype = "int8"                # the update down: fp32 (θ_global) | bf16 | fp16 | int8 (its change)
    streaming_fragments = 0              # F >= 2: each round syncs 1/F of the model (streaming)
    overlap_sync = true                  # whole-model rounds: keep training while the sync travels
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
    weight_decay = 0.01
    max_grad_norm = 0.0                  # clip each step's gradient norm; 0: off
    warmup_steps = 0                     # linear learning-rate warmup; 0: off
    decay_steps = 0                      # cosine decay to min_lr_ratio * lr at this step; 0: off
    min_lr_ratio = 0.1
    [job.outer_optimizer]                # Nesterov
    learning_rate = 0.7
    momentum = 0.9
    [job.resources]
    num_workers = 2
    worker = { cpu = 1, memory_gb = 2 }  # or the list form: [[...worker]] of {type, min} / {kind}
    worker_price = { bid = 1.0, max = 2.0 }
    [job.trainer_executor]               # optional: a process the worker config defines
    class = "train"                      # ([[executors]], docs/job-bridge.md) instead of ours
    name = "diloco-transformer"
    builtin_fallback = false             # true: a worker without it runs the built-in trainer

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

import tomllib
from collections.abc import Mapping
from typing import Any

from hypha.errors import InvalidArgumentError
from hypha.jobfile.common import (
    EXECUTOR_ALIASES,
    MODEL_TYPES,
    RESOURCE_FIELDS,
    RESOURCE_TYPES,
    Defaults,
)
from hypha.jobfile.diloco import DELTA_DTYPES, MAX_STREAMING_FRAGMENTS, MIN_DELTA_TOPK
from hypha.jobfile.kinds import JOB_KINDS, KINDS, JobKind, infer_kind, kind_of
from hypha.jobfile.table import MAX_INTEGER, Table, bad
from hypha.v1 import common_pb2

#: Largest job file accepted, in bytes (a job file is configuration, not data).
MAX_JOB_FILE_BYTES = 256 * 1024


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
                raise bad(key, "unknown key (a job file holds one [job] table)")
        return parse_job_table(data["job"], "job")
    scheduler = data.get("scheduler")
    if isinstance(scheduler, Mapping) and "job" in scheduler:
        return parse_job_table(scheduler["job"], "scheduler.job")
    raise bad("job", "missing: a job file needs a [job] table (or [scheduler.job] as in a scheduler config)")


def parse_job_table(data: Any, path: str = "job", *, kind: str | None = None) -> common_pb2.JobSpec:
    """One job table (as TOML or JSON gives it) -> JobSpec; ``kind`` forces the job kind."""
    table = Table(data, path)
    declared = _declared_kind(table)
    if kind is not None and declared and declared != kind:
        raise bad(table.key("kind"), f"must be {kind!r} here")
    entry = JOB_KINDS.get(kind or declared) if kind or declared else _infer_kind(table)
    if entry is None:
        raise bad(table.key("kind"), f"unknown job kind {kind or declared!r} (valid: {', '.join(KINDS)})")
    name = table.string("name")
    if len(name) > 128:
        raise bad(table.key("name"), "longer than 128 characters")
    spec = common_pb2.JobSpec(name=name)
    entry.read(table, spec)
    table.done()
    entry.check(spec, entry.file_key(path))
    return spec


def normalize_spec(spec: common_pb2.JobSpec, path: str = "spec") -> common_pb2.JobSpec:
    """A structured JobSpec with defaults filled in for unset (zero) fields, checked like a job file."""
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    if len(out.name) > 128:
        raise bad(f"{path}.name", "longer than 128 characters")
    entry = kind_of(out)
    if entry is None:
        raise bad(f"{path}.kind", f"missing: set {', '.join(KINDS[:-1])} or {KINDS[-1]}")
    entry.defaults(out)
    entry.check(out, lambda field: f"{path}.{entry.name}.{field}")
    return out


def _declared_kind(table: Table) -> str:
    """The kind the table names (``kind``, or the reference system's ``type``); "" when it names none.

    An empty name is refused rather than read as "infer it": a REST body's
    ``"kind": ""`` is not one of the kinds its schema lists.
    """
    for key in ("kind", "type"):
        if table.has(key):
            declared = table.string(key)
            if not declared:
                raise bad(table.key(key), "must not be empty (leave it out to infer the kind)")
            return declared
    return ""


def _infer_kind(table: Table) -> JobKind:
    entry = infer_kind(table)
    if entry is None:
        raise bad(table.key("kind"), 'missing: set kind = "diloco", "task" or "inference"')
    return entry


__all__ = [
    "DELTA_DTYPES",
    "EXECUTOR_ALIASES",
    "KINDS",
    "MAX_INTEGER",
    "MAX_JOB_FILE_BYTES",
    "MAX_STREAMING_FRAGMENTS",
    "MIN_DELTA_TOPK",
    "MODEL_TYPES",
    "RESOURCE_FIELDS",
    "RESOURCE_TYPES",
    "Defaults",
    "normalize_spec",
    "parse_job_document",
    "parse_job_table",
    "parse_job_toml",
]
