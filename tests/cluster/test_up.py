"""``hypha up`` / ``down``: a whole cluster as real processes (``demo``: test_quickstart.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from hypha.client.cluster import Cluster
from tests.helpers import cli

# Longer than every inner deadline together (up 60 s, six probes, down 60 s, exit 30 s),
# so a failure reports its own message and the node output instead of a bare timeout.
pytestmark = pytest.mark.timeout(360)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_starts_every_node_and_down_leaves_no_process(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = subprocess.Popen(
        [*cli("hypha"), "up", "--state-dir", str(state), "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        cluster = Cluster(state, 2)
        deadline = time.monotonic() + 60
        while cluster.running() is None:
            assert up.poll() is None, up.stdout.read() if up.stdout else ""
            assert time.monotonic() < deadline, "cluster not up in time"
            time.sleep(0.1)
        info = cluster.running()
        assert info is not None
        nodes = info["nodes"]
        assert sorted(nodes) == ["data0", "gw0", "gw1", "scheduler", "worker0", "worker1"]
        for name, node in nodes.items():
            probe = subprocess.run(
                [
                    *cli("hypha-gateway"),
                    "probe",
                    node["address"],
                    "--certs",
                    str(state / "pki"),
                    "--name",
                    "client",
                ],
                capture_output=True,
                timeout=20,
            )
            assert probe.returncode == 0, (name, probe.stderr)
        pids = [int(n["pid"]) for n in nodes.values()]
        res = subprocess.run(
            [*cli("hypha"), "down", "--state-dir", str(state)], capture_output=True, timeout=60
        )
        assert res.returncode == 0, res.stderr
        assert up.wait(30) == 0
        assert not [pid for pid in pids if alive(pid)]
        assert not (state / "cluster.json").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
