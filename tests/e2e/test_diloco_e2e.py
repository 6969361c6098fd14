"""DiLoCo jobs end to end on a real local cluster (gateways, data node, scheduler, workers).

The cluster: ``worker0``..``worker2`` run trainers (and tasks); ``worker3``
only runs parameter servers and advertises an address nobody can reach
(``net.external_addresses = ["127.0.0.1:1"]``): it takes part through the
gateways' relay alone. So every job here has its parameter server behind
the relay: the scheduler accepts, renews, dispatches and pulls the result
through the relay, and the trainers push deltas and pull updates through it.
Two trainers train; the third trainer-capable worker is the spare that
replaces a killed one.

What a job does: the scheduler finds the dataset's provider in the DHT,
leases one parameter server and two trainers, dispatches them; trainers
fetch the tiny GPT-2 from a local path, stream slices from the data node,
run inner AdamW steps under the scheduler's round directives, and exchange
deltas and updates with the parameter server; the final model comes back
through ``FetchResult``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypha.net.channel import secure_channel
from hypha.testing.cluster import diloco_toml, slice_uses, slices_exactly_once
from hypha.testing.polling import eventually
from hypha.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e import DATASET, TERMINAL, E2ECluster

pytestmark = pytest.mark.timeout(180)

TRAINER_EXECUTORS = json.dumps(["diloco-trainer", "task"])
PS_EXECUTORS = json.dumps(["parameter-server"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2ECluster]:
    base = tmp_path_factory.mktemp("diloco-e2e")
    c = E2ECluster(
        base,
        workers=4,
        overrides={
            # NOTE: leases of 6 s, not the harness's 3 s: during a gateway failover a relayed
            # renewal fails (UNAVAILABLE, at once) until both ends have re-attached, and the
            # lease must survive one failed renewal.
            # DEBUG: the scheduler's per-slice audit lines (slices used once per epoch).
            "scheduler": ["scheduler.lease_ttl_s=6.0", "log.level=debug"],
            "worker": [
                "worker.jobs.stop_grace_s=2",
                f"worker.executors={TRAINER_EXECUTORS}",
            ],
            "worker3": [
                f"worker.executors={PS_EXECUTORS}",
                'net.external_addresses=["127.0.0.1:1"]',
                # The parameter server starts warm (a spare started ahead, in Landlock).
                "worker.jobs.sandbox=landlock",
                "worker.jobs.warm_executor=true",
            ],
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def eval_loss(model_dir: Path, data_dir: Path) -> float:
    """Loss of a saved model on the first slices of the dataset (no training)."""
    from transformers import AutoModelForCausalLM

    from hypha.datasets.format import load_slice_file
    from hypha.models import ModelKind, evaluate_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    slices = sorted((data_dir / DATASET).glob("slice-*.safetensors"))[:2]
    return evaluate_loss(model, ModelKind.CAUSAL_LM, [load_slice_file(path) for path in slices])


async def test_diloco_job_trains_through_the_relay_and_the_model_comes_back(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    # The server is to start warm: its worker's spare must be ready before the job is dispatched
    # (on a loaded machine the spare was seen ready 0.1 s after the first job's dispatch).
    await eventually(
        lambda: "warm executor ready" in cluster.log("worker3"),
        timeout=60,
        interval=0.1,
        message="worker3's warm spare ready",
    )
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=3))

    job = await cluster.wait(job_id, timeout_s=150)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    assert job.loss > 0
    names = sorted(cluster.peer_of(peer) for peer in job.workers)
    assert "worker3" in names, names  # the parameter server: reachable only through the relay
    assert len(names) == 3
    starts = [line.line for line in await cluster.log_lines(job_id) if line.line.startswith("started ")]
    assert any(line.startswith("started parameter-server") and line.endswith(", warm)") for line in starts)
    assert not any(line.startswith("started diloco-trainer") and "warm" in line for line in starts), starts
    files = await cluster.fetch_result(job_id, tmp_path / "model")
    assert {path.name for path in files} >= {"config.json", "model.safetensors"}
    before = eval_loss(cluster.model_dir, cluster.cluster.data_dir)
    after = eval_loss(tmp_path / "model", cluster.cluster.data_dir)
    assert after < before - 0.5, (before, after)
    assert_slices_once(cluster, job_id)
    print(f"diloco e2e: {time.monotonic() - started:.1f}s, eval loss {before:.3f} -> {after:.3f}")


def assert_slices_once(cluster: E2ECluster, job_id: str) -> None:
    """Every slice the scheduler counted was used at most once per epoch (all of them in a finished epoch)."""
    slice_count = len(list((cluster.cluster.data_dir / DATASET).glob("slice-*.safetensors")))
    log = cluster.log("scheduler")
    assert slice_uses(log, job_id), "no slice audit lines for the job"
    assert slices_exactly_once(log, slice_count, job_id), slice_uses(log, job_id)


async def test_killed_trainer_is_replaced_and_the_job_still_succeeds(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=5, name="survivor"))
    job = await cluster.wait_round(job_id, 1, timeout_s=90)
    trainers = [cluster.peer_of(peer) for peer in job.workers if cluster.peer_of(peer) != "worker3"]
    victim = trainers[0]
    victim_peer = next(peer for peer in job.workers if cluster.peer_of(peer) == victim)

    cluster.kill(victim)
    job = await cluster.wait(job_id, timeout_s=150)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 5
    final = {cluster.peer_of(peer) for peer in job.workers}
    assert victim not in final
    assert len(final - {"worker3"}) == 2, final
    # The parameter server stopped waiting for the lost trainer (its round went on without it;
    # the newcomer joins once it delivers, if the job has rounds left by then).
    lines = [line.line for line in await cluster.log_lines(job_id)]
    assert any("left" in line and victim_peer in line for line in lines), lines[-40:]
    files = await cluster.fetch_result(job_id, tmp_path / "model")
    assert "model.safetensors" in {path.name for path in files}
    # Replacing a trainer cost no training: the model learned, no slice was used twice.
    before = eval_loss(cluster.model_dir, cluster.cluster.data_dir)
    after = eval_loss(tmp_path / "model", cluster.cluster.data_dir)
    assert after < before - 0.5, (before, after)
    assert_slices_once(cluster, job_id)


async def attached_nodes(cluster: E2ECluster) -> dict[str, str]:
    """Node name -> name of the gateway it is attached to, as the gateways report it."""
    by_id = {info["peer_id"]: name for name, info in cluster.supervisor.info.items()}
    attached: dict[str, str] = {}
    for gateway in ("gw0", "gw1"):
        if not cluster.alive(gateway):
            continue
        async with secure_channel(cluster.client_tls(), cluster.node(gateway)["address"]) as channel:
            reply = await gateway_pb2_grpc.GatewayStub(channel).ListPeers(
                gateway_pb2.ListPeersRequest(), timeout=10
            )
        for peer in reply.peers:
            if peer.gateway_id == cluster.node(gateway)["peer_id"] and peer.peer_id in by_id:
                attached[by_id[peer.peer_id]] = gateway
    return attached


@pytest.mark.timeout(300)  # above its own waits (60 s + 150 s, fetch, evaluation)
async def test_job_survives_the_loss_of_the_gateway_everyone_is_attached_to(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    # Prepare: the gateway most nodes are attached to (gw0 at first; gw1 after an earlier failover).
    nodes = [name for name in cluster.supervisor.info if not name.startswith("gw") and cluster.alive(name)]
    before = await attached_nodes(cluster)
    assert set(before) == set(nodes), before
    victim = max(("gw0", "gw1"), key=lambda gw: list(before.values()).count(gw))
    survivor = "gw1" if victim == "gw0" else "gw0"
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=3, name="no-gateway"))

    # Killed as soon as the job has its workers: leases, dispatch and the first relayed
    # tensor exchanges are all in flight then. A relayed call that reaches a gateway
    # before its target re-attached fails at once (UNAVAILABLE) and is retried.
    async def running_with_its_workers() -> bool:
        job = await cluster.get(job_id)
        assert job.state not in TERMINAL, f"{job.reason}\n{cluster.logs()}"
        return job.state == common_pb2.JOB_STATE_RUNNING and len(job.workers) == 3

    await eventually(running_with_its_workers, timeout=60, interval=0.1, message="job running")

    try:
        # Execute
        cluster.kill(victim)
        job = await cluster.wait(job_id, timeout_s=150)

        # Assert: the job succeeded, every node re-attached to the survivor, the loss fell.
        assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
        assert job.round == 3
        assert await attached_nodes(cluster) == dict.fromkeys(nodes, survivor)
        files = await cluster.fetch_result(job_id, tmp_path / "model")
        assert "model.safetensors" in {path.name for path in files}
        loss_before = eval_loss(cluster.model_dir, cluster.cluster.data_dir)
        loss_after = eval_loss(tmp_path / "model", cluster.cluster.data_dir)
        assert loss_after < loss_before - 0.5, (loss_before, loss_after)
    finally:
        # The cluster is whole again for whatever test runs next.
        if not cluster.alive(victim):
            cluster.supervisor.restart_node(victim)  # at the address and DHT port the others know
