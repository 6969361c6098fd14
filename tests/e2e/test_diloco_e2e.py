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

from hypha.v1 import common_pb2
from tests.e2e import DATASET, E2ECluster

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
            # NOTE: leases of 6 s, not the harness's 3 s: a gateway failover can cost a relayed
            # renewal its whole deadline (a call to a peer not yet re-attached waits it out),
            # and the lease must survive one failed renewal.
            "scheduler": ["scheduler.lease_ttl_s=6.0"],
            "worker": [
                "worker.jobs.stop_grace_s=2",
                f"worker.executors={TRAINER_EXECUTORS}",
            ],
            "worker3": [
                f"worker.executors={PS_EXECUTORS}",
                'net.external_addresses=["127.0.0.1:1"]',
            ],
        },
    )
    c.prepare()
    c.start()
    try:
        yield c
    finally:
        c.stop()


def diloco_toml(model_dir: Path, *, rounds: int, samples_per_round: int = 128, name: str = "tiny") -> str:
    return f"""
[job]
name = "{name}"
dataset = "{DATASET}"
rounds = {rounds}
samples_per_round = {samples_per_round}
min_batch_size = 8
max_batch_size = 8
quorum = 0.5
round_timeout_s = 8

[job.model]
local_path = {json.dumps(str(model_dir))}
type = "causal-lm"

[job.inner_optimizer]
learning_rate = 0.003

[job.outer_optimizer]
learning_rate = 0.7
momentum = 0.9

[job.resources]
num_workers = 2
"""


def eval_loss(model_dir: Path, data_dir: Path) -> float:
    """Loss of a saved model on the first slices of the dataset (no training)."""
    from transformers import AutoModelForCausalLM

    from hypha.worker.executors.models import ModelKind
    from hypha.worker.executors.training import evaluate_loss, load_slice

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    slices = sorted((data_dir / DATASET).glob("slice-*.safetensors"))[:2]
    return evaluate_loss(model, ModelKind.CAUSAL_LM, [load_slice(path) for path in slices])


async def test_diloco_job_trains_through_the_relay_and_the_model_comes_back(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=3))

    job = await cluster.wait(job_id, timeout_s=150)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    assert job.loss > 0
    names = sorted(cluster.peer_of(peer) for peer in job.workers)
    assert "worker3" in names, names  # the parameter server: reachable only through the relay
    assert len(names) == 3
    files = await cluster.fetch_result(job_id, tmp_path / "model")
    assert {path.name for path in files} >= {"config.json", "model.safetensors"}
    before = eval_loss(cluster.model_dir, cluster.cluster.data_dir)
    after = eval_loss(tmp_path / "model", cluster.cluster.data_dir)
    assert after < before - 0.5, (before, after)
    print(f"diloco e2e: {time.monotonic() - started:.1f}s, eval loss {before:.3f} -> {after:.3f}")


async def test_killed_trainer_is_replaced_and_the_job_still_succeeds(
    cluster: E2ECluster, tmp_path: Path
) -> None:
    job_id = await cluster.submit(diloco_toml(cluster.model_dir, rounds=5, name="survivor"))
    job = await cluster.wait_round(job_id, 1, timeout_s=90)
    trainers = [cluster.peer_of(peer) for peer in job.workers if cluster.peer_of(peer) != "worker3"]
    victim = trainers[0]

    cluster.kill(victim)
    job = await cluster.wait(job_id, timeout_s=150)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 5
    final = {cluster.peer_of(peer) for peer in job.workers}
    assert victim not in final
    assert len(final - {"worker3"}) == 2, final
    # The parameter server took the newcomer in the lost trainer's place (not just a quorum).
    lines = [line.line for line in await cluster.log_lines(job_id)]
    assert any("replaces" in line for line in lines), lines[-40:]
    files = await cluster.fetch_result(job_id, tmp_path / "model")
    assert "model.safetensors" in {path.name for path in files}


async def test_job_survives_the_loss_of_the_gateway_everyone_is_attached_to(cluster: E2ECluster) -> None:
    # Runs last in this module: gw0 stays dead.
    # NOTE: the gateway dies mid-round (long rounds; killed just after round 1 completed), when
    # trainers talk to the scheduler and the data node directly. A relayed call that reaches a
    # gateway before its target re-attached is not failed fast (the gateway's PEER_UNKNOWN
    # error is only logged by the link), so a tensor pull caught at a sync point waits out its
    # whole deadline (minutes): not what this test is about.
    job_id = await cluster.submit(
        diloco_toml(cluster.model_dir, rounds=3, samples_per_round=2048, name="no-gateway")
    )
    await cluster.wait_round(job_id, 1, timeout_s=90)
    assert "attached" in cluster.log("gw0") and "attached" not in cluster.log("gw1")

    cluster.kill("gw0")
    job = await cluster.wait(job_id, timeout_s=120)

    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, f"{job.reason}\n{cluster.logs()}"
    assert job.round == 3
    assert "attached" in cluster.log("gw1")  # everyone moved over
