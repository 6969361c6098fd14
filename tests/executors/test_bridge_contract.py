"""Contract suite: the same tests against the fake job bridge and the real one, so the fake cannot drift.

Every test takes a ``side``: ``fake`` is ``FakeBridge`` in-process, ``real``
is the worker's ``JobBridge`` (aiohttp over a Unix socket) reached through
the real ``BridgeClient``, and for the executor tests the executor runs as
its own process (``python -m hypha.worker.executors...``), as a worker
starts it. On both sides the scheduler and the other peers are the same
``FakeNetwork``, so what the tests see there must be the same.

The bridge tests pin the calls one at a time (what comes back, what the
network sees, what is refused); the executor tests run a trainer's round
and a parameter server's round end to end.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hypha import models
from hypha.bridge_client import BridgeClient
from hypha.datasets import synthetic
from hypha.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from hypha.models import ModelKind
from hypha.tensors.payload import decode_state, encode_state
from hypha.v1 import common_pb2
from hypha.worker.executors import bridge_api, diloco_settings, inner_steps, trainer_state
from hypha.worker.executors.diloco_trainer import DilocoTrainer
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions
from tests.executors import (
    FakeNetwork,
    diloco_spec,
    executor_env,
    start_real_bridge,
    sync_every,
    write_slices,
)
from tests.helpers import eventually

SIDES = ("fake", "real")
OUTER_LR, MOMENTUM = 0.7, 0.9
TRAINER_MODULE = "hypha.worker.executors.diloco_trainer"
SERVER_MODULE = "hypha.worker.executors.parameter_server"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save_tiny_model(ModelKind.CAUSAL_LM, tmp_path_factory.mktemp("model") / "gpt2")


@pytest.fixture(scope="module")
def slice_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Arithmetic data in slices of 12 samples, so that batches of 8 span slices."""
    return write_slices(synthetic.arithmetic(48, seed=0), tmp_path_factory.mktemp("data"), "arith", 12)


@dataclass
class Side:
    """One way of giving a peer of ``network`` its bridge: the fake in-process, or the real one."""

    name: str
    network: FakeNetwork
    _bridges: dict[str, Any] = field(default_factory=dict)
    _records: dict[str, Any] = field(default_factory=dict)
    _clients: list[BridgeClient] = field(default_factory=list)

    async def _serve(self, peer: str) -> Any:
        if peer not in self._bridges:
            bridge, record, _ = await start_real_bridge(self.network, peer)
            self._bridges[peer], self._records[peer] = bridge, record
        return self._bridges[peer]

    async def bridge(self, peer: str) -> Any:
        """What an executor of ``peer`` calls: ``FakeBridge`` or a ``BridgeClient`` on the real socket."""
        if self.name == "fake":
            return self.network.bridge(peer)
        client = BridgeClient((await self._serve(peer)).socket_path, timeout_s=30.0)
        self._clients.append(client)
        return client

    async def run(self, peer: str, module: str, timeout_s: float = 150.0) -> int:
        """Run ``peer``'s executor to its end: in this process, or as the worker's subprocess."""
        if self.name == "fake":
            bridge = self.network.bridge(peer)
            executor: DilocoTrainer | ParameterServer = (
                DilocoTrainer(bridge)
                if module == TRAINER_MODULE
                else ParameterServer(bridge, options=ServerOptions(linger_s=0.0))
            )
            return await asyncio.wait_for(executor.run(), timeout_s)
        served = await self._serve(peer)
        work_dir = self.network.job_for(peer).work_dir
        executor_name = "parameter-server" if module == SERVER_MODULE else "diloco-trainer"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            cwd=work_dir,
            env=executor_env(served.socket_path, work_dir, executor_name),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        if proc.returncode != 0:
            print(output.decode(errors="replace"))
        return proc.returncode

    def final_state(self, peer: str) -> str:
        """The last state the executor reported about itself."""
        if self.name == "fake":
            return self.network.statuses.get(peer, [("", "")])[-1][0]
        return str(self._records[peer].reported_state)

    def result_dir(self, peer: str) -> Path | None:
        if self.name == "fake":
            result = self.network.results.get(peer)
            return None if result is None else result.resolve()
        raw = self._records[peer].result_dir
        return Path(raw) if raw else None

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
        for bridge in self._bridges.values():
            await bridge.stop()


@pytest.fixture(params=SIDES)
async def make_side(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[FakeNetwork], Side]]:
    sides: list[Side] = []

    def make(network: FakeNetwork) -> Side:
        sides.append(Side(request.param, network))
        return sides[-1]

    yield make
    for side in sides:
        await side.close()


def _network(
    tmp_path: Path, model_dir: Path, trainers: tuple[str, ...], slices: list[Path] | None = None, **spec: Any
) -> FakeNetwork:
    return FakeNetwork(
        spec=diloco_spec(outer_lr=OUTER_LR, momentum=MOMENTUM, **spec),
        root=tmp_path / "jobs",
        model_dir=model_dir,
        trainer_ids=trainers,
        slices={peer: list(slices or []) for peer in trainers},
    )


def _tensor_file(work_dir: Path, name: str, seed: int) -> tuple[Path, bytes]:
    data = encode_state({"w": torch.full((4,), float(seed))})
    path = work_dir / name
    path.write_bytes(data)
    return path, data


def _resolved(path: Path | str) -> Path:
    return Path(path).resolve()


def _bytes(path: Path | str) -> bytes:
    return Path(path).read_bytes()


# ---- the bridge, call by call ----------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_the_job_tells_the_executor_who_it_is(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0", "t1"), rounds=3)
    network.start_rounds["t1"], network.attempts["t1"] = 2, 1
    side = make_side(network)
    bridge = await side.bridge("t1")

    job = await bridge.job()

    assert (job.job_id, job.batch_size, job.parameter_server_id) == ("job-1", 8, "ps")
    assert (tuple(job.trainer_ids), job.start_round, job.attempt) == (("t0", "t1"), 2, 1)
    assert _resolved(job.work_dir) == _resolved(tmp_path / "jobs" / "t1")
    assert diloco_settings.diloco_spec(job.spec).rounds == 3
    model_dir = await bridge.fetch_resource("model")
    assert (Path(model_dir) / "config.json").is_file()
    with pytest.raises(NotFoundError):
        await bridge.fetch_resource("preprocessor")
    with pytest.raises(NotFoundError):
        await bridge.fetch_resource("tokenizer")


@pytest.mark.timeout(60)
async def test_slices_come_in_order_as_files_and_used_ones_reach_the_scheduler(
    tmp_path: Path, gpt2_dir: Path, slice_files: list[Path], make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), slice_files[:2], rounds=1)
    bridge = await make_side(network).bridge("t0")

    first = await bridge.next_slice()
    first_bytes = _bytes(first.path)
    await bridge.slices_used([first.index])
    second = await bridge.next_slice()

    assert [(first.index, first.epoch), (second.index, second.epoch)] == [(0, 0), (1, 0)]
    assert first_bytes == slice_files[0].read_bytes()
    assert _bytes(second.path) == slice_files[1].read_bytes()
    work_dir = network.job_for("t0").work_dir.resolve()
    assert _resolved(second.path).is_relative_to(work_dir)
    assert not _resolved(first.path).exists()  # a used slice's copy is gone
    await eventually(lambda: network.used.get("t0") == [0], timeout=10)


@pytest.mark.timeout(60)
async def test_no_slice_for_a_peer_without_data(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=1)
    bridge = await make_side(network).bridge("t0")

    assert await bridge.next_slice() is None


@pytest.mark.timeout(60)
async def test_progress_reaches_the_scheduler_and_its_directive_comes_back(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=2)
    network.policy = sync_every({"t0": 2}, rounds=1)
    bridge = await make_side(network).bridge("t0")

    directives = [
        await bridge.progress(0, 1, 8, 2.5, 0.1, 8, next_batch_started=True),
        await bridge.progress(0, 2, 16, 2.0, 0.1, 8),
        await bridge.progress(1, 0, 0, 0.0, 0.0, 8),
    ]

    assert [(d.kind, d.batches, d.round) for d in directives] == [
        ("sync_after", 1, 0),
        ("sync_now", 0, 0),
        ("done", 0, 1),
    ]
    assert [p[:4] for p in network.progress] == [("t0", 0, 1, 8), ("t0", 0, 2, 16), ("t0", 1, 0, 0)]
    assert network.progress[0][4] == pytest.approx(2.5)
    assert [p[5] for p in network.progress] == [True, False, False]


@pytest.mark.timeout(60)
async def test_sent_tensors_land_in_the_peers_inbox_of_their_kind(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=1)
    side = make_side(network)
    sender, server = await side.bridge("t0"), await side.bridge("ps")
    path, data = _tensor_file(network.job_for("t0").work_dir, "delta.safetensors", 3)

    reply = await sender.send_tensors("ps", "delta", 4, 24, path)
    other = await server.inbox("ps-state", timeout_s=0.05)
    received = await server.inbox("delta", timeout_s=5.0)

    assert bridge_api.send_outcome(reply)[0] is True
    assert other is None  # a delta is not in the inbox of another kind
    assert received is not None
    assert (received.data, received.from_peer, received.kind, received.round, received.samples) == (
        data,
        "t0",
        "delta",
        4,
        24,
    )
    assert await server.inbox("delta", timeout_s=0.05) is None


@pytest.mark.timeout(60)
async def test_published_tensors_are_fetched_by_peers_and_a_missing_round_times_out(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=1)
    side = make_side(network)
    server, trainer = await side.bridge("ps"), await side.bridge("t0")
    path, data = _tensor_file(network.job_for("ps").work_dir, "update-0.safetensors", 7)

    waiting = asyncio.ensure_future(trainer.fetch_tensors("ps", "update", 0, timeout_s=20.0))
    await eventually(lambda: ("t0", "ps", "update", 0) in network.fetched, timeout=10)
    await server.publish_tensors("update", 0, path)

    assert await waiting == data
    assert await trainer.fetch_tensors("ps", "update", 1, timeout_s=0.1) is None


@pytest.mark.timeout(60)
async def test_metrics_carry_the_tensor_bytes_the_worker_moved(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=1)
    side = make_side(network)
    trainer, server = await side.bridge("t0"), await side.bridge("ps")
    await trainer.metrics(0, {"loss": 1.5})
    delta, sent = _tensor_file(network.job_for("t0").work_dir, "delta.safetensors", 1)
    update, published = _tensor_file(network.job_for("ps").work_dir, "update.safetensors", 2)
    await trainer.send_tensors("ps", "delta", 0, 8, delta)
    await server.publish_tensors("update", 0, update)
    assert await trainer.fetch_tensors("ps", "update", 0, timeout_s=5.0) == published

    await trainer.metrics(1, {"loss": 1.0})

    assert network.metrics == [
        ("t0", 0, {"loss": 1.5}),
        (
            "t0",
            1,
            {
                "loss": 1.0,
                "tensor_bytes_pushed": float(len(sent)),
                "tensor_bytes_pulled": float(len(published)),
            },
        ),
    ]


@pytest.mark.timeout(60)
async def test_paths_outside_the_work_dir_are_refused(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=1)
    bridge = await make_side(network).bridge("t0")
    work_dir = network.job_for("t0").work_dir
    outside, _ = _tensor_file(tmp_path, "outside.safetensors", 1)
    (tmp_path / "outside-dir").mkdir()
    (work_dir / "link.safetensors").symlink_to(outside)

    with pytest.raises(PermissionDeniedError):
        await bridge.send_tensors("ps", "delta", 0, 8, outside)
    with pytest.raises(PermissionDeniedError):
        await bridge.send_tensors("ps", "delta", 0, 8, work_dir / "link.safetensors")
    with pytest.raises(PermissionDeniedError):
        await bridge.publish_tensors("update", 0, outside)
    with pytest.raises(PermissionDeniedError):
        await bridge.result(tmp_path / "outside-dir")
    with pytest.raises(NotFoundError):
        await bridge.send_tensors("ps", "delta", 0, 8, work_dir / "missing.safetensors")
    with pytest.raises(InvalidArgumentError):
        await bridge.result(work_dir)
    assert network.sent == [] and network.published == {}


@pytest.mark.timeout(60)
async def test_status_result_and_logs_are_recorded_and_unknown_values_refused(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    network = _network(tmp_path, gpt2_dir, ("t0",), rounds=1)
    side = make_side(network)
    bridge = await side.bridge("t0")
    result = network.job_for("t0").work_dir / "result"
    result.mkdir()

    with pytest.raises(InvalidArgumentError):
        await bridge.status("finished", "not a state")
    with pytest.raises(InvalidArgumentError):
        await bridge.log("console", "not a stream")
    await bridge.log("stdout", "hello")
    await bridge.result(result)
    await bridge.status("succeeded", "1 round")

    assert side.final_state("t0") == "succeeded"
    assert side.result_dir("t0") == result.resolve()


# ---- the executors, end to end -----------------------------------------------------------------


@pytest.mark.timeout(240)
async def test_a_trainer_runs_a_round_fetching_data_reporting_progress_and_taking_the_update(
    tmp_path: Path, gpt2_dir: Path, slice_files: list[Path], make_side: Callable[[FakeNetwork], Side]
) -> None:
    # Prepare: one trainer, one round of three batches of 8; the parameter server is the network's.
    # (The answer to batch 1's report, "sync_after 2", is read as batch 2 ends, or batch 3 if it
    # was slower than a batch: with "sync_after 1" the round ran 3 batches about one run in six.)
    network = _network(tmp_path, gpt2_dir, ("t0",), slice_files, rounds=1)
    network.policy = sync_every({"t0": 3})
    side = make_side(network)
    server = ParameterServer(network.bridge("ps"), options=ServerOptions(poll_s=0.05, linger_s=0.0))
    serving = asyncio.ensure_future(server.run())

    # Execute
    try:
        code = await side.run("t0", TRAINER_MODULE)
        assert await asyncio.wait_for(serving, 60) == 0
    finally:
        serving.cancel()

    # Assert: progress after the first batch and the last, one delta of 24 samples, the update
    # pulled, and the trainer's checkpoint holds the θ_global the server computed.
    assert code == 0
    assert side.final_state("t0") == "succeeded"
    reports = [p[1:4] for p in network.progress if p[0] == "t0"]
    assert reports[0] == (0, 1, 8) and reports[-1] == (0, 3, 24)
    assert [(s.sender, s.peer, s.round, s.samples) for s in network.deltas()] == [("t0", "ps", 0, 24)]
    assert ("t0", "ps", "update", 0) in network.fetched
    (metrics,) = [m for m in network.metrics if m[0] == "t0"]
    assert metrics[1] == 0 and metrics[2]["batches"] == 3
    assert metrics[2]["tensor_bytes_pushed"] == len(network.deltas()[0].data)
    model = models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    optimizer = diloco_settings.make_inner_optimizer(model, diloco_settings.InnerSettings())
    state_dir = network.job_for("t0").work_dir / "trainer-state"
    assert trainer_state.load_trainer_state(state_dir, model, optimizer) == trainer_state.TrainerState(1, 24)
    assert server.core is not None
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), server.core.outer.parameters()[name]), name


@pytest.mark.timeout(240)
async def test_the_parameter_server_aggregates_two_deltas_and_publishes_theta(
    tmp_path: Path, gpt2_dir: Path, make_side: Callable[[FakeNetwork], Side]
) -> None:
    # Prepare: two trainers' deltas for round 0, unequal in samples; the trainers are the network's.
    network = _network(tmp_path, gpt2_dir, ("t0", "t1"), rounds=1)
    side = make_side(network)
    spec = common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM)
    theta0 = inner_steps.parameter_state(models.build_model(spec, gpt2_dir))
    deltas = {peer: _delta(theta0, seed) for seed, peer in enumerate(("t0", "t1"))}
    samples = {"t0": 8, "t1": 24}
    for peer, delta in deltas.items():
        network.deliver(peer, "ps", "delta", 0, samples[peer], encode_state(delta))

    # Execute
    code = await side.run("ps", SERVER_MODULE)

    # Assert: θ_1 is torch's SGD(nesterov) over the sample-weighted mean, published as the
    # update of round 0 and the global of round 1, and handed over as the result.
    assert code == 0
    assert side.final_state("ps") == "succeeded"
    expected = _one_outer_step(theta0, [(deltas[p], samples[p] / 32) for p in deltas])
    update = decode_state(network.published[("ps", "update", 0)].read_bytes())
    published_global = decode_state(network.published[("ps", "global", 1)].read_bytes())
    for name, value in expected.items():
        torch.testing.assert_close(update[name], value, rtol=0, atol=1e-6)
        assert torch.equal(published_global[name], update[name])
    result = side.result_dir("ps")
    assert result is not None and (result / "config.json").is_file()


def _delta(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) * 0.01 for n, t in template.items()}


def _one_outer_step(
    theta0: dict[str, torch.Tensor], weighted: list[tuple[dict[str, torch.Tensor], float]]
) -> dict[str, torch.Tensor]:
    names = list(theta0)
    params = [nn.Parameter(theta0[n].clone()) for n in names]
    sgd = torch.optim.SGD(params, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    for name, param in zip(names, params, strict=True):
        param.grad = -sum((d[name] * w for d, w in weighted), torch.zeros_like(param))
    sgd.step()
    return {n: p.detach() for n, p in zip(names, params, strict=True)}
