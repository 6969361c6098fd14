"""``hypha up`` / ``down`` / ``demo``: a whole cluster as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from hypha.client.cluster import Cluster
from tests.helpers import cli


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
                timeout=30,
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


def test_demo_trains_reports_its_figures_as_json_and_stops_the_cluster(tmp_path: Path) -> None:
    state = tmp_path / "demo"
    res = subprocess.run(
        [*cli("hypha"), "demo", "--state-dir", str(state), "--rounds", "3", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    for key in (
        "initial_loss",
        "final_loss",
        "accuracy_before",
        "accuracy_after",
        "bytes_exchanged",
        "data_parallel_bytes",
        "rounds",
        "workers",
        "plot",
    ):
        assert key in report, key
    assert report["final_loss"] < report["initial_loss"]
    assert report["rounds"] == 3 and report["workers"] == 2
    assert report["bytes_exchanged"] < report["data_parallel_bytes"]
    assert Path(report["plot"]).read_bytes().startswith(b"\x89PNG")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(report["model"])  # the fetched model loads
    assert Cluster(state).running() is None
