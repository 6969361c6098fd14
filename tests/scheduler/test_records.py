"""The scheduler's plain records and their conversions: to protobuf at the API's edge (secrets
redacted, nothing else lost), to and from the store's rows and JSON columns, and back from what a
worker sends. A field dropped or misplaced in one conversion shows up here, not as a blank column
in a client's table."""

from __future__ import annotations

import json
from pathlib import Path

from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.records import (
    REDACTED,
    JobRecord,
    LogEntry,
    LogRecord,
    WorkerMetric,
    new_job_id,
    redacted,
)
from hypha.scheduler.sqlite_store import SqliteJobStore
from hypha.timestamps import to_seconds, to_timestamp
from hypha.v1 import common_pb2, scheduler_pb2
from tests.helpers import FakeClock


def diloco_spec(token: str = "hf_model", preprocessor_token: str = "hf_pre") -> common_pb2.JobSpec:
    return common_pb2.JobSpec(
        name="train",
        diloco=common_pb2.DilocoJobSpec(
            model=common_pb2.ModelSpec(repository="org/model", token=token),
            preprocessor=common_pb2.PreprocessorSpec(repository="org/pre", token=preprocessor_token),
            dataset="data",
            rounds=7,
        ),
    )


TASK = common_pb2.JobSpec(
    name="job", task=common_pb2.TaskJobSpec(command="true", retry=common_pb2.RetryPolicy(max_attempts=4))
)


def record(spec: common_pb2.JobSpec, kind: str, **fields: object) -> JobRecord:
    values: dict[str, object] = {
        "job_id": "j1",
        "kind": kind,
        "spec": spec,
        "state": JobState.RUNNING,
        "reason": "dispatched",
        "created_at": 1_700_000_000.125,
        "updated_at": 1_700_000_042.5,
    }
    values.update(fields)
    return JobRecord(**values)  # type: ignore[arg-type]


# ---- redaction ------------------------------------------------------------------------------------


def test_tokens_are_redacted_in_a_copy_and_kept_in_the_original() -> None:
    spec = diloco_spec()

    out = redacted(spec)

    assert (out.diloco.model.token, out.diloco.preprocessor.token) == (REDACTED, REDACTED)
    assert (spec.diloco.model.token, spec.diloco.preprocessor.token) == ("hf_model", "hf_pre")
    # Everything else is carried as it was.
    out.diloco.model.token = spec.diloco.model.token
    out.diloco.preprocessor.token = spec.diloco.preprocessor.token
    assert out == spec


def test_an_absent_token_is_not_reported_as_a_redacted_one() -> None:
    out = redacted(diloco_spec(token="", preprocessor_token=""))

    assert (out.diloco.model.token, out.diloco.preprocessor.token) == ("", "")
    assert redacted(TASK) == TASK


def test_every_env_value_of_a_task_is_redacted_however_many_there_are() -> None:
    # Writing into a protobuf map while iterating it once skipped a key, and its value
    # (an API key) reached another client; many keys make such a skip show.
    env = {f"KEY_{i}": f"secret-{i}" for i in range(64)}
    spec = common_pb2.JobSpec(name="job", task=common_pb2.TaskJobSpec(command="true", env=env))

    out = redacted(spec)

    assert dict(out.task.env) == dict.fromkeys(env, REDACTED)
    assert dict(spec.task.env) == env
    assert redacted(spec, env=False) == spec


# ---- JobRecord -> Job -------------------------------------------------------------------------------


def test_a_job_record_reaches_the_api_with_every_field_and_no_secret() -> None:
    # Prepare
    job = record(
        diloco_spec(),
        "diloco",
        round=3,
        loss=1.25,
        workers=("w1", "w2"),
        attempt=2,
        exit_code=-9,
        submitted_by="client-peer",
    )

    # Execute
    msg = job.to_proto()

    # Assert
    assert msg.job_id == "j1" and msg.spec.name == job.name == "train"
    assert msg.state == common_pb2.JOB_STATE_RUNNING and msg.reason == "dispatched"
    assert to_seconds(msg.created_at) == 1_700_000_000.125
    assert to_seconds(msg.updated_at) == 1_700_000_042.5
    assert (msg.round, msg.rounds, msg.loss) == (3, 7, 1.25)
    assert list(msg.workers) == ["w1", "w2"]
    assert (msg.attempt, msg.exit_code, msg.submitted_by) == (2, -9, "client-peer")
    assert msg.spec.diloco.model.token == REDACTED
    assert job.spec.diloco.model.token == "hf_model"  # the record keeps it for the workers
    assert scheduler_pb2.Job.FromString(msg.SerializeToString()) == msg


def test_rounds_and_attempts_come_from_the_spec_of_the_jobs_kind() -> None:
    task, diloco = record(TASK, "task"), record(diloco_spec(), "diloco")

    assert (task.rounds, task.max_attempts) == (0, 4)
    assert (diloco.rounds, diloco.max_attempts) == (7, 1)  # a DiLoCo job is not retried as a whole
    assert task.to_proto().rounds == 0


# ---- WorkerMetric ------------------------------------------------------------------------------------


def test_a_worker_metric_survives_the_proto_and_the_json_column() -> None:
    metric = WorkerMetric("w1", samples_per_second=41.5, samples=2**40, loss=2.25, batch_size=16)

    via_proto = WorkerMetric.from_proto(
        common_pb2.WorkerMetrics.FromString(metric.to_proto().SerializeToString())
    )
    via_json = WorkerMetric.from_dict(json.loads(json.dumps(metric.to_dict())))

    assert via_proto == metric and via_json == metric


def test_a_worker_metric_row_fills_missing_figures_and_coerces_types() -> None:
    sparse = WorkerMetric.from_dict({"worker_id": "w1"})
    loose = WorkerMetric.from_dict({"worker_id": 7, "samples": "12", "loss": "0.5", "batch_size": 8.0})

    assert sparse == WorkerMetric("w1")
    assert loose == WorkerMetric("7", 0.0, 12, 0.5, 8)
    assert isinstance(loose.samples, int) and isinstance(loose.batch_size, int)


# ---- log lines -------------------------------------------------------------------------------------


def test_a_log_line_keeps_every_field_from_the_store_to_the_client_and_back() -> None:
    line = LogRecord(
        seq=5,
        job_id="j1",
        at=1_700_000_000.000_123,
        stream="stderr",
        line="boom",
        worker_id="w1",
        attempt=3,
        worker_name="gpu-box",
        executor="task",
    )

    msg = scheduler_pb2.LogLine.FromString(line.to_proto().SerializeToString())
    entry = LogEntry.from_proto(msg)

    assert (msg.job_id, msg.stream, msg.line, msg.worker_id) == ("j1", "stderr", "boom", "w1")
    assert (msg.attempt, msg.worker_name, msg.executor) == (3, "gpu-box", "task")
    assert entry == LogEntry("boom", "stderr", "w1", 3, 1_700_000_000.000_123, "gpu-box", "task")


def test_a_log_line_without_time_or_stream_is_stamped_later_and_goes_to_stdout() -> None:
    entry = LogEntry.from_proto(scheduler_pb2.LogLine(line="hello", worker_id="w1"))

    assert entry == LogEntry("hello", "stdout", "w1", 0, 0.0)
    with_epoch = LogEntry.from_proto(scheduler_pb2.LogLine(line="x", at=to_timestamp(0.5)))
    assert with_epoch.at == 0.5


# ---- through the store's rows --------------------------------------------------------------------------


def test_records_read_back_from_the_store_are_the_ones_written(tmp_path: Path) -> None:
    # Prepare
    clock = FakeClock(1_700_000_000.0)
    store = SqliteJobStore(tmp_path / "scheduler.db", clock=clock)
    try:
        # Execute: a job created, dispatched, reported on and logged to.
        created = store.create(diloco_spec(), "client-peer")
        clock.now += 1.5
        store.transition(created.job_id, JobState.ALLOCATING)
        store.transition(created.job_id, JobState.RUNNING, attempt=2, workers=["w1", "w2"])
        metrics = (WorkerMetric("w1", 41.5, 512, 2.25, 16), WorkerMetric("w2", 40.0, 500, 2.5, 8))
        store.update(created.job_id, round=3, loss=2.375, worker_metrics=metrics, message="round 3")
        clock.now += 1.0
        store.append_logs(
            created.job_id,
            [
                LogEntry("first", "stderr", "w1", 2, at=1_600_000_000.25, worker_name="box", executor="task"),
                LogEntry("second"),  # no time: the store's clock stamps it
            ],
        )
        job = store.get(created.job_id)
        events = store.events(created.job_id)
        logs = store.logs(created.job_id)
        rows = store.worker_metrics(created.job_id)
    finally:
        store.close()

    # Assert: the job row.
    assert len(created.job_id) == 12
    assert (job.kind, job.state, job.submitted_by) == ("diloco", JobState.RUNNING, "client-peer")
    assert (job.round, job.loss, job.attempt, job.workers) == (3, 2.375, 2, ("w1", "w2"))
    assert (job.created_at, job.updated_at) == (1_700_000_000.0, 1_700_000_001.5)
    assert job.spec == diloco_spec()  # the token is kept in the store, for the workers
    # The progress event's JSON column, and the per-worker rows.
    assert events[-1].kind == "progress" and events[-1].workers == metrics
    assert tuple(rows) == metrics
    # Log rows, in the column order LogRecord is built from.
    assert [(r.line, r.stream, r.worker_id, r.attempt, r.at) for r in logs] == [
        ("first", "stderr", "w1", 2, 1_600_000_000.25),
        ("second", "stdout", "", 0, 1_700_000_002.5),
    ]
    assert (logs[0].worker_name, logs[0].executor, logs[0].job_id) == ("box", "task", created.job_id)
    assert logs[0].seq < logs[1].seq


def test_job_ids_are_short_hex_and_distinct() -> None:
    ids = {new_job_id() for _ in range(1_000)}

    assert len(ids) == 1_000
    assert all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
