"""The demo on a cluster that was already running: it waits for its just-prepared dataset.

``hypha up`` in one terminal, ``hypha demo`` in another: the demo prepares the
dataset into the running data node's dir, and the node announces it only at its
next look (``data.announce_poll_s``), so the scheduler refuses the job meanwhile.
A real mTLS server stands in for that scheduler: it refuses twice as the
scheduler does (``NOT_FOUND``, "no data node announces it"), then accepts.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from rich.console import Console

from hypha.client import demo, demo_eval
from hypha.jobfile import parse_job_toml
from hypha.net.channel import secure_channel
from hypha.net.server import NodeServer
from hypha.testing.pki import Pki
from hypha.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class _Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, refusals: int, code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND) -> None:
        self.refusals, self.code, self.calls = refusals, code, 0

    async def SubmitJob(
        self, request: scheduler_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Job:
        self.calls += 1
        if self.calls <= self.refusals:
            await context.abort(
                self.code, "dataset 'arithmetic' not found: no data node announces it in the DHT"
            )
        return scheduler_pb2.Job(job_id="j1")


async def _submit(pki: Pki, servicer: _Scheduler) -> scheduler_pb2.Job:
    server = NodeServer(
        pki.tls("scheduler"),
        "127.0.0.1:0",
        [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, "hypha.v1.Scheduler")],
    )
    await server.start()
    try:
        async with secure_channel(pki.tls("client"), server.address) as channel:
            view = demo_eval.LiveView(False, Console(record=True, width=100))
            return await demo.submit_when_announced(scheduler_pb2_grpc.SchedulerStub(channel), "", view)
    finally:
        await server.stop(0)


async def test_the_demo_waits_until_its_dataset_is_announced(pki: Pki) -> None:
    servicer = _Scheduler(refusals=2)
    job = await _submit(pki, servicer)
    assert job.job_id == "j1" and servicer.calls == 3


async def test_any_other_refusal_is_not_waited_out(pki: Pki) -> None:
    servicer = _Scheduler(refusals=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _submit(pki, servicer)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT and servicer.calls == 1


def test_the_demo_job_warms_up_over_two_rounds_clips_each_step_and_decays_weights() -> None:
    # The settings that took the demo off its plateau (README, "What hypha demo does").
    spec = parse_job_toml(demo.job_toml(Path("/models/arithmetic-gpt2"), rounds=3, inner_steps=10)).diloco
    inner = spec.inner_optimizer
    assert (inner.warmup_steps, inner.max_grad_norm) == (20, 1.0)
    assert (inner.learning_rate, inner.beta2) == (demo.INNER_LR, demo.INNER_BETAS[1])
    assert inner.weight_decay == pytest.approx(demo.INNER_WEIGHT_DECAY)  # not the job file's 0.01
    assert spec.samples_per_round == demo.TRAINERS * 10 * demo.BATCH
