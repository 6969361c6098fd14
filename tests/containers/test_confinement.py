"""A client's job on a compose worker is confined: no key, no worker, no other job, no disk but its own.

Runs on the session's cluster (after test_compose.py). Every job here runs on
one worker container, started for this module from the compose file's own
`worker` service (`docker compose run`: same image, identity flow and
sandbox) with the market strategy `flexible`, while the other workers are
paused: the test knows from outside what its jobs share a container with
(that worker's key and process, another job running beside them), and each
lease grants exactly the job's minimum (the service's default, `whole`,
would lease the whole free machine, memory included, to the first job). The
probe (confinement_probe.py) is a task job submitted from the host like any
client's; it tries each thing and reports the errno. A job over its memory
lease comes last (it runs the worker's memory watchdog).
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.testing.compose import Cluster, eventually, state

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).parent
TASK_TOML = """
[job]
name = "{name}"
command = "python3"
args = {args}
files = {files}
outputs = ["out/"]
timeout_s = 300
resources = {{ cpu = 1, memory_gb = {memory_gb} }}

[job.retry]
max_attempts = 1
"""
#: Keeps a secret in its work dir until the test leaves a file named `release` there.
SECRET_JOB = """
import pathlib, sys, time
pathlib.Path("secret.txt").write_text(sys.argv[1])
deadline = time.monotonic() + 240
while not pathlib.Path("release").exists() and time.monotonic() < deadline:
    time.sleep(0.5)
pathlib.Path("out").mkdir()
pathlib.Path("out/done.txt").write_text("released")
"""
#: Does nothing much, and says so in its output.
OK_JOB = """
import pathlib
pathlib.Path("out").mkdir()
pathlib.Path("out/ok.txt").write_text("ok")
"""
#: Allocates (and touches) 100 MB at a time up to 3 GB, three times its 1 GB lease, then holds it.
MEMORY_HOG = """
import time
held = []
for _ in range(30):
    held.append(b"\\x01" * (100 << 20))
    time.sleep(0.2)
time.sleep(240)
"""


def _task(cluster: Cluster, name: str, args: list[str], files: dict[str, str], memory_gb: float = 0.5) -> str:
    """Submit a task job running ``python3 ARGS`` with ``files`` shipped beside it: its id."""
    job_dir = cluster.workdir / name
    job_dir.mkdir()
    for file_name, text in files.items():
        (job_dir / file_name).write_text(text)
    toml = TASK_TOML.format(
        name=name, args=json.dumps(args), files=json.dumps(sorted(files)), memory_gb=memory_gb
    )
    (job_dir / "job.toml").write_text(toml)
    return cluster.submit_file(job_dir / "job.toml")


@pytest.fixture(scope="module")
def pinned(cluster: Cluster) -> Iterator[str]:
    """A `flexible` worker that every job of this module runs on: the other workers are paused meanwhile."""
    others = cluster.containers("worker") + cluster.containers("worker-relay")
    started = cluster.run("run", "-d", "--no-deps", "-e", "HYPHA_WORKER__STRATEGY=flexible", "worker")
    target = cluster.inspect(started.stdout.strip().splitlines()[-1])["Id"]
    try:
        eventually(lambda: cluster.health(target) == "healthy", 300, "the flexible worker healthy")
        for container in others:
            subprocess.run(["docker", "pause", container], check=True, capture_output=True, timeout=60)
        try:
            yield target
        finally:
            for container in others:
                subprocess.run(["docker", "unpause", container], check=True, capture_output=True, timeout=60)
    finally:
        subprocess.run(["docker", "rm", "-f", target], capture_output=True, timeout=120)


def test_a_job_reads_no_key_signals_no_process_and_touches_no_other_files(
    cluster: Cluster, pinned: str, tmp_path: Path
) -> None:
    name = cluster.worker_identity(pinned)  # exactly one identity there, the pool root's alone
    worker_pid, _ = cluster.worker_process(pinned)
    key = f"/run/hypha/certs/{name}-key.pem"
    pool_keys = [f"/pool/worker-{k}/worker-{k}-key.pem" for k in range(1, 13)]  # the test pool's 12

    other = _task(cluster, "confine-other", ["secret.py", secrets.token_hex(16)], {"secret.py": SECRET_JOB})
    eventually(lambda: state(cluster.job(other)) == "running", 240, "the other job running")

    def secret() -> list[str]:
        found = cluster.exec(pinned, "find", "/var/lib/hypha", "-name", "secret.txt", "-path", f"*{other}*")
        return found.stdout.split()

    foreign = eventually(secret, 120, "the other job's secret on the worker")
    targets = {"keys": [key, *pool_keys], "foreign": foreign}
    try:
        probe = _task(
            cluster,
            "confine-probe",
            ["confinement_probe.py", json.dumps(targets)],
            {"confinement_probe.py": (HERE / "confinement_probe.py").read_text()},
        )
        job = cluster.wait_job(probe, timeout=300)
        assert state(job) == "succeeded", job
        assert state(cluster.job(other)) == "running"  # the probe ran beside it
    finally:
        (work_dir,) = {str(Path(path).parent) for path in foreign}
        cluster.exec(pinned, "touch", f"{work_dir}/release")
    assert state(cluster.wait_job(other, timeout=120)) == "succeeded"
    fetched = cluster.hypha("fetch", probe, "--out", str(tmp_path / "probe"), timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    report = json.loads((tmp_path / "probe" / "out" / "probe.json").read_text())

    # It ran on the pinned worker, as the worker's user, and could do a job's work.
    assert report["hostname"] == cluster.inspect(pinned)["Config"]["Hostname"], report
    assert report["uid"] == 10001
    assert report["own_dir"] == "ok" and report["own_status"] == "ok", report
    # (a) No key anywhere in the container: not the worker's own (which exists: EACCES, not
    # ENOENT), not the pool's, not through the worker's or PID 1's /proc root link.
    assert report["keys"][key] == "EACCES", report["keys"]
    assert [path for path, result in report["keys"].items() if result == "ok"] == [], report["keys"]
    assert report["list"]["/pool"] != "ok", report["list"]
    # (b) The worker and PID 1 (docker-init) are out of reach: no signal, no environment.
    assert report["worker_pids"] == [worker_pid], report
    assert report["kill"] == {str(worker_pid): "EPERM", "1": "EPERM"}, report["kill"]
    assert report["environ"][str(worker_pid)] in ("EACCES", "EPERM"), report["environ"]
    assert report["environ"]["1"] in ("EACCES", "EPERM"), report["environ"]
    # (c) Another job's files exist (EACCES) and stay closed; no state dir, work dirs or kept results.
    assert report["foreign"] == dict.fromkeys(foreign, "EACCES"), report["foreign"]
    assert all(result != "ok" for result in report["list"].values()), report["list"]
    # (d) It writes nowhere but its own work dir.
    assert all(result != "ok" for result in report["create"].values()), report["create"]
    # The worker took none of it as a fault: same process, healthy.
    assert cluster.worker_process(pinned)[0] == worker_pid
    eventually(lambda: cluster.health(pinned) == "healthy", 120, "the worker healthy after the probe")


def test_a_job_over_its_memory_lease_fails_and_the_worker_runs_the_next(
    cluster: Cluster, pinned: str
) -> None:
    worker_pid, _ = cluster.worker_process(pinned)
    hog = _task(cluster, "confine-memory", ["hog.py"], {"hog.py": MEMORY_HOG}, memory_gb=1)
    job = cluster.wait_job(hog, timeout=300)
    assert state(job) == "failed", job
    # The watchdog's reason, "... over the 1.000 GB its lease grants (memory_gb)", not a crash of its own.
    assert "memory" in job.get("reason", "") and "(memory_gb)" in job["reason"], job
    # The worker survived it (same process) and runs the next job to the end.
    assert cluster.worker_process(pinned)[0] == worker_pid
    after = _task(cluster, "confine-after", ["ok.py"], {"ok.py": OK_JOB})
    assert state(cluster.wait_job(after, timeout=300)) == "succeeded"
    assert cluster.health(pinned) == "healthy"
