"""A trainer written for the reference system trains in DiLoCo jobs on a real local cluster.

The workers' configs hold the reference's ``[[executors]]`` block for
``reference_trainer.py`` (placeholders and all); the job files name it in
``[job.trainer_executor]``. ``worker0`` and ``worker1`` run trainers, ``worker2``
only parameter servers (ours). ``worker0`` alone also has ``diloco-mixed``
configured, so a job naming that one with ``builtin_fallback`` gets one
reference-style trainer and one of ours. Both jobs succeed and their model
comes back better than it started.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.testing.cluster import E2ECluster, diloco_toml
from hypha.v1 import common_pb2
from tests.e2e.test_diloco_e2e import eval_loss

pytestmark = pytest.mark.timeout(240)

SCRIPT = Path(__file__).with_name("reference_trainer.py")


def executor_block(name: str) -> str:
    """One ``[[executors]]`` entry (as a TOML inline table), as the reference's README writes one."""
    args = [str(SCRIPT), "--socket", "{SOCKET_PATH}", "--work-dir", "{WORK_DIR}", "--job", "{JOB_JSON}"]
    return (
        f'{{class = "train", name = {json.dumps(name)}, runtime = "process", '
        f"cmd = {json.dumps(sys.executable)}, args = {json.dumps(args)}}}"
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    both = f"[{executor_block('diloco-transformer')}]"
    worker0 = f"[{executor_block('diloco-transformer')}, {executor_block('diloco-mixed')}]"
    c = E2ECluster(
        tmp_path_factory.mktemp("reference-e2e"),
        workers=3,
        overrides={
            "worker": [
                "worker.jobs.stop_grace_s=2",
                'worker.executors=["diloco-trainer"]',
                f"worker.jobs.sandbox_paths={json.dumps([str(SCRIPT.parent)])}",
                f"executors={both}",
            ],
            "worker0": [f"executors={worker0}"],
            "worker2": ['worker.executors=["parameter-server"]'],
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


async def _succeeds_and_learns(cluster: E2ECluster, toml: str, tmp_path: Path) -> list[str]:
    job_id = await cluster.submit(toml)
    job = await cluster.wait(job_id, timeout_s=180)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    files = await cluster.fetch_result(job_id, tmp_path / "model")
    assert "model.safetensors" in {path.name for path in files}
    before = eval_loss(cluster.model_dir, cluster.cluster.data_dir)
    after = eval_loss(tmp_path / "model", cluster.cluster.data_dir)
    assert after < before - 0.5, (before, after)
    return [line.line for line in await cluster.log_lines(job_id)]


async def test_two_reference_trainers_and_our_parameter_server(cluster: E2ECluster, tmp_path: Path) -> None:
    toml = diloco_toml(cluster.model_dir, rounds=3, name="reference")
    toml += '\n[job.trainer_executor]\nclass = "train"\nname = "diloco-transformer"\n'

    lines = await _succeeds_and_learns(cluster, toml, tmp_path)

    finished = [line for line in lines if line.startswith("reference trainer: ")]
    assert len(finished) == 2, lines[-40:]


async def test_one_reference_trainer_beside_ours(cluster: E2ECluster, tmp_path: Path) -> None:
    toml = diloco_toml(cluster.model_dir, rounds=3, name="mixed")
    toml += '\n[job.trainer_executor]\nname = "diloco-mixed"\nbuiltin_fallback = true\n'

    lines = await _succeeds_and_learns(cluster, toml, tmp_path)

    finished = [line for line in lines if line.startswith("reference trainer: ")]
    assert len(finished) == 1, lines[-40:]
