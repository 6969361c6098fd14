"""A torch model factory runs only if the worker's allowlist names it, and nothing is imported before.

``subprocess:run`` with ``args``/``shell`` from the job file was arbitrary
code on every trainer and parameter server; now the worker refuses the
dispatch (PERMISSION_DENIED naming ``worker.jobs.model_factories``) and the
executor refuses again before ``importlib`` sees the path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from hypha import factories, models
from hypha.errors import PermissionDeniedError
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2
from hypha.worker.execution_state import JobDispatch
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.transfer import TensorExchange
from tests.worker.fakes import FakeSchedulerLink

_RUN = "subprocess:run"


def _model(factory: str) -> common_pb2.ModelSpec:
    return common_pb2.ModelSpec(
        type=common_pb2.MODEL_TYPE_TORCH,
        torch_factory=factory,
        config_overrides={"args": '"touch /tmp/pwned"', "shell": "true"},
    )


def _dispatch(factory: str, executor: ExecutorKind) -> JobDispatch:
    spec = common_pb2.JobSpec(name="evil", diloco=common_pb2.DilocoJobSpec(model=_model(factory), rounds=1))
    return JobDispatch("evil", "lease-1", executor, spec, "scheduler-1")


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[JobManager]:
    link = FakeSchedulerLink()
    jobs = JobManager(
        JobsSection(stop_grace_s=1.0, model_factories=["tests.executors.test_training:make_mlp"]),
        tmp_path / "work",
        exchange=TensorExchange(None),
        link_factory=lambda dispatch: link,
        cpu_count=2,
    )
    async with jobs:
        yield jobs


@pytest.mark.parametrize("executor", [ExecutorKind.DILOCO_TRAINER, ExecutorKind.PARAMETER_SERVER])
async def test_the_worker_refuses_a_factory_off_its_allowlist_and_runs_nothing(
    manager: JobManager, executor: ExecutorKind
) -> None:
    with pytest.raises(PermissionDeniedError) as err:
        await manager.dispatch(_dispatch(_RUN, executor))

    assert "subprocess:run" in err.value.message and factories.SETTING in err.value.message
    assert err.value.status is grpc.StatusCode.PERMISSION_DENIED
    assert manager.records() == []  # no execution, no process
    assert not list((manager.work_root / "jobs").iterdir())  # not even a work dir


def test_the_executor_refuses_before_importing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a module whose import alone leaves a mark
    mark = tmp_path / "imported"
    (tmp_path / "evil_factory_module.py").write_text(f"open({str(mark)!r}, 'w').close()\nrun = print\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    # Execute / Assert: not on the list -> refused, and the module never ran
    with pytest.raises(PermissionDeniedError):
        models.build_model(_model("evil_factory_module:run"), None, factories_allowed=[])
    assert not mark.exists()
    with pytest.raises(PermissionDeniedError):
        models.build_model(_model(_RUN), None, factories_allowed=["subprocess:check_call"])


def test_allowlist_entries_are_exact_or_a_whole_module() -> None:
    allowed = ["pkg.models:mlp", "pkg.zoo:*"]
    assert factories.is_allowed("pkg.models:mlp", allowed)
    assert factories.is_allowed("pkg.zoo:resnet", allowed)
    assert not factories.is_allowed("pkg.models:other", allowed)
    assert not factories.is_allowed("pkg.zoo.sub:resnet", allowed)
    assert not factories.is_allowed(_RUN, allowed)


def test_the_worker_hands_its_allowlist_to_the_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(factories.ENV_VAR, factories.to_env(["b:f", "a:*"]))
    assert factories.from_env() == {"a:*", "b:f"}
    monkeypatch.delenv(factories.ENV_VAR)
    assert factories.from_env() == frozenset()
