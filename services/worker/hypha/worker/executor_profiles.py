"""What the worker needs to know of each executor kind, one profile each.

The job manager, the supervisor, the execution and its dispatch ask the
profile rather than which executor a dispatch names, so a new executor kind
is one profile here plus its program under ``hypha.worker.executors``
(``docs/architecture.md``, "Adding a job kind"). A profile says which job
kind's spec the executor runs and which of its requirements it leases, which
module it runs as, how many GPUs it asks, whether it may use the network
itself, what is prepared in its work dir and kept after it, and whether a
restarted scheduler can take it back or re-point it at new peers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from hypha.errors import InvalidArgumentError
from hypha.jobfile.kinds import DILOCO, INFERENCE, TASK, JobKind
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2
from hypha.worker.task_files import keep_outputs, unpack_files


class Rewiring(StrEnum):
    """Which peers a running execution follows when its scheduler dispatches it again."""

    #: Nothing: a new dispatch of a running execution is refused.
    NONE = "none"
    #: The job's trainer list (a parameter server adopts a trainer that replaced a lost one).
    TRAINERS = "trainers"
    #: The job's parameter server (a trainer follows a restored server).
    PARAMETER_SERVER = "parameter-server"


def _no_gpus(spec: common_pb2.JobSpec) -> int:
    return 0


def _no_check(spec: common_pb2.JobSpec, files_bundle: bytes) -> None:
    return None


def _not_named(spec: common_pb2.JobSpec) -> common_pb2.ExecutorRef | None:
    return None


def _trainer_executor(spec: common_pb2.JobSpec) -> common_pb2.ExecutorRef | None:
    ref = spec.diloco.trainer_executor
    return ref if ref.name else None


@dataclass(frozen=True)
class ExecutorProfile:
    """One executor kind as the worker runs it."""

    kind: ExecutorKind
    #: The job kind whose spec it runs.
    job: JobKind
    #: The module a built-in executor runs as (``python -m``); "" runs the job's own command.
    module: str
    #: The part of the spec that says what one execution of this kind needs.
    requirements: Callable[[common_pb2.JobSpec], common_pb2.Requirements]
    #: GPUs the spec asks for beyond its requirements' minimum (a task's ``gpus``).
    gpus: Callable[[common_pb2.JobSpec], int] = _no_gpus
    #: Refuses a spec (and its files bundle) this executor cannot run.
    check: Callable[[common_pb2.JobSpec, bytes], None] = _no_check
    #: Unpacks what ships with the job into its work dir before it starts (None: nothing ships).
    prepare: Callable[[common_pb2.JobSpec, bytes, Path], object] | None = None
    #: After a success, moves the outputs kept as the job's result out of the work dir:
    #: (where they are, what was missing). None: the executor names its result itself.
    keep: Callable[[common_pb2.JobSpec, Path], tuple[Path | None, str]] | None = None
    #: It may use the network itself (our own executors talk only through their bridge).
    own_network: bool = False
    #: A restarted scheduler takes it back as it runs when its lease lapsed meanwhile
    #: (``execution.is_reattach``); otherwise a lost attempt is retried instead.
    reattachable: bool = False
    rewiring: Rewiring = Rewiring.NONE
    #: The worker-configured program (``[[executors]]``) the spec names to run instead of the
    #: built-in one (``reference_job``); None: the built-in one.
    named_executor: Callable[[common_pb2.JobSpec], common_pb2.ExecutorRef | None] = _not_named


def _check_task(spec: common_pb2.JobSpec, files_bundle: bytes) -> None:
    if not spec.task.command:
        raise InvalidArgumentError("task job without a command")
    if bool(spec.task.files_sha256) != bool(files_bundle):
        raise InvalidArgumentError("a task's files bundle and its spec's files_sha256 come together")


PROFILES: Mapping[ExecutorKind, ExecutorProfile] = {
    profile.kind: profile
    for profile in (
        ExecutorProfile(
            kind=ExecutorKind.DILOCO_TRAINER,
            job=DILOCO,
            module="hypha.worker.executors.diloco_trainer",
            requirements=lambda spec: spec.diloco.worker_requirements,
            reattachable=True,
            rewiring=Rewiring.PARAMETER_SERVER,
            named_executor=_trainer_executor,
        ),
        ExecutorProfile(
            kind=ExecutorKind.PARAMETER_SERVER,
            job=DILOCO,
            module="hypha.worker.executors.parameter_server",
            requirements=lambda spec: spec.diloco.parameter_server_requirements,
            reattachable=True,
            rewiring=Rewiring.TRAINERS,
        ),
        ExecutorProfile(
            kind=ExecutorKind.TASK,
            job=TASK,
            module="",
            requirements=lambda spec: spec.task.requirements,
            gpus=lambda spec: spec.task.gpus,
            check=_check_task,
            prepare=lambda spec, bundle, work_dir: unpack_files(spec.task, bundle, work_dir),
            keep=lambda spec, work_dir: keep_outputs(spec.task, work_dir),
            own_network=True,
        ),
        ExecutorProfile(
            kind=ExecutorKind.INFERENCE,
            job=INFERENCE,
            module="hypha.worker.executors.inference",
            requirements=lambda spec: spec.inference.requirements,
        ),
    )
}


def profile(kind: ExecutorKind) -> ExecutorProfile:
    return PROFILES[kind]


__all__ = ["PROFILES", "ExecutorProfile", "Rewiring", "profile"]
