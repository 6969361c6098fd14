"""A DiLoCo trainer dispatch as the reference system's job document, and the configured program that runs it.

An executor written for the reference system (its ``executors/accelerate``
trainer, say) gets its job as JSON: ``{"job_id", "executor": {"class":
"train", "descriptor": {"name"}, "config": {...}}}`` whose config names the
model, the data, where updates go and where results come from as the
reference's fetch/send/receive references. This module writes that document
from our dispatch, so the references it holds are exactly the ones the
reference bridge routes (``reference_bridge``) recognise:

- the model (and preprocessor) as a ``huggingface`` reference whose
  ``repository`` is the spec's repository, or its local path (the bridge
  fetches only what the spec names; tokens stay with the worker);
- the data as ``{"type": "scheduler", "peer": <scheduler>, "dataset"}``;
- updates and results as ``peers`` references naming the parameter server.

It also turns a ``[[executors]]`` entry into the command line, placeholders
filled, that the supervisor starts under the same sandbox as ours: the
execution plan of a dispatch whose executor profile says which entry its
spec names (``ExecutorProfile.named_executor``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypha.errors import FailedPreconditionError
from hypha.v1 import common_pb2
from hypha.worker import executors
from hypha.worker.bridge import SOCKET_NAME
from hypha.worker.execution_state import JobDispatch
from hypha.worker.executors import ExecutorPlan
from hypha.worker.jobs_config import ConfiguredExecutor, JobsSection

#: Longest socket path a client can connect to by name (``sun_path`` holds 108 bytes with its NUL).
MAX_SOCKET_PATH = 107

#: The reference's model task names for our model types, and the slice columns each reads.
_TASKS: dict[int, tuple[str, list[str]]] = {
    common_pb2.MODEL_TYPE_UNSPECIFIED: ("causal-lm", ["input_ids", "attention_mask", "labels"]),
    common_pb2.MODEL_TYPE_CAUSAL_LM: ("causal-lm", ["input_ids", "attention_mask", "labels"]),
    common_pb2.MODEL_TYPE_VISION_CLASSIFICATION: ("image-classification", ["pixel_values", "labels"]),
    common_pb2.MODEL_TYPE_TORCH: ("auto", []),
}


def artifact_reference(source: common_pb2.ModelSpec | common_pb2.PreprocessorSpec) -> dict[str, Any]:
    """A model or preprocessor as the reference's ``huggingface`` fetch reference.

    A local source's path stands in for the repository: the bridge maps it
    back to the spec, never to a path the executor chose. Without filenames
    every file is meant (``*``: our fetcher takes names or glob patterns).
    """
    return {
        "type": "huggingface",
        "repository": source.repository or source.local_path,
        "revision": source.revision or None,
        "filenames": list(source.filenames) or ["*"],
        "token": None,
    }


def peers_reference(peers: Sequence[str], strategy: str) -> dict[str, Any]:
    return {"type": "peers", "peers": list(peers), "strategy": {"type": strategy}, "resource": None}


def job_document(dispatch: JobDispatch, executor_name: str) -> dict[str, Any]:
    """The reference's ``JobSpec`` JSON for a trainer dispatch."""
    spec = dispatch.spec.diloco
    task, inputs = _TASKS.get(spec.model.type, ("auto", []))
    inner = spec.inner_optimizer
    config: dict[str, Any] = {
        "model": {"task": task, "artifact": artifact_reference(spec.model), "input-names": inputs},
        "data": {"type": "scheduler", "peer": dispatch.scheduler_id, "dataset": spec.dataset},
        "updates": peers_reference([dispatch.parameter_server_id], "All"),
        "results": peers_reference([dispatch.parameter_server_id], "All"),
        "optimizer": {
            "learning-rate": inner.learning_rate,
            "betas": [inner.beta1, inner.beta2] if inner.beta1 or inner.beta2 else None,
            "epsilon": inner.epsilon or None,
        },
        "batch_size": int(dispatch.batch_size or spec.max_batch_size or 1),
    }
    if spec.HasField("preprocessor") and (spec.preprocessor.repository or spec.preprocessor.local_path):
        config["preprocessor"] = {
            "task": "auto",
            "artifact": artifact_reference(spec.preprocessor),
            "input-names": [],
        }
    return {
        "job_id": dispatch.job_id,
        "executor": {"class": "train", "descriptor": {"name": executor_name}, "config": config},
    }


def configured_executor(
    dispatch: JobDispatch, configured: Sequence[ConfiguredExecutor]
) -> ConfiguredExecutor | None:
    """The ``[[executors]]`` entry a trainer dispatch names; None: the built-in trainer runs.

    Refused (FailedPrecondition) when the job names one this worker lacks and
    allows no fallback.
    """
    ref = dispatch.profile.named_executor(dispatch.spec)
    if ref is None or not ref.name:
        return None
    for entry in configured:
        if entry.executor_class == (ref.executor_class or "train") and entry.name == ref.name:
            return entry
    if ref.builtin_fallback:
        return None
    raise FailedPreconditionError(
        f"this worker has no [[executors]] entry class={ref.executor_class or 'train'!r} name={ref.name!r}"
    )


def configured_argv(
    entry: ConfiguredExecutor, socket_path: Path, work_dir: Path, job_json: str
) -> tuple[list[str], dict[str, str]]:
    """The entry's command line with its placeholders filled, and the same values as environment.

    A socket path too long for ``sun_path`` (deep work dirs) is given relative
    to the work dir, the process's working directory, where it connects.
    """
    socket_value = str(socket_path)
    if len(socket_value.encode()) > MAX_SOCKET_PATH:
        socket_value = str(socket_path.relative_to(work_dir))
    values = {"SOCKET_PATH": socket_value, "WORK_DIR": str(work_dir), "JOB_JSON": job_json}
    args = []
    for arg in entry.args:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        args.append(arg)
    return [entry.cmd, *args], values


def job_json(dispatch: JobDispatch, entry: ConfiguredExecutor) -> str:
    return json.dumps(job_document(dispatch, entry.name), separators=(",", ":"))


def execution_plan(
    dispatch: JobDispatch, work_dir: Path, settings: JobsSection, configured: Sequence[ConfiguredExecutor]
) -> ExecutorPlan:
    """How to start the dispatch's executor: the entry it names, else the built-in program."""
    plan = executors.plan(
        dispatch.executor,
        dispatch.spec,
        work_dir,
        commands=settings.executor_commands,
        default_timeout_s=settings.default_task_timeout_s,
        max_timeout_s=settings.max_task_timeout_s,
    )
    entry = configured_executor(dispatch, configured)
    if entry is None:
        return plan
    argv, env = configured_argv(entry, work_dir / SOCKET_NAME, work_dir, job_json(dispatch, entry))
    return ExecutorPlan(argv=argv, env=env, timeout_s=plan.timeout_s)


__all__ = [
    "artifact_reference",
    "configured_argv",
    "configured_executor",
    "execution_plan",
    "job_document",
    "job_json",
    "peers_reference",
]
