"""A quick chaos run on the shared compose cluster: every role faulted while jobs run, all survive.

``benchmarks/chaos.py --compose --quick`` brings its own cluster; here the
idea (``hypha.testing.compose_chaos``) uses the session's, so CI pays for
one cluster: four jobs one at a time (DiLoCo fp32, DiLoCo int8, a task, DiLoCo
fp32) meet six faults, one per role: trainer, parameter server, task host,
gateway, data node and scheduler. Faults go one at a time, each once the last
has settled, so the jobs must outlast six such turns: with three jobs a CI run
once ended before the scheduler's turn came. Its log is written under the test's tmp dir and
attached to a failure. Speed (time to recover) is the benchmark's figure, not
asserted here; what is asserted is that nothing is lost.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from pathlib import Path

import pytest

from hypha.testing.compose import Cluster, eventually
from hypha.testing.compose_chaos import ChaosRun, plan_faults, plan_jobs

# The first container test to run also pays for the shared cluster's start (about 2 minutes).
pytestmark = pytest.mark.timeout(1500)

SEED = 29
NODES = ("gw0", "gw1", "data", "scheduler", "worker")


def _healthy(cluster: Cluster, container: str, service: str) -> None:
    eventually(lambda: cluster.health(container) == "healthy", 180, f"{service} {container[:12]} healthy")


def test_every_role_faulted_while_jobs_run_loses_nothing(cluster: Cluster, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    jobs = plan_jobs(4, 10, SEED)
    faults = plan_faults(6, rng)
    log_path = tmp_path / "chaos.log"
    with log_path.open("w") as log_file:
        started = time.monotonic()

        def log(line: str) -> None:
            log_file.write(f"{time.monotonic() - started:7.1f} {line}\n")
            log_file.flush()

        # One job at a time: the shared cluster's 4 workers (and the relay-only one) leave a
        # spare for a DiLoCo job's replacements.
        run = ChaosRun(cluster, jobs, faults, rng, log, concurrency=1)
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
    # The scheduler's own account (its DEBUG audit left out): why a stalled job did not move.
    said = [line for line in (audit.stdout + audit.stderr).splitlines() if " DEBUG " not in line]
    # What matters most first: a CI report keeps the head of a long failure.
    context = "\n".join(
        [
            str(figures),
            *run.post_mortem,
            "--- scheduler log (last 60 lines above DEBUG) ---",
            *said[-60:],
            "--- chaos log ---",
            log_path.read_text()[-10000:],
        ]
    )
    assert figures["jobs"] == 4 and figures["succeeded"] == 4, context
    assert figures["faults"]["total"] >= figures["jobs"], context
    assert figures["roles_hit"] == sorted(
        ["data", "gateway", "parameter-server", "scheduler", "task", "trainer"]
    ), context
    assert figures["lost_rounds"] == 0, context
    assert figures["slices_exactly_once"], context
    assert figures["results_intact"], context
