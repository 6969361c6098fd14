"""The task executor run by the job manager: real subprocesses, real signals."""

from __future__ import annotations

import json
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hypha.errors import ResourceExhaustedError
from hypha.v1 import scheduler_pb2
from hypha.worker.execution_state import ExecutionState
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.transfer import TensorExchange
from tests.helpers import eventually
from tests.worker.fakes import FakeSchedulerLink, job_processes, python_task, task_dispatch


@pytest.fixture
def link() -> FakeSchedulerLink:
    return FakeSchedulerLink()


@pytest.fixture
async def manager(tmp_path: Path, link: FakeSchedulerLink) -> AsyncIterator[JobManager]:
    settings = JobsSection(
        stop_grace_s=1.0,
        gpus=2,
        max_jobs_per_gpu=2,
        marker_poll_s=0.05,
        marker_exit_grace_s=0.3,
        cleanup="never",
    )
    jobs = JobManager(
        settings,
        tmp_path / "work",
        exchange=TensorExchange(None),
        link_factory=lambda dispatch: link,
        worker_id="worker-1",
        cpu_count=4,
    )
    async with jobs:
        yield jobs


async def test_exit_code_zero_succeeds_and_streams_stdout(
    manager: JobManager, link: FakeSchedulerLink
) -> None:
    # Prepare / Execute
    await manager.dispatch(python_task("ok", "print('hello from the task')"))
    record = await manager.wait("ok", 15)

    # Assert
    assert record.state is ExecutionState.SUCCEEDED
    assert record.exit_code == 0
    assert "hello from the task" in link.lines("stdout")
    assert [s.state for s in link.statuses] == [
        scheduler_pb2.EXECUTION_STATE_REPORT_RUNNING,
        scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED,
    ]


async def test_non_zero_exit_fails_with_the_last_stderr_line(
    manager: JobManager, link: FakeSchedulerLink
) -> None:
    code = "import sys; print('boom: bad input', file=sys.stderr); sys.exit(3)"
    await manager.dispatch(python_task("bad", code))
    record = await manager.wait("bad", 15)

    assert record.state is ExecutionState.FAILED
    assert record.exit_code == 3
    assert "exit code 3" in record.message and "boom: bad input" in record.message
    assert link.statuses[-1].state == scheduler_pb2.EXECUTION_STATE_REPORT_FAILED
    assert link.statuses[-1].exit_code == 3
    assert "boom: bad input" in link.lines("stderr")


async def test_completion_marker_decides_success_over_exit_code(manager: JobManager) -> None:
    written = (
        "import pathlib, sys; pathlib.Path('out').mkdir(); "
        "pathlib.Path('out/done').write_text('x'); sys.exit(1)"
    )
    await manager.dispatch(python_task("marked", written, marker="out/done"))
    await manager.dispatch(python_task("unmarked", "print('no marker')", marker="out/done"))

    marked = await manager.wait("marked", 15)
    unmarked = await manager.wait("unmarked", 15)

    assert marked.state is ExecutionState.SUCCEEDED
    assert unmarked.state is ExecutionState.FAILED
    assert "completion marker missing" in unmarked.message


async def test_marker_ends_a_task_that_keeps_running(manager: JobManager) -> None:
    code = "import pathlib, time; pathlib.Path('done').write_text('x'); time.sleep(60)"
    await manager.dispatch(python_task("lingers", code, marker="done"))

    record = await manager.wait("lingers", 15)

    assert record.state is ExecutionState.SUCCEEDED
    assert "completion marker" in record.message


async def test_timeout_stops_the_task(manager: JobManager, link: FakeSchedulerLink) -> None:
    await manager.dispatch(python_task("slow", "import time; time.sleep(60)", timeout_s=0.5))

    record = await manager.wait("slow", 15)

    assert record.state is ExecutionState.TIMED_OUT
    assert "timeout" in record.message
    assert link.statuses[-1].state == scheduler_pb2.EXECUTION_STATE_REPORT_TIMED_OUT


_TREE = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    grandchild = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    )
    child = (
        "import subprocess, sys, time, json; "
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
        "print(json.dumps({'grandchild': p.pid}), flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    grandchild_pid = json.loads(proc.stdout.readline())["grandchild"]
    with open("pids.json", "w") as f:
        json.dump({"child": proc.pid, "grandchild": grandchild_pid}, f)
    time.sleep(120)
    """
)


async def test_cancel_kills_the_whole_process_tree(manager: JobManager, tmp_path: Path) -> None:
    # Prepare: a task whose child runs a grandchild that ignores SIGTERM
    await manager.dispatch(python_task("tree", _TREE))
    pids_file = tmp_path / "work" / "jobs" / "tree.task" / "pids.json"
    await eventually(pids_file.exists, timeout=15, message="task wrote its children's pids")
    # (pids inside a sandbox are its own namespace's: count the job's processes as the host sees them)
    assert len(job_processes(tmp_path / "work")) >= 3

    # Execute
    assert await manager.cancel("tree", "user asked")
    record = await manager.wait("tree", 15)

    # Assert: SIGTERM ended the leader and child; SIGKILL after the grace ended the grandchild
    assert record.state is ExecutionState.CANCELLED
    assert record.message == "user asked"
    await eventually(lambda: not job_processes(tmp_path / "work"), timeout=10, message="whole tree gone")


async def test_cancel_only_reaches_the_dispatching_scheduler_s_jobs(manager: JobManager) -> None:
    await manager.dispatch(python_task("mine", "import time; time.sleep(60)", scheduler_id="s-1"))

    assert not await manager.cancel("mine", "not yours", scheduler_id="s-2")
    assert await manager.cancel("mine", "yours", scheduler_id="s-1")
    assert (await manager.wait("mine", 15)).state is ExecutionState.CANCELLED


_SHOW_GPUS = "import os, time; open('gpus', 'w').write(os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(60)"


async def test_cuda_visible_devices_follow_gpu_slots(manager: JobManager, tmp_path: Path) -> None:
    # Prepare: 2 fake GPUs x 2 slots each; four one-GPU tasks fill every slot
    names = [f"gpu-{i}" for i in range(4)]
    for name in names:
        await manager.dispatch(python_task(name, _SHOW_GPUS, gpus=1))
    files = [tmp_path / "work" / "jobs" / f"{name}.task" / "gpus" for name in names]
    await eventually(lambda: all(f.exists() and f.read_text() for f in files), timeout=15)

    # Assert: each GPU went to exactly two tasks, and a fifth GPU task does not fit
    assert sorted(f.read_text() for f in files) == ["0", "0", "1", "1"]
    with pytest.raises(ResourceExhaustedError):
        await manager.dispatch(python_task("gpu-extra", _SHOW_GPUS, gpus=1))

    # Execute: free both GPUs' slots of two tasks, then ask for two GPUs at once
    cpu_only = python_task("cpu-only", _SHOW_GPUS)
    await manager.dispatch(cpu_only)
    for name in names[:2]:
        await manager.cancel(name, "make room")
        await manager.wait(name, 15)
    await manager.dispatch(python_task("gpu-pair", _SHOW_GPUS, gpus=2))
    pair = tmp_path / "work" / "jobs" / "gpu-pair.task" / "gpus"
    cpu = tmp_path / "work" / "jobs" / "cpu-only.task" / "gpus"
    await eventually(lambda: pair.exists() and pair.read_text() and cpu.exists(), timeout=15)

    assert pair.read_text() == "0,1"
    assert cpu.read_text() == ""
    for name in [*names[2:], "gpu-pair", "cpu-only"]:
        await manager.cancel(name, "done")


_ENV = "import json, os; json.dump({'env': dict(os.environ), 'cwd': os.getcwd()}, open('env.json', 'w'))"


async def test_task_environment_is_the_worker_s_promise(manager: JobManager, tmp_path: Path) -> None:
    env = {"MY_SETTING": "42", "CUDA_VISIBLE_DEVICES": "7", "HYPHA_JOB_ID": "spoofed"}
    await manager.dispatch(python_task("env", _ENV, env=env, cpu=3))
    record = await manager.wait("env", 15)
    work_dir = tmp_path / "work" / "jobs" / "env.task"
    seen = json.loads((work_dir / "env.json").read_text())

    assert record.state is ExecutionState.SUCCEEDED
    assert seen["cwd"] == str(work_dir)
    assert seen["env"]["MY_SETTING"] == "42"
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert seen["env"]["HYPHA_JOB_ID"] == "env"
    assert seen["env"]["HYPHA_EXECUTOR"] == "task"
    assert seen["env"]["OMP_NUM_THREADS"] == seen["env"]["HYPHA_TORCH_THREADS"] == "3"
    assert seen["env"]["HYPHA_WORK_DIR"] == str(work_dir)
    assert Path(seen["env"]["HYPHA_BRIDGE_SOCKET"]).parent == work_dir
    assert work_dir.stat().st_mode & 0o777 == 0o700


async def test_unknown_command_fails_the_execution_not_the_worker(manager: JobManager) -> None:
    record = await manager.dispatch(task_dispatch("missing", ["/nonexistent/command-xyz"]))

    assert record.state is ExecutionState.FAILED
    assert "failed to start" in record.message
