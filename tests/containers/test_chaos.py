"""A quick chaos run on the shared compose cluster: every role faulted while jobs run, all survive.

``benchmarks/chaos.py --compose --quick`` brings its own cluster; here the
same run (``hypha.testing.compose_chaos``) uses the session's, so CI pays for
one cluster. Six jobs (four DiLoCo, fp32 and int8, two tasks) meet nine faults,
the first six one per role: trainer, parameter server, task host, gateway,
data node and scheduler. Its log is written under the test's tmp dir and
attached to a failure. Speed (time to recover) is the benchmark's figure, not
asserted here; what is asserted is that nothing is lost.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
from pathlib import Path

import pytest

from hypha.testing.compose import Cluster, eventually
from hypha.testing.compose_chaos import ChaosRun, plan_faults, plan_jobs

pytestmark = pytest.mark.timeout(900)

SEED = 29
NODES = ("gw0", "gw1", "data", "scheduler", "worker")


def _healthy(cluster: Cluster, container: str, service: str) -> None:
    eventually(lambda: cluster.health(container) == "healthy", 180, f"{service} {container[:12]} healthy")


def test_every_role_faulted_while_jobs_run_loses_nothing(cluster: Cluster, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    jobs = plan_jobs(6, 10, SEED)
    faults = plan_faults(9, rng)
    log_path = tmp_path / "chaos.log"
    with log_path.open("w") as log_file:

        def log(line: str) -> None:
            log_file.write(line + "\n")
            log_file.flush()

        run = ChaosRun(cluster, jobs, faults, rng, log)
        try:
            asyncio.run(run.run())
        finally:
            # What the faults stopped is running again before the next test.
            for service in NODES:
                for container in cluster.containers(service, all_states=True):
                    subprocess.run(["docker", "start", container], capture_output=True, timeout=60)
                    _healthy(cluster, container, service)
    (scheduler,) = cluster.containers("scheduler")
    audit = subprocess.run(["docker", "logs", scheduler], capture_output=True, text=True, timeout=120)
    figures = run.figures(audit.stdout + audit.stderr)
    context = f"{figures}\n--- chaos log ---\n{log_path.read_text()[-20000:]}"
    assert figures["jobs"] == 6 and figures["succeeded"] == 6, context
    assert figures["faults"]["total"] >= figures["jobs"], context
    assert figures["roles_hit"] == sorted(
        ["data", "gateway", "parameter-server", "scheduler", "task", "trainer"]
    ), context
    assert figures["lost_rounds"] == 0, context
    assert figures["slices_exactly_once"], context
    assert figures["results_intact"], context
