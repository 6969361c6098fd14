"""The compose cluster from the host: healthy, trains, survives faults, keeps its PKI.

The tests share one cluster (``cluster``, per session, with
test_confinement.py) and run in file order: the faults come after the plain
job, and ``down``/``up`` comes last (what runs after it finds the cluster up again).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from hypha.testing.compose import Cluster, eventually, state

pytestmark = pytest.mark.timeout(1200)

NODES = ("gw0", "gw1", "data", "scheduler", "worker", "worker-relay")
TRAINER = "EXECUTOR_KIND_DILOCO_TRAINER"
FIND_CA_KEYS = "find / \\( -path /proc -o -path /sys \\) -prune -o -name '*ca-key.pem' -print"
FIND_READABLE_KEYS = (
    "find / \\( -path /proc -o -path /sys \\) -prune -o -name '*-key.pem' -readable -print 2>/dev/null"
)


def _trainers(cluster: Cluster, job_id: str) -> list[str]:
    """Peer ids of the workers training ``job_id`` now."""
    found = []
    for view in cluster.workers():
        leases = view.get("leases", [])
        if view.get("job_id") == job_id and any(lease.get("executor") == TRAINER for lease in leases):
            found.append(view["peer"]["peer_id"])
    return found


def _victim(cluster: Cluster, job_id: str) -> tuple[str, str]:
    """(peer id, container) of a trainer of ``job_id`` from the plain ``worker`` service.

    The relay-only worker may train too, but it lives on the edge network and
    has its own fault test; the kill and partition scenarios target a plain one.
    """

    def pick() -> tuple[str, str] | None:
        containers = cluster.peer_ids("worker")
        for peer in _trainers(cluster, job_id):
            if peer in containers:
                return peer, containers[peer]
        return None

    return eventually(pick, 60, "a trainer in the worker service")


#: Rounds of this many samples take ~4 s on 2 cores (256 took 0.5 s): a fault aimed at a job in
#: mid-training lands before the job ends, however slowly the CLI polls (each call ~1 s).
FAULT_SAMPLES = 2048


def _running_round(cluster: Cluster, job_id: str, at_least: int) -> dict[str, Any] | None:
    """The job once it runs at round ``at_least`` or later; a job already ended fails the test
    at once (it ended before its fault could be injected: the scenario would prove nothing)."""
    job = cluster.job(job_id)
    assert state(job) not in ("failed", "cancelled", "succeeded"), job
    return job if state(job) == "running" and int(job.get("round", 0)) >= at_least else None


def test_every_node_is_healthy(cluster: Cluster) -> None:
    for service in NODES:
        containers = cluster.containers(service)
        assert containers, f"no {service} container"
        for container in containers:
            assert cluster.health(container) == "healthy", service
    assert len(cluster.containers("worker")) == 4
    # The one-shot services finished successfully.
    for service in ("pki", "demo-model"):
        (container,) = cluster.containers(service, all_states=True)
        assert cluster.inspect(container)["State"]["ExitCode"] == 0, service


def test_the_ca_key_stays_in_the_pki_volume(cluster: Cluster) -> None:
    for service in NODES:
        for container in cluster.containers(service):
            mounts = [m.get("Name", "") for m in cluster.inspect(container)["Mounts"]]
            assert not any(name.endswith("pki-ca") for name in mounts), (service, mounts)
            found = subprocess.run(
                ["docker", "exec", container, "sh", "-c", FIND_CA_KEYS],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert found.stdout.strip() == "", (service, found.stdout)


def test_each_worker_container_holds_only_its_own_key(cluster: Cluster) -> None:
    """The pool is root's; a worker copies out its own identity, then runs as uid 10001 with no capability."""
    names = []
    for service in ("worker", "worker-relay"):
        for container in cluster.containers(service):
            name = cluster.worker_identity(container)
            assert cluster.ready_name(container) == name, service
            # Readable to the worker's user: its own key, and no other key of the whole container.
            keys = cluster.exec(container, "sh", "-c", FIND_READABLE_KEYS, user="10001")
            assert keys.stdout.split() == [f"/run/hypha/certs/{name}-key.pem"], keys.stdout
            _, status = cluster.worker_process(container)
            assert status["Uid"].split() == ["10001"] * 4 and status["Gid"].split() == ["10001"] * 4, status
            assert status["Groups"] == "", status
            for caps in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                assert int(status[caps], 16) == 0, (caps, status[caps])
            assert status["NoNewPrivs"] == "1", status
            names.append(name)
    assert len(set(names)) == len(names) == len(cluster.containers("worker")) + 1, names


def test_diloco_job_from_the_host(cluster: Cluster, tmp_path: Path) -> None:
    job_id = cluster.submit("compose-diloco", rounds=3)
    job = cluster.wait_job(job_id, timeout=300)
    assert state(job) == "succeeded", job
    fetched = cluster.hypha("fetch", job_id, "--out", str(tmp_path / "model"), timeout=120)
    assert fetched.returncode == 0, fetched.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_hypha_demo_from_the_host_teaches_the_model(cluster: Cluster, tmp_path: Path) -> None:
    """README: ``hypha --scheduler ... --certs ... demo``: the compose cluster trains the demo model."""
    # Fewer inner steps than the demo's 50: a 2-core runner also hosts nine containers.
    argv = [
        "--output",
        "json",
        "demo",
        "--rounds",
        "2",
        "--inner-steps",
        "10",
        "--out",
        str(tmp_path / "demo"),
    ]
    out = cluster.hypha(*argv, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["final_loss"] < report["initial_loss"], report
    assert (tmp_path / "demo" / "demo" / "model.safetensors").is_file()
    assert Path(report["plot"]).is_file()


def _await_replacement(cluster: Cluster, job_id: str, victim_peer: str) -> None:
    """The job lists a replacement for ``victim_peer`` while it still runs, then succeeds.

    The lost trainer is noticed when its lease lapses (the scheduler's 10 s), so the
    job must outlive the fault by more than a lease life plus a replacement, or it
    finishes by quorum with the lost trainer still listed (15 rounds do). The
    replacement is awaited while the job runs, not inferred from the end state.
    """
    replaced = cluster.wait_job(
        job_id,
        timeout=300,
        until=lambda j: (
            state(j) in ("succeeded", "failed", "cancelled")
            or (
                state(j) == "running"
                and victim_peer not in j.get("workers", [])
                and len(j.get("workers", [])) >= 3  # the server and two trainers
            )
        ),
    )
    assert state(replaced) == "running", replaced
    job = cluster.wait_job(job_id, timeout=600)
    assert state(job) == "succeeded", job
    assert victim_peer not in job.get("workers", [])


def test_a_killed_trainer_is_replaced(cluster: Cluster) -> None:
    job_id = cluster.submit("compose-kill", rounds=12, samples=FAULT_SAMPLES)
    eventually(lambda: _running_round(cluster, job_id, 1), 240, "round 1")
    victim_peer, victim = _victim(cluster, job_id)
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True, timeout=60)
    try:
        _await_replacement(cluster, job_id, victim_peer)
    finally:
        subprocess.run(["docker", "start", victim], check=True, capture_output=True, timeout=60)
        eventually(lambda: cluster.health(victim) == "healthy", 120, "the killed worker back")


def test_a_partitioned_trainer_is_replaced_and_rejoins(cluster: Cluster) -> None:
    job_id = cluster.submit("compose-partition", rounds=12, samples=FAULT_SAMPLES)
    eventually(lambda: _running_round(cluster, job_id, 1), 240, "round 1")
    victim_peer, victim = _victim(cluster, job_id)
    networks = cluster.inspect(victim)["NetworkSettings"]["Networks"]
    network = next(n for n in networks if n.endswith("_hypha"))
    address = networks[network]["IPAddress"]  # reconnected at the same IP, which it advertises
    subprocess.run(["docker", "network", "disconnect", network, victim], check=True, timeout=60)
    try:
        _await_replacement(cluster, job_id, victim_peer)
    finally:
        subprocess.run(
            ["docker", "network", "connect", "--ip", address, network, victim], check=True, timeout=60
        )
    # Back on the network, it sells again: the next job may lease it.
    eventually(lambda: cluster.health(victim) == "healthy", 120, "the partitioned worker healthy")
    rejoin = cluster.submit("compose-rejoin", rounds=1)
    assert state(cluster.wait_job(rejoin, timeout=300)) == "succeeded"


def test_a_relay_only_worker_takes_part(cluster: Cluster) -> None:
    (relay,) = cluster.containers("worker-relay")
    relay_peer = next(peer for peer, c in cluster.peer_ids("worker-relay").items() if c == relay)
    # Only it and two other workers sell: the job needs all three (2 trainers + 1 parameter server).
    paused = cluster.containers("worker")[2:]
    for container in paused:
        subprocess.run(["docker", "pause", container], check=True, capture_output=True, timeout=60)
    try:
        job_id = cluster.submit("compose-relay", rounds=2)
        seen: set[str] = set()

        def took_part() -> bool:
            job = cluster.job(job_id)
            seen.update(job.get("workers", []))
            return state(job) in ("succeeded", "failed", "cancelled")

        eventually(took_part, 300, "the relay job")
        assert state(cluster.job(job_id)) == "succeeded"
        assert relay_peer in seen
    finally:
        for container in paused:
            subprocess.run(["docker", "unpause", container], check=True, capture_output=True, timeout=60)


def test_nodes_fail_over_when_their_gateway_dies(cluster: Cluster) -> None:
    job_id = cluster.submit("compose-failover", rounds=8, samples=FAULT_SAMPLES)
    eventually(lambda: _running_round(cluster, job_id, 1), 240, "round 1")
    (gw0,) = cluster.containers("gw0")
    subprocess.run(["docker", "kill", gw0], check=True, capture_output=True, timeout=60)
    try:
        job = cluster.wait_job(job_id, timeout=600)
        assert state(job) == "succeeded", job
    finally:
        subprocess.run(["docker", "start", gw0], check=True, capture_output=True, timeout=60)
        eventually(lambda: cluster.health(gw0) == "healthy", 120, "gw0 back")


def test_scheduler_restart_keeps_the_job_history(cluster: Cluster) -> None:
    before = {job["job_id"]: state(job) for job in _jobs(cluster)}
    assert before, "earlier tests submitted jobs"
    cluster.run("restart", "scheduler", timeout=120)
    (scheduler,) = cluster.containers("scheduler")
    eventually(lambda: cluster.health(scheduler) == "healthy", 120, "the scheduler healthy")
    after = {job["job_id"]: state(job) for job in eventually(lambda: _jobs(cluster), 60, "the job list")}
    assert {k: v for k, v in after.items() if k in before} == before


def test_down_then_up_keeps_the_pki(cluster: Cluster, tmp_path: Path) -> None:
    before = (cluster.certs / "client-cert.pem").read_bytes()
    cluster.run("down", "--timeout", "20", timeout=300)
    cluster.run("up", "-d", "--wait", "--wait-timeout", "480", "--scale", "worker=2", timeout=600)
    (pki,) = cluster.containers("pki", all_states=True)
    logs = subprocess.run(["docker", "logs", pki], capture_output=True, text=True, timeout=60).stdout
    assert "issued" not in logs, logs
    again = cluster.export_certs(tmp_path)
    assert (again / "client-cert.pem").read_bytes() == before
    assert cluster.hypha("status").returncode == 0


def _jobs(cluster: Cluster) -> list[dict[str, Any]]:
    out = cluster.hypha("--output", "json", "status")
    assert out.returncode == 0, out.stderr
    import json

    jobs: list[dict[str, Any]] = json.loads(out.stdout)
    return jobs
