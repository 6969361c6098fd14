"""Job kinds live behind one interface: the kind tables, and nothing else, tell them apart.

The core's ``hypha.jobfile.kinds`` says what each job kind is, the
scheduler's ``job_kinds`` which run drives it, the worker's
``executor_profiles`` what each executor kind needs. Every other module asks
them; the grep below keeps it so, since a new kind must not have to touch a
dozen ``if kind == "diloco"`` branches (``docs/architecture.md``, "Adding a
job kind").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hypha.jobfile import parse_job_toml
from hypha.jobfile.kinds import INFERENCE, JOB_KINDS, KINDS, Restart, job_kind, kind_of
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2
from hypha.worker.executor_profiles import PROFILES

REPO = Path(__file__).resolve().parents[1]

_NAMES = "|".join(KINDS)
#: Ways a module branches on a job or executor kind by name.
BRANCHES = [
    re.compile(rf"""(?:==|!=)\s*["'](?:{_NAMES})["']"""),  # kind == "diloco"
    re.compile(rf"""["'](?:{_NAMES})["']\s*(?:==|!=)"""),  # "task" != kind
    re.compile(rf"""\bkind\w*\s+(?:not\s+)?in\s*[(\[{{]\s*["'](?:{_NAMES})["']"""),  # kind in ("task", ...)
    re.compile(rf"""HasField\(\s*["'](?:{_NAMES})["']\s*\)"""),  # spec.HasField("task")
    re.compile(r"""(?:==|!=|\bis\b|\bis not\b)\s*ExecutorKind\.[A-Z]"""),  # executor is ExecutorKind.TASK
    re.compile(r"""ExecutorKind\.[A-Z_]+\s*(?:==|!=|\bis\b)"""),
    re.compile(r"""\bin\s*(?:frozenset\()?[({\[]\s*ExecutorKind\.[A-Z]"""),  # executor in {ExecutorKind...}
    re.compile(r"""\{\s*ExecutorKind\.[A-Z_]+\s*[,}]"""),  # a set of executor kinds
    re.compile(r"""[{,]\s*ExecutorKind\.[A-Z_]+\s*:"""),  # {ExecutorKind.TASK: "task", ...}
    re.compile(r"""isinstance\([^,()]+,\s*(?!Job)\w+Run\)"""),  # isinstance(run, DilocoRun)
    re.compile(r"""\.kind\s*(?:==|!=)\s*\w+Run\.kind"""),  # job.kind == DilocoRun.kind
]
#: The kind tables and the modules of one kind, which may name kinds.
ALLOWED = [
    "libs/hypha/jobfile/kinds.py",
    "libs/hypha/jobfile/diloco.py",
    "libs/hypha/jobfile/task.py",
    "libs/hypha/jobfile/inference.py",
    "libs/hypha/jobfile/common.py",  # the reference system's executor names
    "libs/hypha/market/resources.py",  # where ExecutorKind is defined, with its proto values
    "services/scheduler/hypha/scheduler/job_kinds.py",
    "services/scheduler/hypha/scheduler/task_job.py",
    "services/scheduler/hypha/scheduler/inference_job.py",
    "services/scheduler/hypha/scheduler/diloco_*.py",
    "services/scheduler/hypha/scheduler/diloco/*.py",
    "services/worker/hypha/worker/executor_profiles.py",
    "services/worker/hypha/worker/executors/*.py",
]


def _allowed(relative: str) -> bool:
    return any(Path(relative).match(pattern) for pattern in ALLOWED)


def kind_branches(text: str) -> list[str]:
    """The lines of a module that branch on a job or executor kind by name (comments excepted)."""
    return [
        line.strip()
        for line in text.splitlines()
        if not line.lstrip().startswith("#") and any(pattern.search(line) for pattern in BRANCHES)
    ]


def test_no_module_outside_the_kind_tables_branches_on_a_kind() -> None:
    found = {}
    for root in ("libs", "services"):
        for path in sorted((REPO / root).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            # Generated code, and the test harness (its scenarios name the kinds they drive).
            if "/hypha/v1/" in relative or relative.startswith("libs/testing/") or _allowed(relative):
                continue
            if lines := kind_branches(path.read_text(encoding="utf-8")):
                found[relative] = lines
    assert not found, f"ask hypha.jobfile.kinds / job_kinds / executor_profiles instead: {found}"


@pytest.mark.parametrize(
    "line",
    [
        'if kind == "diloco":',
        'task = spec.task if spec.WhichOneof("kind") == "task" else None',
        "if job.kind == DilocoRun.kind:",
        "if not isinstance(run, DilocoRun):",
        "network=execution.dispatch.executor is ExecutorKind.TASK,",
        'wanted = {ExecutorKind.TASK: "task"}.get(self.executor, "diloco")',
        "REATTACHABLE = frozenset({ExecutorKind.DILOCO_TRAINER})",
        'for kind in ("diloco", "task", "inference"):',
    ],
)
def test_the_grep_catches_each_way_the_old_code_branched(line: str) -> None:
    assert kind_branches(line) == [line]


@pytest.mark.parametrize(
    "line",
    [
        'if kind == "publish":',  # a relay frame's kind
        'if event.kind == "state" and event.state.terminal:',
        "if answer.kind is DirectiveKind.DONE:",
        "executor: ExecutorKind",
        "if isinstance(run, JobRun):",
        '# kind == "task" in a comment',
    ],
)
def test_the_grep_leaves_other_kinds_alone(line: str) -> None:
    assert kind_branches(line) == []


# ---- the tables --------------------------------------------------------------------------------


def test_every_kind_is_one_oneof_field_of_the_spec() -> None:
    oneof = common_pb2.JobSpec.DESCRIPTOR.oneofs_by_name["kind"]
    assert set(JOB_KINDS) == set(KINDS) == {field.name for field in oneof.fields}
    for name, kind in JOB_KINDS.items():
        spec = common_pb2.JobSpec()
        getattr(spec, name).SetInParent()
        assert kind_of(spec) is kind is job_kind(name)
    assert kind_of(common_pb2.JobSpec()) is None


def test_every_executor_kind_has_a_profile_that_runs_a_job_kind() -> None:
    assert set(PROFILES) == set(ExecutorKind)
    for kind, profile in PROFILES.items():
        assert profile.kind is kind and profile.job in JOB_KINDS.values()


def test_an_inference_job_is_not_told_diloco_jobs_are_not_resumed() -> None:
    assert INFERENCE.restart is Restart.FAIL
    assert "inference" in INFERENCE.not_resumed and "DiLoCo" not in INFERENCE.not_resumed
    assert job_kind("diloco").restart is Restart.RESUME and job_kind("task").restart is Restart.RETRY


def test_rounds_attempts_and_dataset_come_from_the_kinds_own_fields() -> None:
    diloco = parse_job_toml(
        '[job]\nkind = "diloco"\ndataset = "d"\nrounds = 7\n[job.model]\nlocal_path = "/m"\n'
    )
    task = parse_job_toml('[job]\ncommand = "true"\n[job.retry]\nmax_attempts = 4\n')
    assert (job_kind("diloco").rounds(diloco), job_kind("diloco").dataset(diloco)) == (7, "d")
    assert (job_kind("task").rounds(task), job_kind("task").max_attempts(task)) == (0, 4)
    assert job_kind("diloco").max_attempts(diloco) == 1 and job_kind("task").dataset(task) == ""


def test_only_a_task_has_a_private_environment_and_files() -> None:
    task = parse_job_toml('[job]\ncommand = "true"\nenv = { KEY = "secret" }\n')
    assert dict(job_kind("task").private_env(task)) == {"KEY": "secret"}
    assert job_kind("task").files(task) is task.task
    for name in ("diloco", "inference"):
        assert job_kind(name).private_env(task) == {} and job_kind(name).files(task) is None


def test_the_model_sources_of_each_kind_are_the_ones_with_tokens() -> None:
    spec = common_pb2.JobSpec()
    spec.diloco.model.token = "hf_1"
    spec.diloco.preprocessor.token = "hf_2"
    sources = job_kind("diloco").sources(spec)
    assert {name: source.token for name, source in sources.items()} == {
        "model": "hf_1",
        "preprocessor": "hf_2",
    }
    assert job_kind("diloco").model(spec) is spec.diloco.model
    assert job_kind("task").model(spec) is None


def test_an_unknown_kind_names_the_valid_ones() -> None:
    with pytest.raises(Exception, match="diloco, task, inference"):
        job_kind("reference")
