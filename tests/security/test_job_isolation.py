"""A client's task job on a local cluster cannot read a private key, a node's config or another job.

The probe job does what the issue's attacker did (``find STATE -name '*key*.pem'
-exec cat {} +``) and then walks the whole cluster state dir, printing any
file it can read that holds a private key, a node config or the other job's
secret. It also tries to write outside its work dir (``/tmp``, the cluster's
state dir), to signal each worker and to read each worker's
``/proc/PID/environ``. Run with the default sandbox (bubblewrap here, else
Landlock) or with Landlock it gets nothing; run with
``worker.jobs.sandbox = "none"`` the same probe prints keys and signals its
worker, which shows the probe would catch a leak.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from hypha.worker.sandbox import landlock_abi
from tests.e2e import DATASET, E2ECluster
from tests.helpers import eventually

pytestmark = pytest.mark.timeout(180)

SECRET = "SECRET-OF-THE-OTHER-JOB"

_VICTIM = (
    f"open('secret.txt', 'w').write({SECRET!r}); print('ready', flush=True); import time; time.sleep(120)"
)

_PROBE = textwrap.dedent(
    """
    import os, subprocess, sys
    state = sys.argv[1]
    command = f"find {state} -name '*key*.pem' -exec cat {{}} +"
    found = subprocess.run(command, shell=True, capture_output=True)
    print("find printed", found.stdout.decode().count("PRIVATE KEY-----") // 2, "private key(s)")
    seen = 0
    for root, _, files in os.walk(state):
        for name in files:
            path = os.path.join(root, name)
            try:
                with open(path, errors="replace") as handle:
                    text = handle.read(1 << 20)
            except OSError:
                continue
            seen += 1
            if "PRIVATE KEY" in text or "SECRET-OF-THE-OTHER-JOB" in text or path.endswith(".toml"):
                print("LEAK", path, text[:80].replace(chr(10), " "))
    print("probe done, files readable:", seen)
    def attempt(what, action):
        try:
            action()
            print(what, "ok")
        except OSError as err:
            print(what, "denied", err.errno)
    attempt("OWN", lambda: open("own.txt", "w").write("mine"))
    for path in sys.argv[2].split(","):
        attempt(f"WRITE {path}", lambda: open(path, "w").write("escaped"))
    for pid in sys.argv[3].split(","):
        attempt(f"SIGNAL {pid}", lambda: os.kill(int(pid), 0))
        attempt(f"ENVIRON {pid}", lambda: open(f"/proc/{pid}/environ", "rb").read())
    """
)


def _task(script: str, *args: str, name: str) -> str:
    return "\n".join(
        [
            "[job]",
            f"name = {json.dumps(name)}",
            f"command = {json.dumps(sys.executable)}",
            f"args = {json.dumps(['-c', script, *args])}",
            "timeout_s = 60",
        ]
    )


@pytest.fixture(
    scope="module",
    params=[
        "auto",
        pytest.param("landlock", marks=pytest.mark.skipif(not landlock_abi(), reason="needs Landlock")),
        "none",
    ],
)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    sandbox = request.param
    c = E2ECluster(
        tmp_path_factory.mktemp(f"isolation-{sandbox}"),
        workers=2,
        overrides={"worker": [f"worker.jobs.sandbox={json.dumps(sandbox)}"]},
    )
    c.prepare(samples=256)
    # The nodes start in the dir that holds the cluster's keys, as `hypha up` run from its state
    # dir does: that dir must not become an import path (which Landlock would let jobs read).
    here = os.getcwd()
    os.chdir(c.base)
    try:
        c.start()
    finally:
        os.chdir(here)
    try:
        yield c
    finally:
        c.stop()


async def _output(cluster: E2ECluster, job_id: str) -> str:
    return "\n".join(line.line for line in await cluster.log_lines(job_id))


async def test_a_job_reads_no_key_no_config_and_no_other_job(cluster: E2ECluster) -> None:
    # Prepare: another job holding a secret in its work dir, running on the other worker
    victim = await cluster.submit(_task(_VICTIM, name="victim"))
    await eventually(
        lambda: _has_line(cluster, victim, "ready"), timeout=60, interval=0.2, message="victim ready"
    )
    state_dir = cluster.cluster.state_dir
    outside = [Path(f"/tmp/hypha-isolation-{uuid.uuid4().hex}"), state_dir / "nodes" / "escaped.toml"]
    workers = [str(info["pid"]) for info in cluster.supervisor.info.values() if info["role"] == "worker"]

    # Execute: the probe, as an ordinary client's task job
    targets = ",".join(map(str, outside))
    probe = await cluster.submit(_task(_PROBE, str(state_dir), targets, ",".join(workers), name="probe"))
    job = await cluster.wait(probe, 60)
    output = await _output(cluster, probe)
    async with cluster.channel() as channel:
        await scheduler_pb2_grpc.SchedulerStub(channel).CancelJob(
            scheduler_pb2.CancelJobRequest(job_id=victim), timeout=10
        )

    # Assert
    escaped = [path for path in outside if path.exists()]
    for path in escaped:
        path.unlink()
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.reason
    assert "probe done" in output and "OWN ok" in output, output
    mode = cluster.cluster.overrides["worker"][-1].partition("=")[2]
    if mode == '"none"':
        # Unconfined, the same probe prints the keys, writes anywhere and signals its worker: it
        # would see a leak. (Reading the worker's environ it may not: the worker is non-dumpable.)
        assert "PRIVATE KEY" in output and "LEAK" in output
        assert "find printed 0 private key(s)" not in output
        assert escaped == outside
        assert any(f"SIGNAL {pid} ok" in output for pid in workers), output
    else:
        assert "PRIVATE KEY" not in output, output
        assert SECRET not in output, output
        assert "LEAK" not in output, output
        assert "find printed 0 private key(s)" in output
        assert not escaped, output
        for pid in workers:
            assert f"ENVIRON {pid} denied" in output, output
            # Landlock scopes signals (EPERM); bubblewrap's PID namespace hides the worker (ESRCH).
            denied = f"SIGNAL {pid} denied {errno.EPERM}" if mode == '"landlock"' else f"SIGNAL {pid} denied"
            assert denied in output, output


async def _has_line(cluster: E2ECluster, job_id: str, text: str) -> bool:
    return text in await _output(cluster, job_id)


async def test_a_diloco_job_naming_an_unlisted_factory_fails_and_runs_nothing(cluster: E2ECluster) -> None:
    # Prepare: a torch model whose "factory" would run a shell command on every worker
    mark = cluster.base / "factory-ran"
    toml = f"""
[job]
name = "evil"
dataset = "{DATASET}"
rounds = 1
samples_per_round = 32

[job.model]
type = "torch"
torch_factory = "subprocess:run"
config_overrides = {{ args = {json.dumps(json.dumps(f"touch {mark}"))}, shell = "true" }}

[job.resources]
num_workers = 1
"""

    # Execute
    job = await cluster.wait(await cluster.submit(toml), 60)

    # Assert: failed fast, with the worker's reason naming the setting; the command never ran
    assert job.state == common_pb2.JOB_STATE_FAILED
    assert "subprocess:run" in job.reason and "worker.jobs.model_factories" in job.reason, job.reason
    assert not mark.exists()
