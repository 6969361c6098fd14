"""A scheduler set up by hand (``hypha-scheduler init``, then ``run``) keeps its jobs across restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hypha.net.channel import secure_channel
from hypha.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.conftest import Pki
from tests.helpers import NodeProcess, cli
from tests.scheduler.test_servicer import TASK_TOML


def _run(config: Path, workdir: Path) -> NodeProcess:
    node = NodeProcess([*cli("hypha-scheduler"), "run", "--config", str(config)], workdir, "scheduler")
    node.wait_ready()
    return node


@pytest.mark.timeout(120)
async def test_init_writes_a_state_dir_so_a_restarted_scheduler_still_knows_its_jobs(
    pki: Pki, tmp_path: Path
) -> None:
    # Prepare: the README's way, from a relative config path in a working directory.
    init = [*cli("hypha-scheduler"), "init", "--name", "scheduler", "--certs", str(pki.dir)]
    proc = await asyncio.create_subprocess_exec(
        *init, "--out", "conf/scheduler.toml", "--listen", "127.0.0.1:0", cwd=tmp_path
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    config = tmp_path / "conf" / "scheduler.toml"
    assert 'state_dir = "scheduler-state"' in config.read_text()

    # Execute: submit a job, stop the scheduler, start it again.
    node = _run(config, tmp_path)
    try:
        async with secure_channel(pki.tls("client"), node.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            job = await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(toml=TASK_TOML), timeout=10)
    finally:
        assert node.stop() == 0, node.log()
    node = _run(config, tmp_path)
    try:
        async with secure_channel(pki.tls("client"), node.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            again = await stub.GetJob(scheduler_pb2.GetJobRequest(job_id=job.job_id), timeout=10)
    finally:
        assert node.stop() == 0, node.log()

    # Assert: the job survived, in the state dir next to the config file (made absolute).
    assert again.job_id == job.job_id and again.spec.name == job.spec.name
    assert (tmp_path / "conf" / "scheduler-state" / "scheduler.db").is_file()
    assert "no state_dir" not in node.log()
