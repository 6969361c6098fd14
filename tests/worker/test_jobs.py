"""The job manager's bookkeeping: the execution state machine, GPU slots, leases, cleanup."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.errors import (
    AlreadyExistsError,
    IllegalTransitionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from hypha.market.resources import ExecutorKind
from hypha.v1 import common_pb2, scheduler_pb2, worker_pb2
from hypha.worker.execution_state import TRANSITIONS, ExecutionRecord, ExecutionState, JobDispatch, StopCause
from hypha.worker.gpu_slots import GpuSlots
from hypha.worker.job_manager import JobManager
from hypha.worker.jobs_config import JobsSection
from hypha.worker.jobs_servicer import status_proto
from hypha.worker.transfer import TensorExchange
from tests.helpers import eventually
from tests.worker.fakes import FakeSchedulerLink, python_task

# ---- the state machine -----------------------------------------------------------------------


def test_terminal_states_allow_no_transition() -> None:
    for state in ExecutionState:
        assert (TRANSITIONS[state] == frozenset()) == state.terminal


def test_illegal_transition_names_both_states() -> None:
    record = ExecutionRecord("j", "e")
    with pytest.raises(IllegalTransitionError) as err:
        record.transition(ExecutionState.SUCCEEDED, now=1.0)
    assert "starting" in err.value.message and "succeeded" in err.value.message


@pytest.mark.parametrize(
    ("cause", "end"),
    [
        (StopCause.CANCEL, ExecutionState.CANCELLED),
        (StopCause.TIMEOUT, ExecutionState.TIMED_OUT),
        (StopCause.MARKER, ExecutionState.SUCCEEDED),
    ],
)
def test_stop_cause_decides_the_end_whatever_the_exit_code(cause: StopCause, end: ExecutionState) -> None:
    record = ExecutionRecord("j", "e")
    record.spawned(1.0)
    assert record.request_stop(cause, 2.0, "why")
    assert not record.request_stop(StopCause.CANCEL, 2.5)  # a second stop changes nothing
    assert record.exited(0, 3.0) is end
    assert record.finished_at == 3.0


def test_cancel_before_start_ends_at_once() -> None:
    record = ExecutionRecord("j", "e")
    assert not record.request_stop(StopCause.CANCEL, 1.0, "lease expired")
    assert record.state is ExecutionState.CANCELLED
    assert record.message == "lease expired"


def test_reported_failure_wins_over_exit_code_zero() -> None:
    record = ExecutionRecord("j", "e")
    record.spawned(1.0)
    record.report("failed", "loss is NaN")
    assert record.exited(0, 2.0) is ExecutionState.FAILED
    assert record.message == "loss is NaN"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(list(ExecutionState)), max_size=8))
def test_any_walk_respects_the_table(targets: list[ExecutionState]) -> None:
    record = ExecutionRecord("j", "e")
    for step, target in enumerate(targets):
        before = record.state
        try:
            record.transition(target, float(step))
        except IllegalTransitionError:
            assert target not in TRANSITIONS[before]
            assert record.state is before
        else:
            assert target in TRANSITIONS[before]
    assert status_proto(record).state != worker_pb2.EXECUTION_STATE_UNSPECIFIED


# ---- GPU slots ---------------------------------------------------------------------------------


def test_gpu_slots_spread_then_share_then_refuse() -> None:
    slots = GpuSlots(gpu_count=2, per_gpu=2)
    assert slots.acquire(1, "a") == [0]
    assert slots.acquire(1, "b") == [1]
    assert slots.acquire(2, "c") == [0, 1]
    with pytest.raises(ResourceExhaustedError):
        slots.acquire(1, "d")
    slots.release("c")
    assert slots.in_use() == {0: 1, 1: 1}
    assert slots.acquire(0, "e") == []


@settings(max_examples=50, deadline=None)
@given(
    st.integers(0, 4),
    st.integers(1, 3),
    st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=20),
)
def test_gpu_slots_never_overcommit(gpus: int, per_gpu: int, ops: list[tuple[bool, int]]) -> None:
    slots = GpuSlots(gpus, per_gpu)
    held: dict[int, list[int]] = {}
    for owner, (take, count) in enumerate(ops):
        if take:
            try:
                chosen = slots.acquire(count, owner)
            except ResourceExhaustedError:
                continue
            assert len(set(chosen)) == len(chosen) == count
            held[owner] = chosen
        elif held:
            slots.release(next(iter(held)))
            held.pop(next(iter(held)))
        assert all(used <= per_gpu for used in slots.in_use().values())


# ---- the manager ---------------------------------------------------------------------------------


@pytest.fixture
def link() -> FakeSchedulerLink:
    return FakeSchedulerLink()


def _manager(tmp_path: Path, link: FakeSchedulerLink, **overrides: object) -> JobManager:
    settings = JobsSection(stop_grace_s=1.0, **overrides)
    return JobManager(
        settings,
        tmp_path / "work",
        exchange=TensorExchange(None),
        link_factory=lambda dispatch: link,
        cpu_count=4,
    )


@pytest.fixture
async def manager(tmp_path: Path, link: FakeSchedulerLink) -> AsyncIterator[JobManager]:
    async with _manager(tmp_path, link) as jobs:
        yield jobs


_SLEEP = "import time; time.sleep(60)"


async def test_same_job_and_executor_cannot_run_twice(manager: JobManager) -> None:
    await manager.dispatch(python_task("twice", _SLEEP))
    with pytest.raises(AlreadyExistsError):
        await manager.dispatch(python_task("twice", _SLEEP))
    await manager.cancel("twice", "done")
    await manager.wait("twice", 15)


def test_dispatch_refuses_job_ids_that_are_not_plain_names() -> None:
    dispatch = python_task("../escape", "pass")
    with pytest.raises(InvalidArgumentError):
        dispatch.validate()
    trainer_with_task_spec = JobDispatch(
        "j",
        "l",
        ExecutorKind.DILOCO_TRAINER,
        common_pb2.JobSpec(task=common_pb2.TaskJobSpec(command="x")),
        "s",
    )
    with pytest.raises(InvalidArgumentError):
        trainer_with_task_spec.validate()


async def test_lease_expiry_cancels_only_the_jobs_under_it(manager: JobManager) -> None:
    await manager.dispatch(python_task("a", _SLEEP, lease_id="lease-a"))
    await manager.dispatch(python_task("b", _SLEEP, lease_id="lease-b"))

    stopped = await manager.cancel_jobs_for_lease("lease-a", "lease lease-a expired")
    record = await manager.wait("a", 15)

    assert stopped == ["a"]
    assert record.state is ExecutionState.CANCELLED
    assert record.message == "lease lease-a expired"
    assert manager.get("b").state is ExecutionState.RUNNING
    await manager.cancel("b", "done")
    await manager.wait("b", 15)


def _trainer(lease_id: str, *, attempt: int = 0, scheduler_id: str = "scheduler-1") -> JobDispatch:
    spec = common_pb2.JobSpec(diloco=common_pb2.DilocoJobSpec(dataset="d"))
    return JobDispatch(
        "t",
        lease_id,
        ExecutorKind.DILOCO_TRAINER,
        spec,
        scheduler_id,
        parameter_server_id="ps",
        attempt=attempt,
    )


async def test_expired_lease_leaves_a_diloco_execution_to_its_restarted_scheduler(
    tmp_path: Path, link: FakeSchedulerLink
) -> None:
    # Prepare: a trainer (a sleeper stands in for its program) and a task, under one lease.
    sleeper = [sys.executable, "-c", _SLEEP]
    async with _manager(
        tmp_path, link, reattach_grace_s=30.0, executor_commands={"diloco-trainer": sleeper}
    ) as manager:
        first = await manager.dispatch(_trainer("lease-a"))
        await manager.dispatch(python_task("task", _SLEEP, lease_id="lease-a"))

        # Execute: the lease expires (nobody renewed it); the scheduler comes back with a new one.
        stopped = await manager.cancel_jobs_for_lease("lease-a", "lease lease-a ended", expired=True)
        task = await manager.wait("task", 15)
        with pytest.raises(AlreadyExistsError):  # another scheduler cannot take it
            await manager.dispatch(_trainer("lease-x", scheduler_id="scheduler-2"))
        again = await manager.dispatch(_trainer("lease-b", attempt=3))

        # Assert: the task stopped; the trainer ran on and is the same execution, now under lease-b.
        assert stopped == ["task"] and task.state is ExecutionState.CANCELLED
        assert again.execution_id == first.execution_id and again.state is ExecutionState.RUNNING
        assert await manager.cancel_jobs_for_lease("lease-a", "again", expired=True) == []
        assert manager.get("t").state is ExecutionState.RUNNING  # lease-a is no longer its lease
        await manager.cancel("t", "done")
        await manager.wait("t", 15)


async def test_an_expired_lease_nobody_takes_back_stops_the_execution_after_the_grace(
    tmp_path: Path, link: FakeSchedulerLink
) -> None:
    sleeper = [sys.executable, "-c", _SLEEP]
    async with _manager(
        tmp_path, link, reattach_grace_s=0.5, executor_commands={"diloco-trainer": sleeper}
    ) as manager:
        await manager.dispatch(_trainer("lease-a"))

        await manager.cancel_jobs_for_lease("lease-a", "lease lease-a ended", expired=True)
        record = await manager.wait("t", 15)

        assert record.state is ExecutionState.CANCELLED
        assert "did not take the job back within 0.5 s" in record.message


async def test_threads_share_the_cores_among_running_jobs(manager: JobManager, tmp_path: Path) -> None:
    show = "import os, time; open('threads', 'w').write(os.environ['OMP_NUM_THREADS']); time.sleep(60)"
    await manager.dispatch(python_task("first", show))
    await manager.dispatch(python_task("second", show))
    files = [tmp_path / "work" / "jobs" / f"{name}.task" / "threads" for name in ("first", "second")]
    await eventually(lambda: all(f.exists() and f.read_text() for f in files), timeout=15)

    assert [f.read_text() for f in files] == ["4", "2"]
    for name in ("first", "second"):
        await manager.cancel(name, "done")
        await manager.wait(name, 15)


_RESULT = (
    "import pathlib; p = pathlib.Path('out'); p.mkdir(); (p / 'model.safetensors').write_bytes(b'w');"
    "import sys; sys.exit(int(sys.argv[1]))"
)


async def test_cleanup_on_success_removes_the_work_dir_and_keeps_the_result(
    tmp_path: Path, link: FakeSchedulerLink
) -> None:
    async with _manager(tmp_path, link, cleanup="on_success") as manager:
        good = python_task("good", _RESULT)
        good.spec.task.args.append("0")
        bad = python_task("bad", _RESULT)
        bad.spec.task.args.append("1")
        for dispatch in (good, bad):
            record = await manager.dispatch(dispatch)
            # The bridge is how an executor names its result; here the test names it directly.
            record.result_dir = str(tmp_path / "work" / "jobs" / f"{dispatch.job_id}.task" / "out")
        good_record = await manager.wait("good", 15)
        await manager.wait("bad", 15)

    jobs = tmp_path / "work" / "jobs"
    assert good_record.state is ExecutionState.SUCCEEDED
    assert not (jobs / "good.task").exists()
    assert (jobs / "bad.task").is_dir()  # kept for a later attempt, until retain_s
    kept = manager.result_dir("good")
    assert kept is not None and (kept / "model.safetensors").read_bytes() == b"w"
    assert kept.is_relative_to(tmp_path / "work" / "results")
    assert manager.result_of("good") == (kept, "scheduler-1")
    assert manager.result_of("bad") is not None  # a failed job's named result is kept too


async def test_a_failing_cleanup_step_skips_neither_the_final_report_nor_the_work_dir(
    tmp_path: Path, link: FakeSchedulerLink, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with _manager(tmp_path, link, cleanup="always") as manager:

        def broken(owner: object) -> None:
            raise RuntimeError("GPU bookkeeping broke")

        monkeypatch.setattr(manager.gpus, "release", broken)  # the first cleanup step
        await manager.dispatch(python_task("broken-cleanup", "pass"))
        record = await manager.wait("broken-cleanup", 15)

    assert record.state is ExecutionState.SUCCEEDED
    final = [s for s in link.statuses if s.state == scheduler_pb2.EXECUTION_STATE_REPORT_SUCCEEDED]
    assert len(final) == 1 and final[0].job_id == "broken-cleanup"
    assert link.closed
    assert not (tmp_path / "work" / "jobs" / "broken-cleanup.task").exists()


async def test_stop_cancels_running_jobs_and_refuses_new_ones(
    tmp_path: Path, link: FakeSchedulerLink
) -> None:
    manager = _manager(tmp_path, link)
    await manager.start()
    await manager.dispatch(python_task("running", _SLEEP))

    await manager.stop()

    assert manager.get("running").state is ExecutionState.CANCELLED
    with pytest.raises(UnavailableError):
        await manager.dispatch(python_task("late", "pass"))


async def test_job_logs_reach_the_scheduler_in_order(manager: JobManager, link: FakeSchedulerLink) -> None:
    await manager.dispatch(python_task("chatty", "for i in range(200): print(f'line {i}')"))
    await manager.wait("chatty", 15)

    assert link.lines("stdout") == [f"line {i}" for i in range(200)]
    assert all(line.job_id == "chatty" for line in link.log_lines)
    assert json.dumps(link.lines("system")).count("succeeded") == 1
