"""The training pieces the DiLoCo executors share: models, batches, steps, Δ, trainer checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hypha import models
from hypha.datasets import synthetic
from hypha.errors import DataLossError, InvalidArgumentError
from hypha.models import ModelKind
from hypha.tensors.payload import decode_state
from hypha.v1 import common_pb2
from hypha.worker.executors import diloco_settings, inner_steps, trainer_state
from hypha.worker.executors.batches import BatchStream
from hypha.worker.executors.checkpoint_writer import CheckpointWriter
from hypha.worker.executors.diloco_settings import InnerSettings


def _spec(kind: ModelKind, **fields: object) -> common_pb2.ModelSpec:
    types = {
        ModelKind.CAUSAL_LM: common_pb2.MODEL_TYPE_CAUSAL_LM,
        ModelKind.VISION_CLASSIFICATION: common_pb2.MODEL_TYPE_VISION_CLASSIFICATION,
        ModelKind.TORCH: common_pb2.MODEL_TYPE_TORCH,
    }
    return common_pb2.ModelSpec(type=types[kind], **fields)  # type: ignore[arg-type]


def _batches(tensors: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    stream = BatchStream(size)
    stream.add_slice(0, tensors)
    out = []
    while (batch := stream.next_batch()) is not None:
        out.append(batch)
    return out


def _train(model: nn.Module, kind: ModelKind, batches: list[dict[str, torch.Tensor]], lr: float) -> None:
    optimizer = diloco_settings.make_inner_optimizer(model, InnerSettings(lr=lr))
    for batch in batches:
        inner_steps.train_step(model, optimizer, kind, batch)


def test_the_demos_model_draws_its_positions_wider_than_its_other_weights(tmp_path: Path) -> None:
    # Positions as faint as everything else kept the demo on its carry-less plateau for a
    # number of steps that depended on the data order (hypha.models.ARITHMETIC_POSITION_STD).
    from safetensors.torch import load_file

    weights = load_file(models.save_arithmetic_model(tmp_path / "demo", seed=0) / "model.safetensors")
    assert weights["transformer.wpe.weight"].std().item() == pytest.approx(
        models.ARITHMETIC_POSITION_STD, rel=0.1
    )
    assert weights["transformer.wte.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    again = load_file(models.save_arithmetic_model(tmp_path / "again", seed=0) / "model.safetensors")
    assert all(again[name].equal(weights[name]) for name in weights)  # still seeded


def test_an_earlier_releases_demo_model_is_replaced_and_a_current_one_kept(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    target = tmp_path / "models" / "arithmetic-gpt2"
    models.save_tiny_model(ModelKind.CAUSAL_LM, target, seed=0, **models.ARITHMETIC_GPT2)  # positions at 0.02
    assert models.refresh_arithmetic_model(target) is True
    weights = load_file(target / "model.safetensors")
    expected = load_file(models.save_arithmetic_model(tmp_path / "expected", seed=0) / "model.safetensors")
    assert weights.keys() == expected.keys() and all(weights[k].equal(expected[k]) for k in expected)

    written = (target / "model.safetensors").stat().st_mtime_ns
    assert models.refresh_arithmetic_model(target) is False
    assert (target / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in target.parent.iterdir()) == ["arithmetic-gpt2"]  # no scratch left


def test_tiny_gpt2_from_its_dir_lowers_the_loss_on_arithmetic(tmp_path: Path) -> None:
    model_dir = models.save_tiny_model(ModelKind.CAUSAL_LM, tmp_path / "gpt2")
    model = models.build_model(_spec(ModelKind.CAUSAL_LM), model_dir)
    assert sum(p.numel() for p in model.parameters()) < 500_000
    train = _batches(synthetic.arithmetic(160, seed=1).tensors, 8)
    held_out = _batches(synthetic.arithmetic(32, seed=2).tensors, 16)
    before = models.evaluate_loss(model, ModelKind.CAUSAL_LM, held_out)

    _train(model, ModelKind.CAUSAL_LM, train, lr=3e-3)

    after = models.evaluate_loss(model, ModelKind.CAUSAL_LM, held_out)
    assert after < before - 1.0, (before, after)


def test_tiny_vit_from_its_dir_lowers_the_loss_on_shapes(tmp_path: Path) -> None:
    model_dir = models.save_tiny_model(ModelKind.VISION_CLASSIFICATION, tmp_path / "vit")
    model = models.build_model(_spec(ModelKind.VISION_CLASSIFICATION), model_dir)
    train = _batches(synthetic.shapes(512, seed=1).tensors, 16)
    held_out = _batches(synthetic.shapes(64, seed=2).tensors, 32)
    before = models.evaluate_loss(model, ModelKind.VISION_CLASSIFICATION, held_out)

    _train(model, ModelKind.VISION_CLASSIFICATION, train * 10, lr=3e-3)  # 320 steps, under a second

    after = models.evaluate_loss(model, ModelKind.VISION_CLASSIFICATION, held_out)
    assert after < before - 0.2, (before, after)


def test_config_overrides_reach_the_model(tmp_path: Path) -> None:
    model_dir = models.save_tiny_model(ModelKind.CAUSAL_LM, tmp_path / "gpt2")
    spec = _spec(ModelKind.CAUSAL_LM, config_overrides={"resid_pdrop": "0.25"})
    model = models.build_model(spec, model_dir)
    assert model.config.resid_pdrop == 0.25  # type: ignore[union-attr]


class _Mlp(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(features)  # logits: the trainer adds cross-entropy against labels


def make_mlp(width: int = 8) -> nn.Module:
    return _Mlp(width)


def test_torch_factory_builds_the_same_module_everywhere_and_trains_on_logits(tmp_path: Path) -> None:
    spec = _spec(ModelKind.TORCH, torch_factory=f"{__name__}:make_mlp", config_overrides={"width": "16"})
    allowed = [spec.torch_factory]
    first, second = (models.build_model(spec, None, factories_allowed=allowed) for _ in range(2))
    assert isinstance(first, _Mlp) and first.net[0].out_features == 16
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not models.has_pretrained_weights(spec, None)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(64, 4, generator=gen)
    batch = {"features": features, "labels": (features[:, 0] > 0).long() + (features[:, 1] > 0).long()}
    before = models.evaluate_loss(first, ModelKind.TORCH, [batch])

    _train(first, ModelKind.TORCH, [batch] * 40, lr=1e-2)

    assert models.evaluate_loss(first, ModelKind.TORCH, [batch]) < before
    out = models.save_model_dir(first, tmp_path / "out", spec)
    reloaded = models.build_model(spec, out, factories_allowed=[f"{__name__}:*"])
    assert models.has_pretrained_weights(spec, out)
    for a, b in zip(first.parameters(), reloaded.parameters(), strict=True):
        assert torch.equal(a, b)
    assert json.loads((out / "config.json").read_text())["torch_factory"] == spec.torch_factory


def test_a_bad_torch_factory_path_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        models.build_model(_spec(ModelKind.TORCH, torch_factory="no_colon_here"), None)


def test_batches_span_slices_and_slices_count_as_used_once_fully_consumed() -> None:
    stream = BatchStream(4, keys=("x",))
    stream.add_slice(7, {"x": torch.arange(5), "ignored": torch.zeros(5)})
    first = stream.next_batch()
    assert first is not None and first["x"].tolist() == [0, 1, 2, 3] and set(first) == {"x"}
    assert stream.take_consumed() == []
    assert stream.next_batch() is None  # one row left: not a full batch
    stream.add_slice(8, {"x": torch.arange(10, 15)})
    second = stream.next_batch()
    assert second is not None and second["x"].tolist() == [4, 10, 11, 12]
    assert stream.take_consumed() == [7]
    assert stream.take_consumed() == []
    rest = stream.flush()
    assert rest is not None and rest["x"].tolist() == [13, 14]
    assert stream.take_consumed() == [8]
    assert stream.flush() is None


def test_a_slice_whose_tensors_disagree_on_samples_is_data_loss() -> None:
    with pytest.raises(DataLossError):
        BatchStream(2).add_slice(0, {"a": torch.zeros(3), "b": torch.zeros(4)})


def test_delta_and_apply_round_trip_on_a_tied_model(tmp_path: Path) -> None:
    model = models.build_model(
        _spec(ModelKind.CAUSAL_LM), models.save_tiny_model(ModelKind.CAUSAL_LM, tmp_path / "m")
    )
    theta_global = inner_steps.parameter_state(model)
    # Tied embeddings travel once: the head is not a separate parameter.
    assert "lm_head.weight" not in theta_global
    _train(model, ModelKind.CAUSAL_LM, _batches(synthetic.arithmetic(16).tensors, 8), lr=1e-2)
    theta_local = inner_steps.parameter_state(model)

    delta = inner_steps.compute_delta(model, theta_global)

    assert set(delta) == set(theta_global)
    assert any(bool(d.abs().max() > 0) for d in delta.values())
    for name in delta:
        assert torch.allclose(theta_global[name] + delta[name], theta_local[name], atol=1e-6)
    inner_steps.apply_global(model, theta_global)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), theta_global[name])
    tied: Any = model
    assert tied.lm_head.weight.data_ptr() == tied.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_deltas_travel_in_the_jobs_dtype(dtype: str, torch_dtype: torch.dtype) -> None:
    delta = {"w": torch.linspace(-1, 1, 64).reshape(8, 8)}
    blob = inner_steps.encode_delta(delta, dtype, round_number=3, samples=12)
    raw = decode_state(blob, None)
    assert raw["w"].dtype == torch_dtype
    assert torch.allclose(decode_state(blob)["w"], delta["w"], atol=1e-2)


def test_apply_global_refuses_a_state_of_another_model() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError):
        inner_steps.apply_global(model, {"weight": torch.zeros(2, 2)})


def test_trainer_state_round_trips_model_optimizer_and_round(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = diloco_settings.make_inner_optimizer(model, InnerSettings(lr=1e-2))
    batch = {"x": torch.randn(8, 4)}
    for _ in range(3):
        optimizer.zero_grad()
        model(batch["x"]).pow(2).mean().backward()
        optimizer.step()
    state = trainer_state.TrainerState(round_number=5, samples_total=120)

    trainer_state.save_trainer_state(tmp_path, model, optimizer, state)
    trainer_state.save_trainer_state(tmp_path, model, optimizer, state)  # a second save replaces the first

    fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    fresh_optimizer = diloco_settings.make_inner_optimizer(fresh, InnerSettings(lr=1e-2))
    assert trainer_state.load_trainer_state(tmp_path, fresh, fresh_optimizer) == state
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for key, values in saved["state"].items():
        for name, value in values.items():
            assert torch.equal(value, loaded["state"][key][name])
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 1


def test_a_snapshot_written_later_holds_the_state_of_when_it_was_taken(tmp_path: Path) -> None:
    # Prepare: one step, the snapshot and what it must hold, then training goes on before the write.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = diloco_settings.make_inner_optimizer(model, InnerSettings(lr=1e-2))

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()

    step()
    model_state, optimizer_state = trainer_state.snapshot_trainer_state(model, optimizer)
    expected = {n: t.clone() for n, t in model.state_dict().items()}
    expected_avg = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    step()  # the live tensors move on while the copy waits for its thread

    # Execute
    trainer_state.write_trainer_state(
        tmp_path, model_state, optimizer_state, trainer_state.TrainerState(3, 8)
    )

    # Assert
    fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fresh_optimizer = diloco_settings.make_inner_optimizer(fresh, InnerSettings(lr=1e-2))
    assert trainer_state.load_trainer_state(tmp_path, fresh, fresh_optimizer) == trainer_state.TrainerState(
        3, 8
    )
    assert all(torch.equal(fresh.state_dict()[n], t) for n, t in expected.items())
    assert not torch.equal(fresh.state_dict()["0.weight"], model.state_dict()["0.weight"])
    loaded = fresh_optimizer.state_dict()["state"]
    assert all(torch.equal(loaded[k]["exp_avg"], v) for k, v in expected_avg.items())


async def test_checkpoints_are_spaced_by_their_interval_and_the_last_round_is_always_written(
    tmp_path: Path,
) -> None:
    # Prepare: round boundaries 20 s apart against a 60 s interval, from the writer's start.
    model = nn.Linear(4, 2)
    optimizer = diloco_settings.make_inner_optimizer(model, InnerSettings(lr=1e-2))
    now = [1000.0]
    writer = CheckpointWriter(interval_s=60.0, clock=lambda: now[0])

    async def boundary(round_number: int, last: bool = False) -> trainer_state.TrainerState | None:
        now[0] += 20.0
        state = trainer_state.TrainerState(round_number, 8 * round_number)
        written = await writer.write(tmp_path, model, optimizer, state, last=last)
        await writer.settled()
        fresh = nn.Linear(4, 2)
        on_disk = trainer_state.load_trainer_state(
            tmp_path, fresh, diloco_settings.make_inner_optimizer(fresh, InnerSettings())
        )
        assert written == (on_disk == state)
        return on_disk

    # Execute and assert: the first boundary 60 s after the start is written, then the last.
    states = [await boundary(r) for r in range(1, 6)] + [await boundary(6, last=True)]
    assert [s.round_number if s else None for s in states] == [None, None, 3, 3, 3, 6]


def test_no_trainer_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    assert trainer_state.load_trainer_state(tmp_path, model, torch.optim.AdamW(model.parameters())) is None


def test_a_damaged_trainer_checkpoint_is_data_loss(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    trainer_state.save_trainer_state(tmp_path, model, optimizer, trainer_state.TrainerState(1))
    victim = next(tmp_path.glob("model-*.safetensors"))
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x00")
    with pytest.raises(DataLossError):
        trainer_state.load_trainer_state(tmp_path, model, optimizer)


def test_the_spec_reads_from_a_proto_or_its_json() -> None:
    from google.protobuf import json_format

    job = common_pb2.JobSpec(
        name="j",
        diloco=common_pb2.DilocoJobSpec(rounds=7, delta_dtype=common_pb2.DELTA_DTYPE_BF16),
    )
    as_json = json_format.MessageToDict(job)
    assert diloco_settings.diloco_spec(job).rounds == 7
    assert diloco_settings.diloco_spec(as_json).rounds == 7
    assert diloco_settings.delta_wire_dtype(diloco_settings.diloco_spec(as_json)) == "bf16"
    with pytest.raises(InvalidArgumentError):
        diloco_settings.diloco_spec(common_pb2.JobSpec(task=common_pb2.TaskJobSpec(command="x")))


def test_unset_inner_settings_take_torch_defaults() -> None:
    settings = InnerSettings.from_proto(common_pb2.AdamWConfig(learning_rate=0.01))
    assert settings == InnerSettings(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(InvalidArgumentError):
        InnerSettings.from_proto(common_pb2.AdamWConfig(beta1=1.5))
    with pytest.raises(InvalidArgumentError):
        InnerSettings.from_proto(common_pb2.AdamWConfig(max_grad_norm=-1.0))
    tuned = InnerSettings.from_proto(common_pb2.AdamWConfig(max_grad_norm=0.5, warmup_steps=8))
    assert (tuned.max_grad_norm, tuned.warmup_steps) == (0.5, 8)
    with pytest.raises(InvalidArgumentError, match="decay_steps"):
        InnerSettings.from_proto(common_pb2.AdamWConfig(warmup_steps=8, decay_steps=8))
    with pytest.raises(InvalidArgumentError, match="min_lr_ratio"):
        InnerSettings.from_proto(common_pb2.AdamWConfig(decay_steps=8, min_lr_ratio=1.5))


class _Linear(nn.Module):
    """A torch-kind model: called with the batch's keys, its logits scored against ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)


def _linear_model() -> nn.Module:
    torch.manual_seed(0)
    return _Linear()


def _linear_batch() -> dict[str, torch.Tensor]:
    return {"inputs": torch.randn(8, 4) * 100, "labels": torch.randint(0, 3, (8,))}


def test_a_clipped_step_moves_the_parameters_by_at_most_the_norm() -> None:
    # Plain SGD at lr 1: the step is the (clipped) gradient itself, so its norm is visible.
    settings, batch = InnerSettings(max_grad_norm=0.01), _linear_batch()
    clipped, unclipped = _linear_model(), _linear_model()
    for model, step_settings in ((clipped, settings), (unclipped, None)):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        inner_steps.train_step(model, optimizer, ModelKind.TORCH, batch, step_settings)
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        moved = float(torch.linalg.vector_norm(after - before))
        if model is clipped:
            assert moved == pytest.approx(0.01, rel=1e-3)
        else:
            assert moved > 1.0  # the same batch's gradient is far larger than the bound


def test_warmup_raises_the_rate_linearly_and_resumes_from_the_optimizer_state() -> None:
    settings, batch = InnerSettings(lr=0.4, warmup_steps=4), _linear_batch()
    model = _linear_model()
    optimizer = diloco_settings.make_inner_optimizer(model, settings)
    rates = []
    for _ in range(3):
        inner_steps.train_step(model, optimizer, ModelKind.TORCH, batch, settings)
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.1, 0.2, 0.3])

    # A trainer restarted from its checkpoint: a fresh optimizer, the saved state loaded.
    resumed_model = _linear_model()
    resumed = diloco_settings.make_inner_optimizer(resumed_model, settings)
    resumed.load_state_dict(optimizer.state_dict())
    for expected in (0.4, 0.4):
        inner_steps.train_step(resumed_model, resumed, ModelKind.TORCH, batch, settings)
        assert resumed.param_groups[0]["lr"] == pytest.approx(expected)


def test_the_cosine_decay_follows_the_warmup_down_to_its_floor_and_stays_there() -> None:
    settings = InnerSettings(lr=0.4, warmup_steps=4, decay_steps=12, min_lr_ratio=0.1)
    factors = [inner_steps.lr_factor(step, settings) for step in range(1, 16)]
    # Warmup 1..4, then half a cosine over steps 5..12 (8 steps), then the floor.
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(1, 9)]
    assert factors == pytest.approx([0.25, 0.5, 0.75, 1.0, *cosine, 0.1, 0.1, 0.1])
    assert factors[7] == pytest.approx(0.55)  # step 8: half way down
    # No warmup: the decay starts at once (the floor at step decay_steps, 0 when unset).
    no_warmup = InnerSettings(decay_steps=2)
    assert [inner_steps.lr_factor(step, no_warmup) for step in (1, 2, 3)] == pytest.approx([0.5, 0.0, 0.0])

    # The optimizer takes the scheduled rate; a resumed one goes on from its saved step count.
    model, batch = _linear_model(), _linear_batch()
    optimizer = diloco_settings.make_inner_optimizer(model, settings)
    for _ in range(10):
        inner_steps.train_step(model, optimizer, ModelKind.TORCH, batch, settings)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * factors[9])
    resumed_model = _linear_model()
    resumed = diloco_settings.make_inner_optimizer(resumed_model, settings)
    resumed.load_state_dict(optimizer.state_dict())
    for step in (11, 12, 13):
        inner_steps.train_step(resumed_model, resumed, ModelKind.TORCH, batch, settings)
        assert resumed.param_groups[0]["lr"] == pytest.approx(0.4 * factors[step - 1])
