"""Elastic DiLoCo jobs end to end: ``ScaleJob`` grows and shrinks a running job.

The cluster: ``worker0``..``worker2`` run trainers, ``worker3`` only runs
parameter servers. The jobs sync with quorum 1 (every trainer), so a round
completes early only when the parameter server takes the newcomer in, and a
shrunk job goes on only when the server stops waiting for the trainer that
left. The parameter server's per-round ``contributors`` figure says how many
trainers delivered each round.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from hypha.testing.cluster import slice_uses, slices_exactly_once
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e import DATASET, E2ECluster

pytestmark = pytest.mark.timeout(300)

TRAINER_EXECUTORS = json.dumps(["diloco-trainer", "task"])
PS_EXECUTORS = json.dumps(["parameter-server"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(
        tmp_path_factory.mktemp("scale-e2e"),
        workers=4,
        overrides={
            # DEBUG: the scheduler's per-slice audit lines (slices used once per epoch).
            "scheduler": ["scheduler.lease_ttl_s=6.0", "log.level=debug"],
            "worker": ["worker.jobs.stop_grace_s=2", f"worker.executors={TRAINER_EXECUTORS}"],
            "worker3": [f"worker.executors={PS_EXECUTORS}"],
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def job_toml(model_dir: Path, *, workers: int, rounds: int, name: str) -> str:
    return f"""
[job]
name = "{name}"
dataset = "{DATASET}"
rounds = {rounds}
samples_per_round = 128
min_batch_size = 8
max_batch_size = 8
quorum = 1.0
round_timeout_s = 20

[job.model]
local_path = {json.dumps(str(model_dir))}
type = "causal-lm"

[job.resources]
num_workers = {workers}
"""


async def scale(cluster: E2ECluster, job_id: str, workers: int) -> scheduler_pb2.Job:
    async with cluster.channel() as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).ScaleJob(
            scheduler_pb2.ScaleJobRequest(job_id=job_id, workers=workers), timeout=10
        )


async def contributors(cluster: E2ECluster, job_id: str) -> dict[int, int]:
    """Round -> trainers whose delta the parameter server used in it."""
    async with cluster.channel() as channel:
        metrics = await scheduler_pb2_grpc.SchedulerStub(channel).GetJobMetrics(
            scheduler_pb2.GetJobMetricsRequest(job_id=job_id), timeout=10
        )
    return {p.round: int(p.value) for p in metrics.points if p.name == "contributors"}


def assert_slices_once(cluster: E2ECluster, job_id: str) -> None:
    slice_count = len(list((cluster.cluster.data_dir / DATASET).glob("slice-*.safetensors")))
    log = cluster.log("scheduler")
    assert slice_uses(log, job_id), "no slice audit lines for the job"
    assert slices_exactly_once(log, slice_count, job_id), slice_uses(log, job_id)


async def test_a_job_grows_from_one_trainer_to_two(cluster: E2ECluster) -> None:
    # A round takes about a second here, a trainer several to start (more on a loaded machine):
    # the job grows as soon as it runs, so the newcomer takes part in most rounds.
    # 60 rounds: enough that a newcomer which takes a minute to start on a loaded runner still joins.
    job_id = await cluster.submit(job_toml(cluster.model_dir, workers=1, rounds=60, name="grows"))
    await cluster.wait(job_id, timeout_s=90, states=frozenset({common_pb2.JOB_STATE_RUNNING}))

    await scale(cluster, job_id, 2)
    job = await cluster.wait(job_id, timeout_s=200)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 60
    per_round = await contributors(cluster, job_id)
    notes = [line.line for line in await cluster.log_lines(job_id)]
    why = f"{per_round}\n" + "\n".join(notes[-60:]) + "\n" + cluster.logs(["scheduler", "worker3"])
    counts = [per_round[r] for r in range(60)]
    assert counts[-1] == 2, why  # the newcomer delivers in the later rounds
    assert counts == sorted(counts), why  # and in every round once it joined (quorum 1)
    trainers = {cluster.peer_of(p) for p in job.workers} - {"worker3"}
    assert len(trainers) == 2, trainers
    assert_slices_once(cluster, job_id)


async def test_a_job_shrinks_from_two_trainers_to_one(cluster: E2ECluster) -> None:
    job_id = await cluster.submit(job_toml(cluster.model_dir, workers=2, rounds=20, name="shrinks"))
    await cluster.wait_round(job_id, 1, timeout_s=90)

    await scale(cluster, job_id, 1)
    job = await cluster.wait(job_id, timeout_s=150)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 20
    per_round = await contributors(cluster, job_id)
    counts = [per_round[r] for r in range(20)]
    assert counts[0] == 2 and counts[-1] == 1, per_round  # the job went on with one trainer
    assert counts == sorted(counts, reverse=True), per_round
    trainers = {cluster.peer_of(p) for p in job.workers} - {"worker3"}
    assert len(trainers) == 1, trainers
    assert_slices_once(cluster, job_id)


async def test_bad_scale_requests_get_a_clear_status(cluster: E2ECluster) -> None:
    task_id = await cluster.submit('[job]\nname = "not-diloco"\ncommand = "true"\n')
    cases = [
        ("no-such-job", 2, grpc.StatusCode.NOT_FOUND),
        (task_id, 0, grpc.StatusCode.INVALID_ARGUMENT),
        (task_id, 2, grpc.StatusCode.FAILED_PRECONDITION),  # only DiLoCo jobs scale
    ]
    for target, workers, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scale(cluster, target, workers)
        assert err.value.code() == code, (target, workers, err.value.details())
