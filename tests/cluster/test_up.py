"""``hypha up`` / ``down``: a whole cluster as real processes (``demo``: test_quickstart.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hypha.client.cluster import Cluster
from tests.helpers import cli

# Longer than every inner deadline together (up 60 s, seven probes, restart 90 s, down 60 s, exit 30 s),
# so a failure reports its own message and the node output instead of a bare timeout.
pytestmark = pytest.mark.timeout(450)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def probe(address: str, state: Path) -> subprocess.CompletedProcess[bytes]:
    argv = [*cli("hypha-gateway"), "probe", address, "--certs", str(state / "pki"), "--name", "client"]
    return subprocess.run(argv, capture_output=True, timeout=20)


def test_up_starts_every_node_restarts_a_killed_one_and_down_leaves_no_process(tmp_path: Path) -> None:
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
            probed = probe(node["address"], state)
            assert probed.returncode == 0, (name, probed.stderr)
        # A node killed outright comes back on its address, as compose's unless-stopped does.
        killed = nodes["scheduler"]
        os.kill(int(killed["pid"]), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while True:
            now = (cluster.running() or {}).get("nodes", {}).get("scheduler", {})
            if now.get("pid") not in (None, killed["pid"]) and alive(int(now["pid"])):
                break
            assert up.poll() is None and time.monotonic() < deadline, "the scheduler was not restarted"
            time.sleep(0.1)
        assert now["address"] == killed["address"]
        assert probe(now["address"], state).returncode == 0
        nodes = (cluster.running() or {})["nodes"]
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
