"""The job store: conditional state changes under concurrency, bounded history, and recovery after a crash."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from hypha.errors import FailedPreconditionError, IllegalTransitionError, NotFoundError, UnavailableError
from hypha.jobfile import parse_job_toml
from hypha.scheduler.config import JobsSection
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.records import REDACTED
from hypha.scheduler.restart_recovery import recover
from hypha.scheduler.sqlite_store import MAX_LINE_CHARS, SqliteJobStore
from hypha.scheduler.store import JobStore, LogEntry, WorkerMetric
from hypha.v1 import common_pb2

TASK = parse_job_toml('[job]\ncommand = "true"\n[job.retry]\nmax_attempts = 3')
DILOCO = parse_job_toml(
    '[job]\nname = "d"\ndataset = "x"\nrounds = 5\n[job.model]\nrepository = "a/b"\ntoken = "hf_secret"'
)
P, A, R = JobState.PENDING, JobState.ALLOCATING, JobState.RUNNING
S, F, C = JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> SqliteJobStore:
    return SqliteJobStore(tmp_path / "scheduler.db", clock=FakeClock())


def _running(store: SqliteJobStore, spec: common_pb2.JobSpec = TASK, attempt: int = 1) -> str:
    job = store.create(spec, "client-1")
    store.transition(job.job_id, A, expected=P)
    store.transition(job.job_id, R, expected=A, attempt=attempt, workers=["w1"])
    return job.job_id


def test_jobs_are_created_pending_and_every_change_is_in_their_history(store: SqliteJobStore) -> None:
    job = store.create(TASK, "client-1")
    assert (
        job.state is P and job.kind == "task" and job.submitted_by == "client-1" and job.reason == "submitted"
    )
    store.transition(job.job_id, A, reason="leasing")
    done = store.transition(job.job_id, R, attempt=1, workers=["w1", "w2"])
    assert done.workers == ("w1", "w2") and done.attempt == 1 and done.reason == "leasing"
    assert [(e.kind, e.state) for e in store.events(job.job_id)] == [("state", P), ("state", A), ("state", R)]
    assert [j.job_id for j in store.list_jobs([R])] == [job.job_id]
    assert store.list_jobs([S]) == []
    assert store.counts() == {("task", R): 1}
    with pytest.raises(NotFoundError):
        store.get("nope")


def test_an_illegal_or_stale_transition_changes_nothing(store: SqliteJobStore) -> None:
    job_id = _running(store)
    store.transition(job_id, S, expected=R, exit_code=0)
    with pytest.raises(IllegalTransitionError):
        store.transition(job_id, R)
    with pytest.raises(FailedPreconditionError, match="is succeeded, not running"):
        store.transition(job_id, F, expected=R)
    assert store.get(job_id).state is S
    assert [e.state for e in store.events(job_id)][-1] is S


def test_concurrent_writers_on_separate_connections_make_exactly_one_final_move(tmp_path: Path) -> None:
    # Prepare: one running job, and one writer per thread, each with its own connection.
    path = tmp_path / "scheduler.db"
    job_id = _running(SqliteJobStore(path))
    targets = [S, F, C] * 4
    results: list[object] = [None] * len(targets)
    barrier = threading.Barrier(len(targets))

    def race(i: int) -> None:
        own = SqliteJobStore(path)
        barrier.wait()
        try:
            results[i] = own.transition(job_id, targets[i], expected=R, reason=f"writer {i}").state
        except (FailedPreconditionError, IllegalTransitionError) as err:
            results[i] = err
        finally:
            own.close()

    # Execute
    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)

    # Assert: one winner, the job in the winner's state, one final event
    winners = [i for i, r in enumerate(results) if isinstance(r, JobState)]
    assert len(winners) == 1, results
    store = SqliteJobStore(path)
    final = store.get(job_id)
    assert final.state is targets[winners[0]] and final.reason == f"writer {winners[0]}"
    assert sum(1 for e in store.events(job_id) if e.state.terminal) == 1


def test_progress_never_touches_a_finished_job(store: SqliteJobStore) -> None:
    job_id = _running(store, DILOCO)
    metrics = [WorkerMetric("w1", 12.5, 100, 2.5, 8)]
    updated = store.update(job_id, round=1, loss=2.5, worker_metrics=metrics, message="round 0 complete")
    assert updated is not None and updated.round == 1 and updated.loss == 2.5
    assert store.worker_metrics(job_id) == metrics
    store.transition(job_id, C)
    assert store.update(job_id, round=2, loss=1.0) is None
    assert store.get(job_id).round == 1
    with pytest.raises(NotFoundError):
        store.update("nope", round=1)


def test_progress_events_of_one_round_are_coalesced(store: SqliteJobStore) -> None:
    job_id = _running(store, DILOCO)
    for loss in (3.0, 2.9, 2.8):
        store.update(job_id, round=0, loss=loss)
    store.update(job_id, round=1, loss=2.5)
    store.update(job_id, round=1, loss=2.4)
    progress = [(e.round, e.loss) for e in store.events(job_id) if e.kind == "progress"]
    assert progress == [(0, 2.8), (1, 2.4)]


def test_logs_keep_the_newest_lines_per_job_and_cut_long_ones(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path / "db", max_log_lines=5)
    job_id = store.create(TASK).job_id
    other = store.create(TASK).job_id
    store.append_logs(job_id, [LogEntry(f"line {i}") for i in range(12)])
    store.append_logs(other, [LogEntry("x" * (MAX_LINE_CHARS + 10), stream="stderr")])
    assert [r.line for r in store.logs(job_id)] == [f"line {i}" for i in range(7, 12)]
    kept = store.logs(other)
    assert len(kept) == 1 and len(kept[0].line) == MAX_LINE_CHARS and kept[0].stream == "stderr"
    assert [r.line for r in store.logs(job_id, after=store.logs(job_id)[2].seq)] == ["line 10", "line 11"]
    with pytest.raises(NotFoundError):
        store.append_logs("nope", [LogEntry("x")])


def test_metrics_history_is_kept_per_round(store: SqliteJobStore) -> None:
    job_id = _running(store, DILOCO)
    store.record_metrics(job_id, 0, {"loss": 3.0, "samples": 256}, worker_id="w1")
    store.record_metrics(job_id, 1, {"loss": 2.0})
    assert [(m.round, m.name, m.value) for m in store.metrics(job_id)] == [
        (0, "loss", 3.0),
        (0, "samples", 256.0),
        (1, "loss", 2.0),
    ]


def test_metrics_keep_the_newest_rows_per_job_up_to_the_cap(tmp_path: Path) -> None:
    # A worker reports every round: without a cap a long job grows the table without end.
    store = SqliteJobStore(tmp_path / "db", max_metric_rows=5)
    job_id, other = store.create(DILOCO).job_id, store.create(DILOCO).job_id
    for round_ in range(6):
        store.record_metrics(job_id, round_, {"loss": 10.0 - round_, "samples": 100.0 * round_}, "w1")
    store.record_metrics(other, 0, {"loss": 1.0})

    kept = [(m.round, m.name) for m in store.metrics(job_id)]
    assert kept == [(3, "samples"), (4, "loss"), (4, "samples"), (5, "loss"), (5, "samples")]
    assert [(m.round, m.name) for m in store.metrics(other)] == [(0, "loss")]  # per job
    with contextlib.closing(sqlite3.connect(tmp_path / "db")) as db:  # dropped, not only hidden
        assert db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 6
    assert JobsSection().max_metric_rows == 10_000
    with pytest.raises(ValidationError):
        JobsSection(max_metric_rows=0)


def test_secrets_are_redacted_in_what_leaves_the_store(store: SqliteJobStore) -> None:
    job = store.create(DILOCO)
    assert job.spec.diloco.model.token == "hf_secret"  # kept for the workers
    assert job.to_proto().spec.diloco.model.token == REDACTED
    assert job.to_proto().rounds == 5


CRASH_SCRIPT = """
import os, signal, sys
from hypha.jobfile import parse_job_toml
from hypha.scheduler.lifecycle import JobState as J
from hypha.scheduler.sqlite_store import SqliteJobStore

store = SqliteJobStore(sys.argv[1])
task = parse_job_toml('[job]\\ncommand = "true"\\n[job.retry]\\nmax_attempts = 3')
diloco = parse_job_toml('[job]\\ndataset = "x"\\n[job.model]\\nrepository = "a/b"')
ids = {}
def make(name, spec, *moves, **last):
    job = store.create(spec, "c")
    for i, state in enumerate(moves):
        store.transition(job.job_id, state, **(last if i == len(moves) - 1 else {}))
    ids[name] = job.job_id
make("queued", task)
make("allocating_task", task, J.ALLOCATING)
make("running_task", task, J.ALLOCATING, J.RUNNING, attempt=1)
make("exhausted_task", task, J.ALLOCATING, J.RUNNING, attempt=3)
make("running_diloco", diloco, J.ALLOCATING, J.RUNNING, round=2)
make("resumable_diloco", diloco, J.ALLOCATING, J.RUNNING, round=3)
make("done", task, J.ALLOCATING, J.RUNNING, J.SUCCEEDED)
print(" ".join(f"{k}={v}" for k, v in ids.items()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no close, no cleanup: a crash
"""


def test_recovery_after_a_crash_keeps_history_and_settles_running_jobs(tmp_path: Path) -> None:
    # Prepare: a scheduler process that dies (SIGKILL) with jobs in every state.
    path = tmp_path / "scheduler.db"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASH_SCRIPT), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stderr
    ids = dict(pair.split("=") for pair in proc.stdout.split())

    # Execute: a new process opens the same database and recovers.
    store = SqliteJobStore(path)
    report = recover(store, resumable=lambda job: job.job_id == ids["resumable_diloco"])

    # Assert
    state = {name: store.get(job_id) for name, job_id in ids.items()}
    assert state["queued"].state is P
    assert state["allocating_task"].state is P and "before dispatch" in state["allocating_task"].reason
    assert state["running_task"].state is P and "re-queued (attempt 2 of 3)" in state["running_task"].reason
    assert state["exhausted_task"].state is F and "scheduler restarted" in state["exhausted_task"].reason
    assert state["running_diloco"].state is F and "not resumed" in state["running_diloco"].reason
    assert (
        state["resumable_diloco"].state is A and "resuming from round 3" in state["resumable_diloco"].reason
    )
    assert state["done"].state is S
    assert {j.job_id for j in report.pending} == {
        ids[n] for n in ("queued", "allocating_task", "running_task")
    }
    assert {j.job_id for j in report.failed} == {ids["exhausted_task"], ids["running_diloco"]}
    assert [j.job_id for j in report.resumed] == [ids["resumable_diloco"]]
    # The history from before the crash is all there, followed by the recovery.
    history = [e.state for e in store.events(ids["running_task"])]
    assert history == [P, A, R, P]
    again = recover(store, resumable=lambda job: job.job_id == ids["resumable_diloco"])
    assert again.failed == [] and again.requeued == []  # recovering twice settles nothing more


def test_a_running_inference_job_fails_on_restart_for_its_own_kinds_reason(store: SqliteJobStore) -> None:
    # Prepare: a running inference job, and a hook that would resume anything.
    spec = parse_job_toml(
        '[job]\nkind = "inference"\ninputs = [{ prompt = "hi" }]\n[job.model]\nlocal_path = "/m"'
    )
    job_id = _running(store, spec)

    # Execute
    report = recover(store, resumable=lambda job: True)

    # Assert: inference jobs are never resumed, and the reason says so (not "DiLoCo jobs ...").
    failed = store.get(job_id)
    assert [j.job_id for j in report.failed] == [job_id] and failed.state is F
    assert "inference jobs are not resumed" in failed.reason and "DiLoCo" not in failed.reason


def test_a_diloco_job_that_saved_its_run_state_resumes_after_a_restart(tmp_path: Path) -> None:
    # Prepare: two running DiLoCo jobs, one whose run saved its state; a finished one that had;
    # one still leasing its first workers.
    path = tmp_path / "scheduler.db"
    store = SqliteJobStore(path)
    saved, unsaved, done, leasing = (store.create(DILOCO, "c") for _ in range(4))
    for job in (saved, unsaved, done):
        store.transition(job.job_id, A)
        store.transition(job.job_id, R, round=2)
    store.transition(leasing.job_id, A)
    state = {"version": 1, "completed": 2, "slices": {"epoch": 0}}
    assert store.save_run_state(saved.job_id, state)
    assert store.save_run_state(done.job_id, state)
    store.transition(done.job_id, S)
    store.close()

    # Execute: a new process opens the same database and recovers with the default policy.
    store = SqliteJobStore(path)
    report = recover(store)

    # Assert: the saved one resumes with its state; the other fails; the finished one kept nothing.
    assert [j.job_id for j in report.resumed] == [saved.job_id]
    assert store.get(saved.job_id).state is A
    assert "resuming from round 2" in store.get(saved.job_id).reason
    assert store.run_state(saved.job_id) == state
    assert [j.job_id for j in report.failed] == [unsaved.job_id]
    # The one that never started is queued again, not failed.
    assert [j.job_id for j in report.requeued] == [leasing.job_id]
    assert store.get(leasing.job_id).state is P and "re-queued" in store.get(leasing.job_id).reason
    assert leasing.job_id in {j.job_id for j in report.pending}
    assert store.run_state(done.job_id) is None
    assert not store.save_run_state(done.job_id, state)  # a finished job keeps nothing
    with pytest.raises(NotFoundError):
        store.save_run_state("nope", state)


async def test_async_store_wakes_waiters_on_commit(tmp_path: Path) -> None:
    async with await JobStore.open(tmp_path / "db", clock=FakeClock()) as store:
        job = await store.create(TASK, "c")
        token = store.feed.token(f"job:{job.job_id}")
        assert not token.is_set()
        await store.transition(job.job_id, A)
        assert token.is_set()
        log_token = store.feed.token(f"logs:{job.job_id}")
        waiter = asyncio.ensure_future(log_token.wait())
        await store.append_logs(job.job_id, [LogEntry("hello")])
        await asyncio.wait_for(waiter, 5)
        assert [r.line for r in await store.logs(job.job_id)] == ["hello"]
        assert (await store.last_event_seq(job.job_id)) == (await store.events(job.job_id))[-1].seq
    await store.close()  # idempotent


def test_a_schema_1_store_gains_the_log_columns_and_keeps_its_lines(tmp_path: Path) -> None:
    # Prepare: a store as schema 1 wrote it (logs without worker_name / executor).
    path = tmp_path / "old.db"
    store = SqliteJobStore(path)
    job = store.create(common_pb2.JobSpec(name="t", task=common_pb2.TaskJobSpec(command="true")))
    store.append_logs(job.job_id, [LogEntry("before", worker_id="w")])
    store.close()
    db = sqlite3.connect(path)
    db.executescript(
        "ALTER TABLE logs DROP COLUMN worker_name; ALTER TABLE logs DROP COLUMN executor;"
        " PRAGMA user_version=1;"
    )
    db.close()

    # Execute
    reopened = SqliteJobStore(path)
    reopened.append_logs(job.job_id, [LogEntry("after", worker_id="w", worker_name="w1", executor="task")])

    # Assert
    lines = [(r.line, r.worker_name, r.executor) for r in reopened.logs(job.job_id)]
    assert lines == [("before", "", ""), ("after", "w1", "task")]
    reopened.close()


async def test_a_closed_store_answers_try_again_as_its_scheduler_stops(tmp_path: Path) -> None:
    # The scheduler's server answers a moment longer than its store is open: a worker's report
    # then must be told to try again (UNAVAILABLE), not refused (which fails a trainer).
    store = await JobStore.open(tmp_path / "scheduler.db")
    job = await store.create(common_pb2.JobSpec(name="t", task=common_pb2.TaskJobSpec(command="true")))
    await store.close()

    with pytest.raises(UnavailableError, match="closed"):
        await store.find(job.job_id)
    with pytest.raises(FailedPreconditionError):
        await store.start()  # a closed store is not opened again


def test_a_run_state_is_saved_in_parts_and_only_the_parts_given_are_written(tmp_path: Path) -> None:
    # Prepare: a running job whose run saved three parts.
    store = SqliteJobStore(tmp_path / "scheduler.db")
    job = store.create(DILOCO, "c")
    store.transition(job.job_id, A)
    store.transition(job.job_id, R)
    assert store.save_run_state(job.job_id, {"version": 2, "slices": {"epoch": 0}, "slice/3": ["w", 0]})

    # Execute / Assert: a later save of one part leaves the others as they were...
    assert store.save_run_state(job.job_id, {"slice/7": ["v", 0]})
    assert store.run_state(job.job_id) == {
        "version": 2,
        "slices": {"epoch": 0},
        "slice/3": ["w", 0],
        "slice/7": ["v", 0],
    }
    # ...and one that replaces drops every part it does not give.
    assert store.save_run_state(job.job_id, {"version": 2}, replace=True)
    assert store.run_state(job.job_id) == {"version": 2}
    store.close()
