"""A running DiLoCo job outlives its scheduler, end to end on a real local cluster.

The scheduler is SIGKILLed mid-job (it releases nothing, as when its machine
dies) and started again with the same identity, state dir and address. It
finds the job in SQLite with the state its run saved (leases, trainers,
slice assignments, round: ``hypha.scheduler.diloco.resume``) and resumes it:

1. Restarted within the leases' life: every lease is taken back (renewed),
   nothing is dispatched again, the parameter server and the trainers never
   stopped; the job SUCCEEDS and no completed round is lost.
2. Restarted after the leases expired: the workers kept the executions
   running (``worker.jobs.reattach_grace_s``); the scheduler leases the
   same workers again and they re-attach the running executions (server
   and both trainers) to the new leases; no trainer is replaced and the
   job SUCCEEDS.
3. Stopped gracefully (SIGTERM) and started again: the stop leaves the job's
   leases to the next start instead of releasing them; all are taken back and
   nothing restarts, as in 1.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest

from hypha.testing.cluster import diloco_toml
from hypha.testing.polling import until
from hypha.v1 import common_pb2
from tests.e2e import E2ECluster

# NOTE: the bound covers the module's cluster start too (about a minute on a loaded 2-core machine).
pytestmark = pytest.mark.timeout(300)

SERVER = "worker2"
#: Test 1's lease life: a restart fits in it even on a loaded machine (the cluster's is 3 s).
LONG_TTL_S = 30.0
#: Test 2's: expired well before the scheduler is back.
SHORT_TTL_S = 3.0
EXPIRED = re.compile(r"lease \S+ of \S+ expired")
RESUMED = re.compile(r"resuming from round (\d+): (\d+) of (\d+) leases taken back")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    c = E2ECluster(
        tmp_path_factory.mktemp("scheduler-restart"),
        workers=3,
        overrides={
            "worker": [
                "worker.jobs.stop_grace_s=2",
                "worker.jobs.reattach_grace_s=60",
                f"worker.executors={json.dumps(['diloco-trainer'])}",
            ],
            SERVER: [f"worker.executors={json.dumps(['parameter-server'])}"],
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _restart_scheduler(cluster: E2ECluster, lease_ttl_s: float | None = None) -> None:
    """SIGKILL the scheduler (if it runs) and start it again at the address the workers know
    (same state dir and key); ``lease_ttl_s``: the lease life it asks for from then on."""
    if lease_ttl_s is not None:
        extra = cluster.cluster.overrides.setdefault("scheduler", [])
        extra[:] = [item for item in extra if not item.startswith("scheduler.lease_ttl_s=")]
        extra.append(f"scheduler.lease_ttl_s={lease_ttl_s}")  # after the cluster's own: it wins
    cluster.kill("scheduler")
    cluster.supervisor.restart_node("scheduler")


def _expired_leases(cluster: E2ECluster) -> int:
    """Accepted leases the workers let expire so far (``hypha.worker.market`` logs each)."""
    return sum(len(EXPIRED.findall(cluster.log(name))) for name in ("worker0", "worker1", SERVER))


def _notes(cluster: E2ECluster, job_id: str) -> list[str]:
    """The job's history messages, from the scheduler's database."""
    from hypha.scheduler.sqlite_store import DB_NAME, SqliteJobStore

    store = SqliteJobStore(cluster.cluster.state_dir / "nodes" / "scheduler" / DB_NAME)
    try:
        return [event.message for event in store.events(job_id)]
    finally:
        store.close()


def _resumed(notes: list[str]) -> tuple[int, int, int]:
    """(round, leases taken back, leases saved) from the job's resume note."""
    found = [m for m in map(RESUMED.search, notes) if m]
    assert len(found) == 1, notes
    return int(found[0].group(1)), int(found[0].group(2)), int(found[0].group(3))


async def _resumed_to_the_end(
    cluster: E2ECluster, job_id: str, round_before: int
) -> tuple[list[str], int, int]:
    """Wait for the job: SUCCEEDED after its 6 rounds, resumed at no round before the one done at
    the stop (no completed round lost). (notes, leases taken back, leases saved)."""
    job = await cluster.wait(job_id, timeout_s=150)
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 6
    notes = _notes(cluster, job_id)
    resumed_at, taken, saved = _resumed(notes)
    assert resumed_at >= round_before
    return notes, taken, saved


async def _run_to_round_1(cluster: E2ECluster, name: str, rounds: int, lease_ttl_s: float) -> tuple[str, int]:
    """Submit a job to a scheduler leasing for ``lease_ttl_s``; (job id, round) once round 1 is done."""
    _restart_scheduler(cluster, lease_ttl_s)  # no job runs yet
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=rounds, name=name))
    job = await cluster.wait_round(job_id, 1, timeout_s=90)
    assert job.state == common_pb2.JOB_STATE_RUNNING, job.reason
    return job_id, int(job.round)


async def _kill_at_round(cluster: E2ECluster, name: str, rounds: int, lease_ttl_s: float) -> tuple[str, int]:
    """``_run_to_round_1``, then SIGKILL the scheduler."""
    job_id, round_ = await _run_to_round_1(cluster, name, rounds, lease_ttl_s)
    cluster.kill("scheduler")
    return job_id, round_


# The SIGKILL tests once saw a trainer replaced after the resume in CI (2 cores running the whole suite):
# a report that reached the restarted scheduler before the job's leases were taken back was
# refused PERMISSION_DENIED, which fails a trainer. Such a report is now answered "try again"
# (``JobRun.resuming``; ``tests/scheduler/test_orchestrator.py``).
async def test_scheduler_killed_and_restarted_within_the_lease_life_resumes_the_job(
    cluster: E2ECluster,
) -> None:
    started = time.monotonic()
    # Six rounds, so the job is still running when the scheduler is back (see the late restart).
    job_id, round_before = await _kill_at_round(cluster, "restart-quick", 6, LONG_TTL_S)
    killed = time.monotonic()
    _restart_scheduler(cluster)
    notes, taken, saved = await _resumed_to_the_end(cluster, job_id, round_before)

    assert (taken, saved) == (3, 3)  # the server and both trainers, never stopped
    assert not any("replaces" in note or "restored" in note for note in notes), f"{notes}\n{cluster.logs()}"
    lines = [line.line for line in await cluster.log_lines(job_id)]
    assert not any("restored round" in line for line in lines), lines[-40:]
    print(f"quick restart: {killed - started:.1f}s to the kill, {time.monotonic() - killed:.1f}s to the end")


async def test_scheduler_stopped_gracefully_and_started_again_takes_the_job_back_as_it_runs(
    cluster: E2ECluster,
) -> None:
    # A SIGTERM (an upgrade, ``docker compose restart``) leaves the job's leases to the next start;
    # releasing them, as it once did, stopped every execution (0 of 3 taken back, all restored).
    job_id, round_before = await _run_to_round_1(cluster, "restart-graceful", 6, LONG_TTL_S)
    cluster.supervisor.restart_node("scheduler")  # SIGTERM, wait for it to end, start on its address
    notes, taken, saved = await _resumed_to_the_end(cluster, job_id, round_before)

    assert (taken, saved) == (3, 3), f"{notes}\n{cluster.logs()}"
    assert not any("replaces" in note or "restored" in note for note in notes), f"{notes}\n{cluster.logs()}"


async def test_scheduler_back_after_the_leases_expired_takes_the_running_executions_back(
    cluster: E2ECluster,
) -> None:
    started = time.monotonic()
    before = _expired_leases(cluster)
    # Six rounds: a trainer finishes the round it was planned for without its scheduler (its
    # first report of a short round is answered with its target), and the test must find the
    # executions still running when the scheduler is back; with three, the round in flight at
    # the kill was sometimes the last one and the trainers were done before the leases expired.
    job_id, round_before = await _kill_at_round(cluster, "restart-late", 6, SHORT_TTL_S)
    killed = time.monotonic()
    # Every lease of the job expires on its worker; the executions run on.
    await until(lambda: _expired_leases(cluster) >= before + 3, "3 leases expired", SHORT_TTL_S + 20)
    _restart_scheduler(cluster)
    notes, taken, saved = await _resumed_to_the_end(cluster, job_id, round_before)

    assert (taken, saved) == (0, 3)
    # Each trainer came back on its own worker, still running: none was replaced.
    assert sum("taken back under lease" in note for note in notes) == 2, f"{notes}\n{cluster.logs()}"
    assert not any("replaces" in note for note in notes), f"{notes}\n{cluster.logs()}"
    # Every worker kept its execution through the expiry and re-attached it (their own logs: a
    # job's log lines sent while the scheduler was away may be dropped when the execution ends).
    for name in ("worker0", "worker1", SERVER):
        worker_log = cluster.log(name)
        assert re.search(rf"job {job_id} \(\S+\) lease \S+ expired: its scheduler is away", worker_log), name
        assert re.search(rf"job {job_id} \(\S+\) taken back by its scheduler", worker_log), name
    print(f"late restart: {killed - started:.1f}s to the kill, {time.monotonic() - killed:.1f}s to the end")
