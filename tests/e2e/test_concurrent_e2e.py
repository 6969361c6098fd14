"""Two DiLoCo jobs at once on one scheduler: both lease their own workers
through the market, train, and succeed; their fetched models load."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.v1 import common_pb2
from tests.e2e import DATASET, E2ECluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(
        tmp_path_factory.mktemp("concurrent-e2e"),
        workers=4,
        overrides={
            "worker": ["worker.jobs.stop_grace_s=2", f"worker.executors={json.dumps(['diloco-trainer'])}"],
            "worker2": [f"worker.executors={json.dumps(['parameter-server'])}"],
            "worker3": [f"worker.executors={json.dumps(['parameter-server'])}"],
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def job_toml(model_dir: Path, name: str) -> str:
    return f"""
[job]
name = "{name}"
dataset = "{DATASET}"
rounds = 2
samples_per_round = 64
min_batch_size = 8
max_batch_size = 8
round_timeout_s = 8

[job.model]
local_path = {json.dumps(str(model_dir))}
type = "causal-lm"

[job.resources]
num_workers = 1
"""


async def test_two_diloco_jobs_at_once_both_succeed(cluster: E2ECluster, tmp_path: Path) -> None:
    ids = await asyncio.gather(*(cluster.submit(job_toml(cluster.model_dir, f"job{i}")) for i in range(2)))

    jobs = await asyncio.gather(*(cluster.wait(job_id, timeout_s=150) for job_id in ids))

    for job in jobs:
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
        assert job.round == 2
    workers = [set(job.workers) for job in jobs]
    assert not workers[0] & workers[1], "the two jobs shared a worker"
    from tests.e2e.test_diloco_e2e import eval_loss

    before = eval_loss(cluster.model_dir, cluster.cluster.data_dir)
    for i, job_id in enumerate(ids):
        files = await cluster.fetch_result(job_id, tmp_path / f"model{i}")
        assert {path.name for path in files} >= {"config.json", "model.safetensors"}
        # Each job trained its own model: it loads and its loss fell.
        after = eval_loss(tmp_path / f"model{i}", cluster.cluster.data_dir)
        assert after < before - 0.3, (i, before, after)
