"""What the job kinds share: defaults, the model source, requirements, prices and their checks.

DiLoCo, task and inference jobs each read a model, a requirement table or
list and a price range the same way, and check a selection policy, resources
and prices the same way; it lives here once so each kind's module reads only
its own keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from hypha.errors import InvalidArgumentError
from hypha.jobfile.table import Table, bad
from hypha.market.policies import POLICY_NAMES
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2

MODEL_TYPES: dict[str, common_pb2.ModelType] = {
    "causal-lm": common_pb2.MODEL_TYPE_CAUSAL_LM,
    "vision-classification": common_pb2.MODEL_TYPE_VISION_CLASSIFICATION,
    "image-classification": common_pb2.MODEL_TYPE_VISION_CLASSIFICATION,  # the reference system's name
    "torch": common_pb2.MODEL_TYPE_TORCH,
}
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
    #: Where a cosine decay of the inner rate ends, as a fraction of the rate (``decay_steps``).
    MIN_LR_RATIO = 0.1
    #: A job file's sync settings: int8 both ways with error feedback and the sync overlapped
    #: with the next round's inner steps. Measured on capped links (docs/performance.md, "Time
    #: to accuracy on capped links"): they win on slow links and cost no accuracy on fast ones.
    #: A structured spec sent over the API keeps the wire's zeros (fp32, synchronous).
    DELTA_DTYPE = "int8"
    UPDATE_DTYPE = "int8"
    OVERLAP_SYNC = True
    MAX_ATTEMPTS = 3
    BACKOFF_BASE_S = 2.0
    BACKOFF_CAP_S = 60.0


def resources_key(path: str) -> Callable[[str], str]:
    """The job file key to name for a spec field of a task or inference job under ``path``:
    the spec's ``requirements`` are the file's ``resources``."""

    def key(field: str) -> str:
        if field.startswith("requirements"):
            return f"{path}.resources"
        return f"{path}.{field}"

    return key


def read_model(t: Table) -> common_pb2.ModelSpec:
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
        raise bad(
            t.key("type"), f"unknown model type {kind!r} (valid: causal-lm, vision-classification, torch)"
        )
    m.type = MODEL_TYPES[kind]
    m.config_overrides.update(t.string_map("config_overrides"))
    t.done()
    return m


def read_requirements(value: Any, path: str, executor: ExecutorKind) -> common_pb2.Requirements:
    """A requirement table ({cpu = 1, ...}) or the list form ([{type, min}, {kind}])."""
    minimum: dict[str, float] = {}
    kinds: list[tuple[str, str]] = []  # (name, key): every one given is checked, not only the last
    if isinstance(value, list):
        for i, item in enumerate(value):
            entry = Table(item, f"{path}[{i}]")
            if entry.has("kind"):
                kinds.append((entry.string("kind", required=True), entry.key("kind")))
            else:
                rtype = entry.string("type", required=True)
                field = RESOURCE_TYPES.get(rtype.lower())
                if field is None:
                    raise bad(
                        entry.key("type"),
                        f"unknown resource type {rtype!r} (valid: GPU, GPUs, CPU, Memory, Storage)",
                    )
                if not entry.has("min"):
                    raise bad(entry.key("min"), "missing (required)")
                minimum[field] = entry.number("min", 0.0)
            entry.done()
    elif isinstance(value, Mapping):
        table = Table(value, path)
        for field in RESOURCE_FIELDS:
            if table.has(field):
                minimum[field] = table.number(field, 0.0)
        for alias in ("executor", "kind"):
            if table.has(alias):
                kinds.append((table.string(alias, required=True), table.key(alias)))
        table.done()
    else:
        raise bad(path, "must be a table or a list of requirement tables")
    for field, amount in minimum.items():
        if amount < 0:
            raise bad(path, f"{field} must not be negative")
    for kind_name, kind_path in kinds:
        kind = EXECUTOR_ALIASES.get(kind_name)
        if kind is None:
            try:
                kind = ExecutorKind.parse(kind_name)
            except InvalidArgumentError as err:
                raise bad(kind_path, err.message) from None
        if kind is not executor:
            raise bad(kind_path, f"must be {executor.value} here, not {kind.value}")
    return common_pb2.Requirements(minimum=common_pb2.Resources(**minimum), executor=executor.to_proto())


def read_price(t: Table | None) -> common_pb2.PriceRange:
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


def check_positive(value: int, path: str) -> None:
    if value < 1:
        raise bad(path, "must be at least 1")


def check_policy(name: str, path: str) -> None:
    if name and name not in POLICY_NAMES:
        raise bad(path, f"unknown selection policy {name!r} (valid: {', '.join(POLICY_NAMES)})")


def check_resources(r: common_pb2.Resources, path: str) -> None:
    for field in RESOURCE_FIELDS:
        value = getattr(r, field)
        if not math.isfinite(value) or value < 0:
            raise bad(path, f"{field} must be a finite, non-negative number")


def check_price(p: common_pb2.PriceRange, path: str) -> None:
    if not (math.isfinite(p.bid) and math.isfinite(p.max)):
        raise bad(f"{path}.bid", "must be a finite number")
    if p.bid < 0:
        raise bad(f"{path}.bid", "must not be negative")
    if p.max < p.bid:
        raise bad(f"{path}.max", f"must be at least bid ({p.bid})")


__all__ = [
    "EXECUTOR_ALIASES",
    "MODEL_TYPES",
    "RESOURCE_FIELDS",
    "RESOURCE_TYPES",
    "Defaults",
    "check_policy",
    "check_positive",
    "check_price",
    "check_resources",
    "read_model",
    "read_price",
    "read_requirements",
    "resources_key",
]
