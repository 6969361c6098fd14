"""Each round's update coming down compressed (``update_dtype``): the real trainer and parameter
server over fake bridges, and the codec on its own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import safetensors.torch
import torch

from hypha import models
from hypha.diloco import checkpoint
from hypha.diloco.updates import BASE_ROUND_KEY, UpdateEncoder, apply_change, change_base
from hypha.tensors.payload import decode_state, encode_state, read_metadata
from hypha.v1 import common_pb2
from hypha.worker.executors import bridge_api, inner_steps
from hypha.worker.executors.diloco_trainer import DilocoTrainer, TrainerOptions
from hypha.worker.executors.global_sync import GlobalSync
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions
from tests.executors import FakeNetwork, diloco_spec, sync_every


def _job(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]], rounds: int, **diloco: object
) -> tuple[FakeNetwork, ParameterServer, dict[str, DilocoTrainer]]:
    network = FakeNetwork(
        spec=diloco_spec(rounds=rounds),
        root=tmp_path / "jobs",
        model_dir=gpt2_dir,
        trainer_ids=("t0", "t1"),
        slices=slices,
    )
    network.spec.diloco.update_dtype = common_pb2.DELTA_DTYPE_INT8
    for key, value in diloco.items():
        setattr(network.spec.diloco, key, value)
    network.policy = sync_every({"t0": 2, "t1": 3})
    ps = ParameterServer(network.bridge(network.ps_id), options=ServerOptions(poll_s=0.05, linger_s=0.0))
    options = TrainerOptions(fetch_timeout_s=10.0, update_patience_s=60.0)
    trainers = {peer: DilocoTrainer(network.bridge(peer), options=options) for peer in ("t0", "t1")}
    return network, ps, trainers


def _theta0(gpt2_dir: Path) -> dict[str, torch.Tensor]:
    return inner_steps.parameter_state(
        models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    )


async def test_int8_updates_are_a_quarter_of_fp32_and_every_trainer_holds_the_servers_theta_bit_for_bit(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    # Prepare: whole-model rounds, Δ up in fp32, the update down in int8.
    rounds = 3
    network, ps, trainers = _job(tmp_path, gpt2_dir, slices, rounds)

    # Execute
    codes = await asyncio.wait_for(asyncio.gather(ps.run(), *(t.run() for t in trainers.values())), 120)

    # Assert: each round's update is the change of θ_global since the round before, in int8
    # codes, about a quarter of θ_global's bytes; trainers, the server's θ_global, its
    # checkpoint and its published "global" are the same tensors, bit for bit.
    assert codes == [0, 0, 0]
    theta0 = _theta0(gpt2_dir)
    fp32_bytes = len(encode_state(theta0))
    for r in range(rounds):
        data = network.published[(network.ps_id, bridge_api.UPDATE, r)].read_bytes()
        assert change_base(data) == r
        assert read_metadata(data)[bridge_api.GLOBAL_ROUND_KEY] == str(r + 1)
        raw = safetensors.torch.load(data)
        assert {t.dtype for name, t in raw.items() if name.endswith("/q")} == {torch.int8}
        assert 0.2 < len(data) / fp32_bytes < 0.3, len(data) / fp32_bytes
    assert ps.core is not None and ps.core.round_number == rounds
    theta = ps.core.outer.parameters()
    published = decode_state(network.published[(network.ps_id, bridge_api.GLOBAL, rounds)].read_bytes())
    saved = checkpoint.load(ps.checkpoint_dir).outer.parameters()
    for name, value in theta.items():
        assert torch.equal(published[name], value), name
        assert torch.equal(saved[name], value), name
    for trainer in trainers.values():
        assert trainer._global_sync is not None and trainer._global_sync.global_round == rounds
        for name, value in trainer._global_sync.theta_global.items():
            assert torch.equal(value, theta[name]), name
    # θ_global moved: the changes were applied, not dropped.
    assert any(not torch.equal(theta[n], theta0[n]) for n in theta0)


async def test_overlapped_int8_updates_land_on_the_same_theta_everywhere(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    # Prepare: overlap_sync (the fragment path: updates merge while training goes on).
    rounds = 3
    network, ps, trainers = _job(tmp_path, gpt2_dir, slices, rounds, overlap_sync=True)

    # Execute
    codes = await asyncio.wait_for(asyncio.gather(ps.run(), *(t.run() for t in trainers.values())), 120)

    # Assert
    assert codes == [0, 0, 0]
    assert ps.core is not None
    theta = ps.core.outer.parameters()
    for trainer in trainers.values():
        assert trainer._global_sync is not None
        for name, value in trainer._global_sync.theta_global.items():
            assert torch.equal(value, theta[name]), name
    for r in range(rounds):
        assert change_base(network.published[(network.ps_id, bridge_api.UPDATE, r)].read_bytes()) == r


class _Link:
    """A parameter-server link that serves one θ_global whole."""

    def __init__(self, whole: bytes) -> None:
        self.whole = whole
        self.fetched: list[tuple[str, int]] = []

    async def fetch(self, kind: str, round_number: int, *, resend: object = None) -> bytes:
        self.fetched.append((kind, round_number))
        return self.whole


async def test_a_trainer_that_missed_an_update_fetches_theta_whole_instead_of_adding_to_the_wrong_base(
    tmp_path: Path, gpt2_dir: Path
) -> None:
    # Prepare: the server's θ_global after rounds 0 and 1, the change of round 1 encoded against
    # round 1's θ_global; the trainer still holds θ_0 (it never saw round 0's update).
    model = models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    theta0 = inner_steps.parameter_state(model)
    server = UpdateEncoder("int8", theta0)
    live = {n: t.clone() for n, t in theta0.items()}
    for r in range(2):
        for t in live.values():
            t.add_(0.01 * (r + 1))
        change = server.encode(live, list(live), r, {})
    whole = encode_state(live)
    link = _Link(whole)
    sync = GlobalSync(link, None, tmp_path, model, 0, False)  # type: ignore[arg-type]

    # Execute
    params = await sync._updated(change, 1, list(theta0))

    # Assert: θ_global of round 2, whole, not θ_0 plus round 1's change.
    assert link.fetched == [(bridge_api.GLOBAL, 2)]
    assert all(torch.equal(params[n], live[n]) for n in live)
    assert sync.global_round == 2


def test_the_servers_residual_keeps_theta_on_course_where_plain_rounding_drifts() -> None:
    # Prepare: 40 rounds of small steps (below int8's resolution for some entries).
    torch.manual_seed(0)
    start = {"w": torch.randn(4096)}
    steps = [0.002 * torch.randn(4096) for _ in range(40)]
    server = UpdateEncoder("int8", start)
    held = dict(start)  # what a trainer holds
    live = {"w": start["w"].clone()}
    plain = start["w"].clone()  # rounding each round's step with no residual

    # Execute
    for r, step in enumerate(steps):
        live["w"].add_(step)  # the outer step, taken from the θ_global the trainers hold
        data = server.encode(live, ["w"], r, {})
        held = apply_change(data, held)
        plain_blob = UpdateEncoder("int8", {"w": plain}).encode({"w": plain + step}, ["w"], r, {})
        plain = apply_change(plain_blob, {"w": plain})["w"]

    # Assert: the trainer's θ is the server's bit for bit; with the residual it stays within
    # one round's rounding of the true θ, while plain rounding drifts further.
    assert torch.equal(held["w"], live["w"])
    true = start["w"] + sum(steps)
    with_feedback = float((held["w"] - true).abs().max())
    without = float((plain - true).abs().max())
    assert with_feedback < without / 2, (with_feedback, without)
    metadata = read_metadata(data)
    assert metadata[BASE_ROUND_KEY] == str(len(steps) - 1)
