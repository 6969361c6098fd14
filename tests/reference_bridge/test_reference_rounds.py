"""Conformance: a trainer that speaks only the reference bridge API trains with our parameter server.

The trainer is ``reference_trainer.py`` (stdlib HTTP over the socket, no import
of this project), run as its own process against the worker's real
``JobBridge``, with the job JSON a worker passes it; the scheduler is a
``FakeNetwork`` and the parameter server ours, in this process. Two such
trainers, and one beside our own trainer, finish every round; the loss falls
and each trainer ends holding exactly the parameter server's θ_global.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hypha.testing.executors import FakeNetwork, diloco_spec, sync_every
from hypha.testing.real_bridge import executor_env, start_real_bridge
from hypha.v1 import common_pb2
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions
from hypha.worker.reference_job import job_document

TRAINER_SCRIPT = Path(__file__).with_name("reference_trainer.py")
ROUNDS = 3


def _network(tmp_path: Path, gpt2_dir: Path, slices: list[Path], trainers: tuple[str, ...]) -> FakeNetwork:
    network = FakeNetwork(
        spec=diloco_spec(rounds=ROUNDS, inner_lr=3e-3, outer_lr=0.7, momentum=0.9),
        root=tmp_path / "jobs",
        model_dir=gpt2_dir,
        trainer_ids=trainers,
        slices={peer: slices[i::2] for i, peer in enumerate(trainers)},
    )
    network.policy = sync_every(dict.fromkeys(trainers, 4))
    return network


async def _run(argv: list[str], work_dir: Path, socket_path: Path, executor: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=work_dir,
        env=executor_env(socket_path, work_dir, executor),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, output.decode(errors="replace")


async def _train(network: FakeNetwork, reference: tuple[str, ...], ours: tuple[str, ...]) -> ParameterServer:
    """Run the job's trainers (reference-style and ours) and the parameter server to their end."""
    bridges = {peer: await start_real_bridge(network, peer) for peer in (*reference, *ours)}
    server = ParameterServer(network.bridge(network.ps_id), options=ServerOptions(poll_s=0.05, linger_s=0.0))
    serving = asyncio.ensure_future(server.run())
    try:
        runs = []
        for peer, (bridge, _record, work_dir) in bridges.items():
            if peer in reference:
                job = json.dumps(job_document(bridge.ctx.dispatch, "diloco-transformer"))
                argv = [sys.executable, str(TRAINER_SCRIPT), "--socket", str(bridge.socket_path)]
                argv += ["--work-dir", str(work_dir), "--job", job]
                runs.append(_run(argv, work_dir, bridge.socket_path, "diloco-trainer"))
            else:
                argv = [sys.executable, "-m", "hypha.worker.executors.diloco_trainer"]
                runs.append(_run(argv, work_dir, bridge.socket_path, "diloco-trainer"))
        for code, output in await asyncio.gather(*runs):
            assert code == 0, output
        assert await asyncio.wait_for(serving, 30) == 0
    finally:
        serving.cancel()
        for bridge, _record, _work_dir in bridges.values():
            await bridge.stop()
    return server


def _assert_holds_global(work_dir: Path, server: ParameterServer) -> None:
    assert server.core is not None
    held = load_file(work_dir / "0_global_weights.safetensors")
    for name, value in server.core.outer.parameters().items():
        assert torch.allclose(held[name], value, atol=1e-6), name


@pytest.mark.timeout(180)
async def test_two_reference_trainers_train_with_our_parameter_server(
    tmp_path: Path, gpt2_dir: Path, slice_files: list[Path]
) -> None:
    network = _network(tmp_path, gpt2_dir, slice_files, ("t0", "t1"))

    server = await _train(network, ("t0", "t1"), ())

    assert server.core is not None and server.core.round_number == ROUNDS
    deltas = sorted((s.sender, s.round, s.samples) for s in network.deltas())
    assert deltas == sorted((peer, r, 32) for peer in ("t0", "t1") for r in range(ROUNDS))
    for peer in ("t0", "t1"):
        work_dir = network.job_for(peer).work_dir
        log = json.loads((work_dir / "reference-trainer.json").read_text())
        assert log["rounds"] == ROUNDS
        assert log["losses"][-1] < log["losses"][0], log
        _assert_holds_global(work_dir, server)
        assert (work_dir / "artifacts" / "config.json").stat().st_mode & 0o777 == 0o600
    # The trainers' metrics reached the scheduler, by round.
    assert sorted(m[1] for m in network.metrics if m[0] == "t0") == list(range(ROUNDS))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("update_dtype", [common_pb2.DELTA_DTYPE_FP32, common_pb2.DELTA_DTYPE_INT8])
async def test_a_reference_trainer_and_ours_train_together(
    tmp_path: Path, gpt2_dir: Path, slice_files: list[Path], update_dtype: common_pb2.DeltaDType
) -> None:
    # int8 updates come down as changes of θ_global: both kinds of trainer rebuild it.
    network = _network(tmp_path, gpt2_dir, slice_files, ("t0", "t1"))
    network.spec.diloco.update_dtype = update_dtype

    server = await _train(network, ("t0",), ("t1",))

    assert server.core is not None and server.core.round_number == ROUNDS
    senders = {(s.sender, s.round) for s in network.deltas()}
    assert senders == {(peer, r) for peer in ("t0", "t1") for r in range(ROUNDS)}
    _assert_holds_global(network.job_for("t0").work_dir, server)
    log = json.loads((network.job_for("t0").work_dir / "reference-trainer.json").read_text())
    assert log["losses"][-1] < log["losses"][0], log
