"""Inference job files: ``[job] kind = "inference"`` -> ``hypha.v1.InferenceJobSpec``.

One module per job kind (``hypha.jobfile.diloco``, ``hypha.jobfile.task``
and this one; ``hypha.jobfile`` dispatches) so each stays one screenful; the
same typed getters (``hypha.jobfile.table``), the same errors named by dotted
key::

    [job]
    kind = "inference"
    name = "sums"
    model_job = "JOB_ID"                 # a SUCCEEDED job's result (e.g. a DiLoCo job's model)
    # or [job.model] repository = "owner/repo" / local_path = "/models/x", type = "causal-lm"
    dataset = "arithmetic"               # by name, through the DHT like DiLoCo
    # or inputs = [{ prompt = "012+035=", answer = "74" }]   (causal-lm; answer optional)
    max_samples = 0                      # 0: every sample
    max_new_tokens = 0                   # greedy tokens per prompt; 0: the answer's length, else 16
    batch_size = 64
    timeout_s = 600                      # 0: none
    resources = { cpu = 1, memory_gb = 2 }
    price = { bid = 1.0, max = 2.0 }
    selection_policy = ""

Exactly one model source (``model_job``, or a ``[job.model]`` with a
repository or local path) and exactly one data source (``dataset`` or
``inputs``). Inline inputs are prompts, so they need a causal LM.
"""

from __future__ import annotations

from collections.abc import Callable

from hypha.jobfile.common import (
    MODEL_TYPES,
    check_policy,
    check_price,
    check_resources,
    read_model,
    read_price,
    read_requirements,
)
from hypha.jobfile.table import Table, bad
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2

#: Largest number of inline inputs (the job file itself is capped too).
MAX_INLINE_INPUTS = 10_000
#: Largest ``max_new_tokens``.
MAX_NEW_TOKENS = 4096
DEFAULT_BATCH_SIZE = 64


def inference_table(table: Table) -> common_pb2.InferenceJobSpec:
    """Read the inference keys of a ``[job]`` table."""
    spec = common_pb2.InferenceJobSpec(
        model_job=table.string("model_job"),
        dataset=table.string("dataset"),
        max_samples=table.integer("max_samples", 0),
        max_new_tokens=table.integer("max_new_tokens", 0),
        batch_size=table.integer("batch_size", DEFAULT_BATCH_SIZE),
        timeout_s=table.number("timeout_s", 0.0),
        selection_policy=table.string("selection_policy"),
    )
    model = table.table("model")
    if model is not None:
        spec.model.CopyFrom(read_model(model))
    else:
        spec.model.type = common_pb2.MODEL_TYPE_CAUSAL_LM
    inputs = table.raw("inputs")
    if inputs is not None:
        if not isinstance(inputs, list):
            raise bad(table.key("inputs"), "must be a list of tables {prompt, answer}")
        for i, item in enumerate(inputs):
            entry = Table(item, f"{table.key('inputs')}[{i}]")
            spec.inputs.add(prompt=entry.string("prompt", required=True), answer=entry.string("answer"))
            entry.done()
    if table.has("resources"):
        spec.requirements.CopyFrom(
            read_requirements(table.raw("resources"), table.key("resources"), ExecutorKind.INFERENCE)
        )
    spec.requirements.executor = common_pb2.EXECUTOR_KIND_INFERENCE
    spec.price.CopyFrom(read_price(table.table("price")))
    return spec


def inference_defaults(spec: common_pb2.InferenceJobSpec) -> None:
    """Fill unset (zero) fields of a structured inference spec."""
    spec.requirements.executor = common_pb2.EXECUTOR_KIND_INFERENCE
    spec.model.type = spec.model.type or common_pb2.MODEL_TYPE_CAUSAL_LM
    spec.batch_size = spec.batch_size or DEFAULT_BATCH_SIZE
    spec.model_bundle_sha256 = ""  # the scheduler sets it at dispatch, never a submitter


def check_inference(spec: common_pb2.InferenceJobSpec, key: Callable[[str], str]) -> None:
    """The checks shared by job files and structured submissions; errors name the key to fix."""
    m = spec.model
    named = bool(m.repository or m.local_path)
    if spec.model_job and named:
        raise bad(key("model_job"), "set model_job or model.repository/model.local_path, not both")
    if not spec.model_job and not named:
        if m.type != common_pb2.MODEL_TYPE_TORCH or not m.torch_factory:
            raise bad(key("model_job"), "missing: set model_job, or [model] repository or local_path")
    if m.type not in MODEL_TYPES.values():
        raise bad(key("model.type"), "unknown model type")
    if m.local_path and not m.local_path.startswith(("/", "~")):
        raise bad(key("model.local_path"), f"{m.local_path!r} must be absolute (a path on the workers)")
    if spec.model_job and (len(spec.model_job) > 128 or not spec.model_job.strip()):
        raise bad(key("model_job"), "must be a job id")
    if spec.dataset.strip() and spec.inputs:
        raise bad(key("inputs"), "set dataset or inputs, not both")
    if not spec.dataset.strip() and not spec.inputs:
        raise bad(key("dataset"), "missing: set dataset or inputs")
    if len(spec.inputs) > MAX_INLINE_INPUTS:
        raise bad(key("inputs"), f"at most {MAX_INLINE_INPUTS} inputs (use a dataset for more)")
    if spec.inputs and m.type != common_pb2.MODEL_TYPE_CAUSAL_LM:
        raise bad(key("inputs"), "inline inputs are prompts: they need model.type = causal-lm")
    if spec.max_new_tokens > MAX_NEW_TOKENS:
        raise bad(key("max_new_tokens"), f"at most {MAX_NEW_TOKENS}")
    if spec.batch_size < 1:
        raise bad(key("batch_size"), "must be at least 1")
    if spec.timeout_s < 0:
        raise bad(key("timeout_s"), "must not be negative (0: no timeout)")
    check_policy(spec.selection_policy, key("selection_policy"))
    check_resources(spec.requirements.minimum, key("requirements"))
    check_price(spec.price, key("price"))


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "MAX_INLINE_INPUTS",
    "MAX_NEW_TOKENS",
    "check_inference",
    "inference_defaults",
    "inference_table",
]
