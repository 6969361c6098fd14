"""Task job files: ``[job] kind = "task"`` (or a ``command``) -> ``hypha.v1.TaskJobSpec``.

The keys of a task job (command, arguments, environment, shipped files and
kept outputs, resources, price, retry policy), the defaults a structured
submission gets, and the checks both share; the format is documented in
``hypha.jobfile``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePosixPath

from hypha.bundles import check_relative
from hypha.jobfile.common import (
    Defaults,
    check_policy,
    check_positive,
    check_price,
    check_resources,
    read_price,
    read_requirements,
)
from hypha.jobfile.table import Table, bad
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2


def task_table(table: Table) -> common_pb2.TaskJobSpec:
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
            read_requirements(table.raw("resources"), table.key("resources"), ExecutorKind.TASK)
        )
    else:
        t.requirements.executor = common_pb2.EXECUTOR_KIND_TASK
    if t.gpus and not t.requirements.minimum.gpu:
        t.requirements.minimum.gpu = t.gpus
    t.price.CopyFrom(read_price(table.table("price")))
    t.retry.CopyFrom(_retry(table.table("retry")))
    return t


def _retry(t: Table | None) -> common_pb2.RetryPolicy:
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


def task_defaults(t: common_pb2.TaskJobSpec) -> None:
    t.requirements.executor = common_pb2.EXECUTOR_KIND_TASK
    if t.gpus and not t.requirements.minimum.gpu:
        t.requirements.minimum.gpu = t.gpus
    if not t.HasField("retry"):
        t.retry.CopyFrom(_retry(None))
    else:
        t.retry.max_attempts = t.retry.max_attempts or Defaults.MAX_ATTEMPTS
        t.retry.backoff_cap_s = t.retry.backoff_cap_s or max(Defaults.BACKOFF_CAP_S, t.retry.backoff_base_s)


def check_task(t: common_pb2.TaskJobSpec, key: Callable[[str], str]) -> None:
    if not t.command.strip():
        raise bad(key("command"), "missing (required)")
    if t.timeout_s < 0:
        raise bad(key("timeout_s"), "must not be negative (0: no timeout)")
    marker = t.completion_marker
    if marker:
        pure = PurePosixPath(marker)
        if pure.is_absolute() or ".." in pure.parts:
            raise bad(key("completion_marker"), "must be a relative path inside the task's work dir")
    for name in ("files", "outputs"):
        for i, value in enumerate(getattr(t, name)):
            check_relative(value, f"{key(name)}[{i}]")
    check_policy(t.selection_policy, key("selection_policy"))
    check_resources(t.requirements.minimum, key("requirements"))
    if t.gpus and t.requirements.minimum.gpu and t.requirements.minimum.gpu != t.gpus:
        raise bad(key("gpus"), "differs from the gpu count in resources")
    check_price(t.price, key("price"))
    r = t.retry
    check_positive(r.max_attempts, key("retry.max_attempts"))
    if r.backoff_base_s < 0:
        raise bad(key("retry.backoff_base_s"), "must not be negative")
    if r.backoff_cap_s < r.backoff_base_s:
        raise bad(key("retry.backoff_cap_s"), "must be at least backoff_base_s")


__all__ = ["check_task", "task_defaults", "task_table"]
