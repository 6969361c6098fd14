"""``hypha demo``: the main job a newcomer runs first.

It brings up the local cluster if none is running (and stops it again
afterwards), prepares the synthetic arithmetic dataset on the data node,
checks that every node serves and that the dataset is announced, then runs
the training job and reports its figures.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hypha.client.cluster import Cluster, stop_process
from hypha.data.prepare import prepare_synthetic
from hypha.net.channel import secure_channel
from hypha.net.probe import probe
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.v1 import data_pb2, data_pb2_grpc

DATASET = "arithmetic"


def ensure_cluster(cluster: Cluster, timeout_s: float = 120.0) -> subprocess.Popen[bytes] | None:
    """Start ``hypha up`` in the background unless a cluster runs; returns what to stop later."""
    if cluster.running():
        return None
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    log = open(cluster.state_dir / "up.log", "ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hypha.client.cli",
            "up",
            "--state-dir",
            str(cluster.state_dir),
            "--workers",
            str(cluster.workers),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while cluster.running() is None:
        if proc.poll() is not None:
            raise RuntimeError(f"hypha up exited with {proc.returncode}; see {cluster.state_dir / 'up.log'}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError("the local cluster did not come up in time")
        time.sleep(0.1)
    return proc


async def check_cluster(cluster: Cluster, state: dict[str, Any]) -> dict[str, Any]:
    tls = TlsMaterial.load(PathsTls.from_certs_dir(cluster.pki_dir, "client"))
    health = {}
    for name, info in state["nodes"].items():
        ok, reason = await probe(tls, info["address"])
        health[name] = reason if ok else f"unhealthy: {reason}"
    async with secure_channel(tls, state["nodes"]["data0"]["address"]) as channel:
        listing = await data_pb2_grpc.DataNodeStub(channel).ListDatasets(
            data_pb2.ListDatasetsRequest(), timeout=10
        )
    datasets = {m.name: m.slice_count for m in listing.datasets}
    return {"health": health, "datasets": datasets}


def demo(state_dir: Path, workers: int, output: str) -> int:
    cluster = Cluster(state_dir, workers)
    started = None
    try:
        started = ensure_cluster(cluster)
        state = cluster.running()
        assert state is not None
        if not (cluster.data_dir / DATASET).exists():
            prepare_synthetic(DATASET, cluster.data_dir, DATASET, samples=4096, samples_per_slice=256, seed=0)
        report = asyncio.run(check_cluster(cluster, state))
        report["workers"] = workers
        healthy = all(v == "SERVING" for v in report["health"].values()) and DATASET in report["datasets"]
        if output == "json":
            print(json.dumps(report))
        else:
            for name, status in report["health"].items():
                print(f"  {name:<10} {status}")
            print(f"  datasets: {report['datasets']}")
        return 0 if healthy else 1
    except RuntimeError as err:
        print(f"hypha demo: error: {err}", file=sys.stderr)
        return 1
    finally:
        if started is not None:
            stop_process(started, grace_s=30)
