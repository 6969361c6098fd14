"""The job kinds, one entry each: the only place that knows what tells them apart.

Every role asks this table rather than comparing a job's kind to a name, so
a new kind is one entry here (plus its file keys in a module of this
package, its run on the scheduler and its executor on the worker;
``docs/architecture.md``, "Adding a job kind"). An entry says how a job file
of the kind is read, defaulted and checked; which model sources its spec
carries (their tokens are secrets: redacted for viewers, withheld from the
executor); the dataset it reads; its rounds and attempts; what a restarted
scheduler does with it; and what of it a viewer may not read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from enum import StrEnum

from hypha.errors import InvalidArgumentError
from hypha.jobfile.common import resources_key
from hypha.jobfile.diloco import check_diloco, diloco_defaults, diloco_key, diloco_table
from hypha.jobfile.inference import check_inference, inference_defaults, inference_table
from hypha.jobfile.table import Table
from hypha.jobfile.task import check_task, task_defaults, task_table
from hypha.v1 import common_pb2

#: A model or preprocessor a job's executor loads; ``token`` is a secret.
Source = common_pb2.ModelSpec | common_pb2.PreprocessorSpec
#: Proto field name -> the key (job file or API field) an error names.
KeyOf = Callable[[str], str]


class Restart(StrEnum):
    """What a restarted scheduler does with a job of the kind that was running."""

    #: The running attempt is lost like a worker loss: re-queued while attempts are left.
    RETRY = "retry"
    #: Taken back from the run state it saved (``hypha.scheduler.diloco.resume``); fails without one.
    RESUME = "resume"
    #: Fails: the kind keeps nothing a new process could continue from.
    FAIL = "fail"


def _no_env(spec: common_pb2.JobSpec) -> MutableMapping[str, str]:
    return {}


def _no_files(spec: common_pb2.JobSpec) -> common_pb2.TaskJobSpec | None:
    return None


@dataclass(frozen=True)
class JobKind:
    """One job kind: its ``JobSpec`` oneof field (``name``) and everything that differs by kind."""

    #: The ``JobSpec.kind`` oneof field, the job file's ``kind`` and ``JobRecord.kind``.
    name: str
    #: How people read it in messages ("DiLoCo jobs ...").
    title: str
    #: Job file keys whose presence means this kind when the file names none (first match wins).
    marks: tuple[str, ...]
    #: Reads the kind's keys of a job table into the spec's oneof field.
    read: Callable[[Table, common_pb2.JobSpec], None]
    #: Fills the spec's unset (zero) fields with their defaults.
    defaults: Callable[[common_pb2.JobSpec], None]
    #: Refuses a spec a worker cannot run, naming the key with ``KeyOf``.
    check: Callable[[common_pb2.JobSpec, KeyOf], None]
    #: A job file's key for each proto field, under the file's table path.
    file_key: Callable[[str], KeyOf]
    #: The models and preprocessors the spec names, by resource name (``model``, ``preprocessor``).
    sources: Callable[[common_pb2.JobSpec], Mapping[str, Source]]
    #: The dataset its workers read ("" none: the scheduler then waits for no data node).
    dataset: Callable[[common_pb2.JobSpec], str]
    #: Outer rounds it runs (0: not a job of rounds).
    rounds: Callable[[common_pb2.JobSpec], int]
    #: Attempts it may use (1: never retried).
    max_attempts: Callable[[common_pb2.JobSpec], int]
    restart: Restart
    #: Why a restarted scheduler failed a running job of this kind (``restart`` is not RETRY).
    not_resumed: str
    #: Its environment: only the submitter and admins may read the values.
    private_env: Callable[[common_pb2.JobSpec], MutableMapping[str, str]] = _no_env
    #: The part of its spec that names the files bundle shipped with it (``hypha.bundles``;
    #: ``files``, ``files_sha256``, ``files_size``); None: the kind ships no files.
    files: Callable[[common_pb2.JobSpec], common_pb2.TaskJobSpec | None] = _no_files
    #: Its progress is rounds of trainers reporting throughput (a viewer shows a round bar).
    in_rounds: bool = False

    def model(self, spec: common_pb2.JobSpec) -> common_pb2.ModelSpec | None:
        """The model its executor loads, if it loads one (its ``torch_factory`` is allowlisted)."""
        source = self.sources(spec).get("model")
        return source if isinstance(source, common_pb2.ModelSpec) else None


DILOCO = JobKind(
    name="diloco",
    title="DiLoCo",
    marks=("model", "dataset"),
    read=lambda table, spec: spec.diloco.CopyFrom(diloco_table(table)),
    defaults=lambda spec: diloco_defaults(spec.diloco),
    check=lambda spec, key: check_diloco(spec.diloco, key),
    file_key=diloco_key,
    sources=lambda spec: {"model": spec.diloco.model, "preprocessor": spec.diloco.preprocessor},
    dataset=lambda spec: spec.diloco.dataset,
    rounds=lambda spec: spec.diloco.rounds,
    max_attempts=lambda spec: 1,
    restart=Restart.RESUME,
    not_resumed="DiLoCo jobs are not resumed without the run state they save",
    in_rounds=True,
)
TASK = JobKind(
    name="task",
    title="task",
    marks=("command",),
    read=lambda table, spec: spec.task.CopyFrom(task_table(table)),
    defaults=lambda spec: task_defaults(spec.task),
    check=lambda spec, key: check_task(spec.task, key),
    file_key=resources_key,
    sources=lambda spec: {},
    dataset=lambda spec: "",
    rounds=lambda spec: 0,
    max_attempts=lambda spec: spec.task.retry.max_attempts,
    restart=Restart.RETRY,
    not_resumed="no retries left",
    private_env=lambda spec: spec.task.env,
    files=lambda spec: spec.task,
)
INFERENCE = JobKind(
    name="inference",
    title="inference",
    marks=("model_job", "inputs"),
    read=lambda table, spec: spec.inference.CopyFrom(inference_table(table)),
    defaults=lambda spec: inference_defaults(spec.inference),
    check=lambda spec, key: check_inference(spec.inference, key),
    file_key=resources_key,
    sources=lambda spec: {"model": spec.inference.model},
    dataset=lambda spec: spec.inference.dataset,
    rounds=lambda spec: 0,
    max_attempts=lambda spec: 1,
    restart=Restart.FAIL,
    not_resumed="inference jobs are not resumed: run it again",
)

#: Every kind by name; the order is the inference order for a job file that names none
#: (a task's ``command`` first, then inference's marks, then DiLoCo's ``model``/``dataset``,
#: which inference files carry too).
JOB_KINDS: Mapping[str, JobKind] = {kind.name: kind for kind in (TASK, INFERENCE, DILOCO)}
#: Kind names as people list them.
KINDS = ("diloco", "task", "inference")


def job_kind(name: str) -> JobKind:
    """The kind named ``name``; InvalidArgumentError naming the valid ones otherwise."""
    kind = JOB_KINDS.get(name)
    if kind is None:
        raise InvalidArgumentError(f"unknown job kind {name!r} (valid: {', '.join(KINDS)})")
    return kind


def kind_of(spec: common_pb2.JobSpec) -> JobKind | None:
    """The kind of ``spec`` (None: it sets none, e.g. a spec a client could not read)."""
    return JOB_KINDS.get(spec.WhichOneof("kind") or "")


def infer_kind(table: Table) -> JobKind | None:
    """The kind a job table means by its keys when it names none."""
    return next((kind for kind in JOB_KINDS.values() if any(table.has(key) for key in kind.marks)), None)


__all__ = [
    "DILOCO",
    "INFERENCE",
    "JOB_KINDS",
    "KINDS",
    "TASK",
    "JobKind",
    "KeyOf",
    "Restart",
    "Source",
    "infer_kind",
    "job_kind",
    "kind_of",
]
