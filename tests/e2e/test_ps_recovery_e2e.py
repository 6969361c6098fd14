"""A DiLoCo job outlives its parameter server, end to end on a real local cluster.

The cluster: ``worker0`` and ``worker1`` train; ``worker2`` and ``worker3``
only run parameter servers (one serves the job, the other is the spare the
market finds when the first one's machine dies). Every round the parameter
server hands its packed state (θ_global, outer momentum, round) to the
scheduler, before it publishes the next round's update; a lost server is
restored from that state (``docs/fault-tolerance.md``).

1. The server's process is SIGKILLed (its worker lives on): the scheduler
   dispatches a new attempt under the same lease, pushes the kept state and
   re-points the trainers; the restored state equals the kept one bit for bit
   (sha256 over the tensors' bytes, as the server logs it) and no completed
   round is lost.
2. The server's whole worker is SIGKILLed: its lease lapses, the market
   leases the spare, and the job still succeeds.
3. The same after the last round is held, while the server lingers for its
   trainers before it reports: the spare is restored at the job's last round
   and only writes the result, which the job hands out.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.testing.cluster import diloco_toml
from hypha.testing.polling import until
from hypha.v1 import common_pb2
from tests.e2e import E2ECluster, children_of

# NOTE: the bound covers the module's cluster start too (about a minute on a loaded 2-core machine).
pytestmark = pytest.mark.timeout(240)

TRAINERS = ("worker0", "worker1")
SERVERS = ("worker2", "worker3")
#: What the restored server logs (``hypha.worker.executors.parameter_server``).
RESTORED = re.compile(r"restored round (\d+) from the state the scheduler kept \(.* sha256 ([0-9a-f]{64})\)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    ps_only = json.dumps(["parameter-server"])
    c = E2ECluster(
        tmp_path_factory.mktemp("ps-recovery"),
        workers=4,
        overrides={
            "worker": ["worker.jobs.stop_grace_s=2", f"worker.executors={json.dumps(['diloco-trainer'])}"],
            **{name: [f"worker.executors={ps_only}"] for name in SERVERS},
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _server_of(cluster: E2ECluster, job: object) -> str:
    names = [cluster.peer_of(peer) for peer in job.workers]  # type: ignore[attr-defined]
    servers = [name for name in names if name in SERVERS]
    assert len(servers) == 1, names
    return servers[0]


def _kept_states(cluster: E2ECluster, job_id: str) -> list[Path]:
    return sorted((cluster.cluster.state_dir / "nodes" / "scheduler" / "ps-state" / job_id).glob("round-*"))


def _kill_executor(cluster: E2ECluster, worker: str, module: str) -> int:
    """SIGKILL the executor process group of ``module`` under ``worker``; its pid."""
    for pid in children_of(cluster.supervisor.procs[worker].pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if module.encode() in cmdline:
            os.killpg(pid, signal.SIGKILL)
            return pid
    raise AssertionError(f"no {module} executor under {worker}")


async def _job_log(cluster: E2ECluster, job_id: str) -> list[str]:
    return [line.line for line in await cluster.log_lines(job_id)]


async def test_parameter_server_process_killed_mid_job_is_restored_bit_for_bit(cluster: E2ECluster) -> None:
    from hypha.diloco import checkpoint

    started = time.monotonic()
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=3, name="ps-killed"))
    job = await cluster.wait_round(job_id, 1, timeout_s=90)
    server = _server_of(cluster, job)

    _kill_executor(cluster, server, "parameter_server")
    killed = time.monotonic()
    # What is kept until the restore is what it must restore: usually the state kept before the
    # kill, but a commit the server reported just before it died still lands. Every state kept
    # meanwhile is copied (a newer one replaces the file of the one before).
    kept: dict[int, bytes] = {}
    note = re.compile(rf"job {job_id}: parameter server restored on the same worker at round (\d+)")

    def restored_at() -> int | None:
        for path in _kept_states(cluster, job_id):
            with contextlib.suppress(FileNotFoundError):
                kept.setdefault(int(path.stem.split("-")[1]), path.read_bytes())
        found = note.search(cluster.log("scheduler"))
        return int(found.group(1)) if found else None

    round_ = await until(restored_at, "the server restored", 90)
    job = await cluster.wait(job_id, timeout_s=120)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    assert round_ >= 1 and round_ in kept, sorted(kept)  # no completed round lost
    saved = checkpoint.unpack(kept[round_])
    assert saved.round_number == round_
    assert saved.outer["momentum_buffer"] is not None
    lines = await _job_log(cluster, job_id)
    restored = [m.groups() for m in map(RESTORED.search, lines) if m]
    assert restored == [(str(round_), checkpoint.state_digest(saved.outer))], lines[-40:]
    assert _server_of(cluster, job) == server
    print(
        f"ps process killed: {killed - started:.1f}s to the kill, {time.monotonic() - killed:.1f}s to the end"
    )


async def test_parameter_server_worker_killed_mid_job_moves_to_the_spare(cluster: E2ECluster) -> None:
    started = time.monotonic()
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=3, name="ps-worker-killed"))
    job = await cluster.wait_round(job_id, 1, timeout_s=90)
    server = _server_of(cluster, job)
    (spare,) = set(SERVERS) - {server}

    cluster.kill(server)
    killed = time.monotonic()
    job = await cluster.wait(job_id, timeout_s=120)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    assert _server_of(cluster, job) == spare
    lines = await _job_log(cluster, job_id)
    assert any(RESTORED.search(line) for line in lines), lines[-40:]
    assert not _kept_states(cluster, job_id)  # dropped once the job succeeded
    print(
        f"ps worker killed: {killed - started:.1f}s to the kill, {time.monotonic() - killed:.1f}s to the end"
    )


async def test_parameter_server_worker_killed_after_the_last_round_hands_the_result_over_from_the_spare(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    # Prepare: both servers up (the one test 2 killed comes back, as a rebooted machine does).
    for name in SERVERS:
        if not cluster.alive(name):
            cluster.supervisor.restart_node(name)
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=3, name="ps-lost-at-the-end"))
    job = await cluster.wait_round(job_id, 3, timeout_s=90)
    server = _server_of(cluster, job)
    (spare,) = set(SERVERS) - {server}
    # The last round's state is held; the server writes the result and lingers for its trainers.
    assert job.state == common_pb2.JOB_STATE_RUNNING, job.reason

    # Execute
    cluster.kill(server)
    job = await cluster.wait(job_id, timeout_s=120)

    # Assert: the spare wrote the result from the state of the last round; nothing was redone.
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    assert _server_of(cluster, job) == spare
    lines = await _job_log(cluster, job_id)
    restored = [m.group(1) for m in map(RESTORED.search, lines) if m]
    assert restored == ["3"], lines[-40:]
    at = next(i for i, line in enumerate(lines) if RESTORED.search(line))
    assert not [line for line in lines[at:] if " complete: " in line], lines[at:]  # no round redone
    files = {path.name for path in await cluster.fetch_result(job_id, tmp_path)}
    assert {"config.json", "model.safetensors"} <= files, files
