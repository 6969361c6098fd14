"""Task jobs end to end: a real local cluster runs a command on a leased worker.

The path under test: ``SubmitJob`` -> store (PENDING) -> orchestrator ->
market (advertise, offer, accept) -> ``Worker.DispatchJob`` -> job manager
(process, pipes, log forwarder) -> ``AppendLogs`` / ``ReportJobStatus`` ->
store -> ``GetJob`` / ``GetLogs``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.v1 import common_pb2
from tests.deploy.readme import marked_block
from tests.e2e import E2ECluster
from tests.helpers import cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(tmp_path_factory.mktemp("task-e2e"), workers=2)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def task_toml(script: str, *, max_attempts: int = 1, name: str = "task", extra: str = "") -> str:
    return "\n".join(
        [
            "[job]",
            f"name = {json.dumps(name)}",
            f"command = {json.dumps(sys.executable)}",
            f"args = {json.dumps(['-c', script])}",
            "timeout_s = 60",
            extra,
            "[job.retry]",
            f"max_attempts = {max_attempts}",
            "backoff_base_s = 0.2",
            "backoff_cap_s = 0.5",
        ]
    )


async def test_task_job_runs_on_a_worker_and_its_logs_come_back(cluster: E2ECluster) -> None:
    script = "import sys; print('hello from the task'); print('a warning', file=sys.stderr)"
    job_id = await cluster.submit(task_toml(script, name="hello"))

    job = await cluster.wait(job_id, timeout_s=60)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.reason
    assert job.exit_code == 0
    assert job.attempt == 1
    worker = cluster.peer_of(job.workers[0])
    assert worker.startswith("worker")
    lines = await cluster.log_lines(job_id)
    by_stream = {(line.stream, line.line) for line in lines}
    assert ("stdout", "hello from the task") in by_stream
    assert ("stderr", "a warning") in by_stream
    assert all(line.worker_id == job.workers[0] for line in lines)


async def test_failing_task_is_retried_per_policy_then_fails_with_its_exit_code(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    script = "import sys; print('attempt'); sys.exit(3)"
    job_id = await cluster.submit(task_toml(script, max_attempts=2, name="fails"))

    job = await cluster.wait(job_id, timeout_s=60)

    assert job.state == common_pb2.JOB_STATE_FAILED, job.reason
    assert job.attempt == 2
    assert job.exit_code == 3
    assert "no retries left" in job.reason
    attempts = {line.attempt for line in await cluster.log_lines(job_id) if line.line == "attempt"}
    assert attempts == {1, 2}


async def test_cli_submits_a_task_watches_it_to_success_and_prints_its_logs(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    job_file = tmp_path / "job.toml"
    job_file.write_text(task_toml("print('via the cli')", name="cli"))
    env = {**os.environ, "HYPHA_STATE_DIR": str(cluster.cluster.state_dir)}

    def hypha(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*cli("hypha"), *args], capture_output=True, text=True, env=env, timeout=90, check=False
        )

    submit = await asyncio.to_thread(hypha, "submit", str(job_file), "--watch", "--output", "json")

    assert submit.returncode == 0, submit.stderr
    events = [json.loads(line) for line in submit.stdout.splitlines()]
    job_id = events[0]["job_id"]
    assert events[-1]["job"]["state"] == "succeeded"
    logs = await asyncio.to_thread(hypha, "logs", job_id)
    assert logs.returncode == 0, logs.stderr
    # Each line says which worker (its certificate name) and executor wrote it.
    assert any(re.fullmatch(r"\[\S+ task\] via the cli", line) for line in logs.stdout.splitlines())


def test_readme_task_example_runs_verbatim_from_an_empty_directory(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    """The README's task example, its commands as written: ships train.py, fetches out/."""
    block = marked_block("task-example")
    env = {
        **os.environ,
        "HYPHA_STATE_DIR": str(cluster.cluster.state_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }

    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )

    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    metrics = json.loads((tmp_path / "task-example" / "result" / "out" / "metrics.json").read_text())
    assert metrics == {"epochs": 3, "loss": [1.0, 0.5, 0.3333]}
    assert "trained for 3 epochs, final loss 0.3333" in run.stdout
    assert '{"epochs": 3, "loss": [1.0, 0.5, 0.3333]}' in run.stdout.splitlines()


async def test_shipped_files_are_in_the_work_dir_and_outputs_come_back(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    from hypha.bundles import pack

    (tmp_path / "src" / "data").mkdir(parents=True)
    (tmp_path / "src" / "data" / "numbers.txt").write_text("1\n2\n3\n")
    script = (
        "import pathlib; n = sum(map(int, pathlib.Path('data/numbers.txt').read_text().split()));"
        " pathlib.Path('model').mkdir(); pathlib.Path('model/sum.txt').write_text(str(n));"
        " pathlib.Path('metrics.json').write_text('{}'); pathlib.Path('scratch.bin').write_text('x')"
    )
    toml = task_toml(script, name="outputs", extra='files = ["data"]\noutputs = ["model/", "metrics.json"]')
    job_id = await cluster.submit(toml, files_bundle=pack(["data"], tmp_path / "src"))

    job = await cluster.wait(job_id, timeout_s=60)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.reason
    assert len(job.spec.task.files_sha256) == 64
    files = await cluster.fetch_result(job_id, tmp_path / "fetched")
    names = sorted(p.relative_to(tmp_path / "fetched").as_posix() for p in files)
    assert names == ["metrics.json", "model/sum.txt"]  # only what was declared
    assert (tmp_path / "fetched" / "model" / "sum.txt").read_text() == "6"


async def test_a_missing_declared_output_fails_the_task_naming_it(cluster: E2ECluster) -> None:
    toml = task_toml("print('made nothing')", name="no-output", extra='outputs = ["model/"]')
    job_id = await cluster.submit(toml)

    job = await cluster.wait(job_id, timeout_s=60)

    assert job.state == common_pb2.JOB_STATE_FAILED
    assert "declared output(s) missing: model/" in job.reason


async def test_a_job_naming_files_without_sending_them_is_refused(cluster: E2ECluster) -> None:
    import grpc

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cluster.submit(task_toml("print(1)", extra='files = ["train.py"]'))

    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "job.files" in (refused.value.details() or "")


async def test_a_diloco_job_on_an_unknown_dataset_fails_at_submit(cluster: E2ECluster) -> None:
    import grpc

    toml = '[job]\ndataset = "arithmetc"\nrounds = 1\n[job.model]\nlocal_path = "/nowhere"\n'
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cluster.submit(toml)

    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "dataset 'arithmetc' not found" in (refused.value.details() or "")
    assert loop.time() - started < 20


async def test_cancel_stops_the_task_and_frees_the_worker(cluster: E2ECluster) -> None:
    from hypha.net.channel import secure_channel
    from hypha.net.tls import PathsTls, TlsMaterial
    from hypha.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
    from tests.helpers import eventually

    marker = f"cancel-me-{os.getpid()}-{id(cluster)}"  # in the task's argv: findable in `ps`, sandbox or not
    script = f"import time; print('started', flush=True); time.sleep(120)  # {marker}"
    job_id = await cluster.submit(task_toml(script, name="long"))
    job = await cluster.wait(job_id, timeout_s=60, states=frozenset({common_pb2.JOB_STATE_RUNNING}))

    def task_processes() -> list[str]:
        ps = subprocess.run(
            ["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, timeout=30
        ).stdout
        return [line for line in ps.splitlines() if marker in line]

    await eventually(task_processes, timeout=30, message="the task's process running")
    worker = cluster.node(cluster.peer_of(job.workers[0]))

    async with cluster.channel() as channel:
        await scheduler_pb2_grpc.SchedulerStub(channel).CancelJob(
            scheduler_pb2.CancelJobRequest(job_id=job_id), timeout=10
        )
    job = await cluster.wait(job_id, timeout_s=30)
    assert job.state == common_pb2.JOB_STATE_CANCELLED, job.reason

    admin = TlsMaterial.load(PathsTls.from_certs_dir(cluster.pki_dir, "admin"))
    scheduler_id = cluster.node("scheduler")["peer_id"]

    async def freed() -> bool:
        async with secure_channel(admin, worker["address"]) as channel:
            status = await worker_pb2_grpc.WorkerStub(channel).GetStatus(
                worker_pb2.GetWorkerStatusRequest(), timeout=5
            )
        running = [
            j for j in status.jobs if j.job_id == job_id and j.state == worker_pb2.EXECUTION_STATE_RUNNING
        ]
        held = [
            lease
            for lease in status.leases
            if lease.scheduler_id == scheduler_id and lease.state == common_pb2.LEASE_STATE_ACTIVE
        ]
        return not running and not held

    await eventually(freed, timeout=20, message="the worker's execution stopped and its lease released")
    # The command itself is gone, not just its record.
    await eventually(lambda: not task_processes(), timeout=20, message="the task's process gone")


async def test_restarted_scheduler_keeps_job_history_and_fails_what_was_running(cluster: E2ECluster) -> None:
    done_id = await cluster.submit(task_toml("print('quick')", name="before-restart"))
    done = await cluster.wait(done_id, timeout_s=60)
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.reason
    running_id = await cluster.submit(task_toml("import time; time.sleep(120)", name="cut-short"))
    await cluster.wait(running_id, timeout_s=60, states=frozenset({common_pb2.JOB_STATE_RUNNING}))

    cluster.kill("scheduler")
    cluster.supervisor.restart_node("scheduler")

    after = await cluster.get(done_id)
    assert after.state == common_pb2.JOB_STATE_SUCCEEDED and after.exit_code == 0
    # A running task with no attempts left fails with the documented reason (store.py, "restart").
    cut = await cluster.wait(running_id, timeout_s=30)
    assert cut.state == common_pb2.JOB_STATE_FAILED, cut.reason
    assert "restart" in cut.reason
