"""Naming a configured executor: the job file's key, the worker's `[[executors]]`, the command line."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from hypha.errors import FailedPreconditionError, InvalidArgumentError
from hypha.jobfile import normalize_spec, parse_job_toml
from hypha.market.resources import ExecutorKind
from hypha.testing.executors import diloco_spec
from hypha.v1 import common_pb2
from hypha.worker.config import WorkerSettings
from hypha.worker.execution_state import JobDispatch
from hypha.worker.reference_job import configured_argv, configured_executor, job_json

#: The reference README's block for its own trainer, pasted unchanged (but for the wheel's URL).
REFERENCE_BLOCK = """
[[executors]]
class = "train"
name = "diloco-transformer"
runtime = "process"
cmd = "uv"
args = ["run", "--no-project", "--with", "hypha_accelerate_executor.whl", "--",
        "accelerate", "launch", "-m", "hypha.accelerate_executor.training",
        "--socket", "{SOCKET_PATH}", "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]
"""

JOB = """
[job]
dataset = "d"
[job.model]
repository = "owner/repo"
[job.trainer_executor]
class = "train"
name = "diloco-transformer"
"""


def _settings(text: str) -> WorkerSettings:
    tls = {"cert": "cert.pem", "key": "key.pem", "trust": "ca.pem"}
    return WorkerSettings.model_validate({"name": "w", "tls": tls, **tomllib.loads(text)})


def _dispatch(spec: common_pb2.JobSpec, executor: ExecutorKind = ExecutorKind.DILOCO_TRAINER) -> JobDispatch:
    return JobDispatch(
        job_id="job-1",
        lease_id="lease-1",
        executor=executor,
        spec=spec,
        scheduler_id="sched",
        parameter_server_id="ps",
        batch_size=8,
    )


def test_the_reference_executor_block_is_a_worker_config_as_it_stands() -> None:
    settings = _settings(REFERENCE_BLOCK)

    (entry,) = settings.executors
    assert (entry.executor_class, entry.name, entry.runtime, entry.cmd) == (
        "train",
        "diloco-transformer",
        "process",
        "uv",
    )
    with pytest.raises(ValidationError):
        _settings(REFERENCE_BLOCK + REFERENCE_BLOCK)  # one class and name, one entry
    with pytest.raises(ValidationError):
        _settings(REFERENCE_BLOCK.replace('"process"', '"parameter-server"'))


def test_a_job_file_names_the_trainers_executor() -> None:
    ref = parse_job_toml(JOB).diloco.trainer_executor

    assert (ref.executor_class, ref.name, ref.builtin_fallback) == ("train", "diloco-transformer", False)
    with pytest.raises(InvalidArgumentError, match="class"):
        parse_job_toml(JOB.replace('class = "train"', 'class = "aggregate"'))
    with pytest.raises(InvalidArgumentError, match="name"):
        parse_job_toml(JOB.replace('name = "diloco-transformer"', ""))
    assert not parse_job_toml(JOB.split("[job.trainer_executor]")[0]).diloco.HasField("trainer_executor")
    structured = parse_job_toml(JOB)
    structured.diloco.trainer_executor.executor_class = "aggregate"
    with pytest.raises(InvalidArgumentError, match="trainer_executor"):
        normalize_spec(structured)  # a submission without a job file is checked the same


def test_the_worker_runs_the_named_entry_with_its_placeholders_filled(tmp_path: Path) -> None:
    (entry,) = _settings(REFERENCE_BLOCK).executors
    spec = diloco_spec(rounds=2)
    spec.diloco.trainer_executor.name = "diloco-transformer"
    dispatch = _dispatch(spec)

    chosen = configured_executor(dispatch, [entry])
    assert chosen is entry
    document = job_json(dispatch, entry)
    argv, env = configured_argv(entry, tmp_path / "bridge.sock", tmp_path, document)

    assert argv[0] == "uv"
    assert argv[-6:] == [
        "--socket",
        str(tmp_path / "bridge.sock"),
        "--work-dir",
        str(tmp_path),
        "--job",
        document,
    ]
    assert env == {
        "SOCKET_PATH": str(tmp_path / "bridge.sock"),
        "WORK_DIR": str(tmp_path),
        "JOB_JSON": document,
    }
    assert json.loads(document)["executor"]["descriptor"] == {"name": "diloco-transformer"}
    deep = tmp_path / ("d" * 120)
    argv, _ = configured_argv(entry, deep / "bridge.sock", deep, document)
    assert argv[-5] == "bridge.sock"  # too long for sun_path: relative to the working directory


def test_a_worker_without_the_named_entry_refuses_unless_the_job_falls_back() -> None:
    spec = diloco_spec(rounds=2)
    spec.diloco.trainer_executor.name = "elsewhere"

    with pytest.raises(FailedPreconditionError, match="elsewhere"):
        configured_executor(_dispatch(spec), [])
    spec.diloco.trainer_executor.builtin_fallback = True
    assert configured_executor(_dispatch(spec), []) is None
    # The parameter server of such a job is ours, whatever the trainers run.
    spec.diloco.trainer_executor.builtin_fallback = False
    assert configured_executor(_dispatch(spec, ExecutorKind.PARAMETER_SERVER), []) is None
