"""The DiLoCo trainer and parameter server run together in one process, over fake bridges."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

from hypha import models
from hypha.errors import UnavailableError
from hypha.tensors.payload import decode_state, encode_state
from hypha.v1 import common_pb2
from hypha.worker.executors import diloco_settings, diloco_trainer, inner_steps, trainer_state
from hypha.worker.executors.diloco_trainer import DilocoTrainer, TrainerOptions
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions
from tests.executors import FakeBridge, FakeNetwork, diloco_spec, sync_after_first, sync_every
from tests.helpers import FakeClock, eventually

OUTER_LR, MOMENTUM = 0.7, 0.9


def _network(
    tmp_path: Path, model_dir: Path, slices: dict[str, list[Path]], trainers: tuple[str, ...], **spec: object
) -> FakeNetwork:
    return FakeNetwork(
        spec=diloco_spec(**spec),  # type: ignore[arg-type]
        root=tmp_path / "jobs",
        model_dir=model_dir,
        trainer_ids=trainers,
        slices={peer: slices[peer] for peer in trainers},
    )


def _trainer(network: FakeNetwork, peer: str, **options: float) -> DilocoTrainer:
    settings = {"fetch_timeout_s": 10.0, "update_patience_s": 60.0, **options}
    return DilocoTrainer(network.bridge(peer), options=TrainerOptions(**settings))  # type: ignore[arg-type]


def _server(network: FakeNetwork, clock: FakeClock | None = None) -> ParameterServer:
    options = ServerOptions(poll_s=0.05, linger_s=0.0)
    if clock is not None:
        options.clock = clock
    return ParameterServer(network.bridge(network.ps_id), options=options)


def _reference(theta0: dict[str, torch.Tensor], network: FakeNetwork, rounds: int) -> dict[str, torch.Tensor]:
    """θ_global from the deltas the trainers sent, with torch's own SGD(nesterov=True) on grad = -Δ_avg."""
    names = list(theta0)
    params = [nn.Parameter(theta0[n].clone()) for n in names]
    sgd = torch.optim.SGD(params, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    for r in range(rounds):
        first_per_sender = {s.sender: s for s in reversed(network.deltas(r))}
        total = sum(s.samples for s in first_per_sender.values())
        decoded = [(decode_state(s.data), s.samples / total) for s in first_per_sender.values()]
        for name, param in zip(names, params, strict=True):
            param.grad = -sum((d[name] * w for d, w in decoded), torch.zeros_like(param))
        sgd.step()
    return {n: p.detach() for n, p in zip(names, params, strict=True)}


async def _run(*coroutines: object, timeout: float = 90.0) -> list[int]:
    return list(await asyncio.wait_for(asyncio.gather(*coroutines), timeout))  # type: ignore[call-overload]


async def test_three_trainers_with_unequal_batches_match_the_reference_and_lower_the_loss(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    rounds, batches = 4, {"t0": 3, "t1": 5, "t2": 4}
    network = _network(tmp_path, gpt2_dir, slices, ("t0", "t1", "t2"), rounds=rounds)
    network.policy = sync_every(batches)
    ps = _server(network)
    trainers = {peer: _trainer(network, peer) for peer in batches}

    codes = await _run(ps.run(), *(t.run() for t in trainers.values()))

    assert codes == [0, 0, 0, 0]
    for r in range(rounds):
        sent = {s.sender: s.samples for s in network.deltas(r)}
        assert sent == {peer: 8 * n for peer, n in batches.items()}, r
    theta0 = inner_steps.parameter_state(
        models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    )
    expected = _reference(theta0, network, rounds)
    assert ps.core is not None and ps.core.round_number == rounds
    theta_global = ps.core.outer.parameters()
    for name, value in expected.items():
        torch.testing.assert_close(theta_global[name], value, rtol=0, atol=1e-6)
    for trainer in trainers.values():
        assert trainer.model is not None
        for name, p in trainer.model.named_parameters():
            assert torch.equal(p.detach(), theta_global[name])
    # Loss over the rounds, averaged across trainers.
    first = sum(t.round_losses[0] for t in trainers.values()) / 3
    last = sum(t.round_losses[-1] for t in trainers.values()) / 3
    assert last < first - 0.5, (first, last)
    assert {m[1] for m in network.metrics if m[0] == "t1"} == set(range(rounds))
    # Every slice a trainer finished was reported as used: t1 ran 4 x 5 x 8 = 160 samples = 13 slices of 12.
    assert network.used["t1"] == list(range(13))
    # The result is a from_pretrained directory holding θ_global.
    result = network.results["ps"]
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(result)
    for name, p in final.named_parameters():
        assert torch.equal(p.detach(), theta_global[name]), name
    assert network.statuses["ps"][-1][0] == "succeeded"
    assert all(network.statuses[peer][-1][0] == "succeeded" for peer in batches)


async def test_sync_after_counts_down_and_bf16_deltas_travel_as_bf16(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    batches = {"t0": 4, "t1": 2}
    network = _network(
        tmp_path, gpt2_dir, slices, ("t0", "t1"), rounds=2, delta_dtype=common_pb2.DELTA_DTYPE_BF16
    )
    network.policy = sync_after_first(batches)
    ps = _server(network)

    codes = await _run(ps.run(), _trainer(network, "t0").run(), _trainer(network, "t1").run())

    assert codes == [0, 0, 0]
    for peer, n in batches.items():
        assert [m[2]["batches"] for m in network.metrics if m[0] == peer] == [n, n]
    for sent in network.deltas():
        assert {t.dtype for t in decode_state(sent.data, None).values()} == {torch.bfloat16}
    assert ps.core is not None and ps.core.outer.steps == 2


async def test_every_inner_step_runs_on_the_trainers_one_training_thread(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slices are loaded and deltas written on asyncio's shared pool meanwhile; a step that
    # hopped between its threads ran ~7 % slower (diloco_trainer's NOTE).
    threads: list[str] = []
    step = diloco_trainer.train_step

    def recorded(*args: Any) -> float:
        threads.append(threading.current_thread().name)
        return step(*args)

    monkeypatch.setattr(diloco_trainer, "train_step", recorded)
    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=2)
    network.policy = sync_every({"t0": 3})

    codes = await _run(_server(network).run(), _trainer(network, "t0").run())

    assert codes == [0, 0]
    assert len(threads) == 6 and set(threads) == {"hypha-train_0"}, threads


async def test_int8_deltas_are_a_quarter_of_fp32_and_the_server_steps_with_what_it_decoded(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    # Prepare
    rounds, batches = 3, {"t0": 2, "t1": 3}
    network = _network(
        tmp_path, gpt2_dir, slices, ("t0", "t1"), rounds=rounds, delta_dtype=common_pb2.DELTA_DTYPE_INT8
    )
    network.policy = sync_every(batches)
    ps = _server(network)
    trainers = {peer: _trainer(network, peer) for peer in batches}

    # Execute
    codes = await _run(ps.run(), *(t.run() for t in trainers.values()))

    # Assert: the wire holds int8 codes, θ_global is torch's SGD over the decoded deltas,
    # and each trainer keeps a (small, non-zero) residual for its next round.
    assert codes == [0, 0, 0]
    theta0 = inner_steps.parameter_state(
        models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    )
    fp32_bytes = len(encode_state(theta0))
    for sent in network.deltas():
        raw = safetensors.torch.load(sent.data)
        assert {t.dtype for name, t in raw.items() if name.endswith("/q")} == {torch.int8}
        assert 0.2 < len(sent.data) / fp32_bytes < 0.3
    expected = _reference(theta0, network, rounds)
    assert ps.core is not None
    for name, value in expected.items():
        torch.testing.assert_close(ps.core.outer.parameters()[name], value, rtol=0, atol=1e-6)
    for trainer in trainers.values():
        residual = trainer.encoder.residual
        assert set(residual) == set(theta0) and any(float(r.abs().max()) > 0 for r in residual.values())


async def test_late_trainer_pulls_global_and_a_round_completes_by_quorum_without_it(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    network = _network(tmp_path, gpt2_dir, slices, ("t0", "t1"), rounds=3, quorum=0.5, round_timeout_s=30.0)
    network.policy = sync_every({"t0": 2, "t1": 3})
    network.start_rounds["t1"] = 1
    clock = FakeClock(1000.0)
    ps = _server(network, clock)
    late = _trainer(network, "t1")
    job = asyncio.gather(ps.run(), _trainer(network, "t0").run(), late.run())

    async def round_0_waits_for_its_deadline() -> None:
        await eventually(lambda: ps.core is not None and ps.core.current_round.arrived == {"t0"})
        assert not ps.updates  # quorum is met, but the deadline has not passed
        clock.now += 31.0

    await _run(round_0_waits_for_its_deadline())
    codes = await asyncio.wait_for(job, 90)

    assert list(codes) == [0, 0, 0]
    assert [(u.contributors, u.missing) for u in ps.updates] == [
        (("t0",), ("t1",)),
        (("t0", "t1"), ()),
        (("t0", "t1"), ()),
    ]
    assert next(f for f in network.fetched if f[0] == "t1") == ("t1", "ps", "global", 1)
    assert next(p[1] for p in network.progress if p[0] == "t1") == 1
    assert late.round_number == 3


async def test_a_restarted_trainer_resumes_from_its_checkpoint_and_pulls_global(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=4)
    network.policy = sync_every({"t0": 3}, rounds=2)  # the first run stops after round 1
    ps = _server(network)
    server = asyncio.ensure_future(ps.run())
    first = _trainer(network, "t0")
    assert await asyncio.wait_for(first.run(), 60) == 0
    assert first.round_number == 2 and first.samples_total == 48
    progress_before = len(network.progress)

    network.policy = sync_every({"t0": 3})
    second = _trainer(network, "t0")
    codes = await _run(server, second.run())

    assert codes == [0, 0]
    assert network.progress[progress_before][:2] == ("t0", 2)
    assert ("t0", "ps", "global", 2) in network.fetched
    assert second.samples_total == 4 * 3 * 8
    assert ps.core is not None
    assert second.model is not None
    for name, p in second.model.named_parameters():
        assert torch.equal(p.detach(), ps.core.outer.parameters()[name])


def _whole_update(trainer: DilocoTrainer, tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """θ_global of 0.5 everywhere, written as an fp32 update file to publish by hand."""
    theta = {n: torch.full_like(t, 0.5) for n, t in inner_steps.parameter_state(trainer.model).items()}  # type: ignore[arg-type]
    path = tmp_path / "update.safetensors"
    path.write_bytes(encode_state(theta, "fp32"))
    return theta, path


async def test_a_trainer_resends_its_delta_until_the_update_comes(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=3)
    network.policy = sync_every({"t0": 2}, rounds=1)
    trainer = _trainer(network, "t0", fetch_timeout_s=0.05)
    task = asyncio.ensure_future(trainer.run())
    # No parameter server runs: every fetch times out and the trainer sends its delta again.
    await eventually(lambda: len(network.deltas(0)) >= 3, timeout=30)
    theta, path = _whole_update(trainer, tmp_path)
    await network.publish("ps", "update", 0, path)

    assert await asyncio.wait_for(task, 30) == 0
    assert trainer.round_number == 1
    assert all(torch.equal(trainer._global_sync.theta_global[n], theta[n]) for n in theta)


async def test_a_trainer_keeps_its_last_delta_and_sends_it_again_first_until_the_next_update_comes(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    # Prepare: no parameter server; updates are published by hand.
    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=3)
    network.policy = sync_every({"t0": 2})
    trainer = _trainer(network, "t0", fetch_timeout_s=0.05)
    task = asyncio.ensure_future(trainer.run())
    await eventually(lambda: len(network.deltas(0)) >= 1, timeout=30)
    _, path = _whole_update(trainer, tmp_path)
    await network.publish("ps", "update", 0, path)

    # Execute: round 1's update does not come (a server restored one round behind).
    await eventually(lambda: len(network.deltas(1)) >= 3, timeout=30)
    round_zero = network.deltas(0)[0].data
    await network.publish("ps", "update", 1, path)
    await eventually(lambda: len(network.deltas(2)) >= 1, timeout=30)

    # Assert: each wait for round 1's update sent round 0's delta (the same bytes) again just
    # before round 1's; round 0's is dropped once round 1's update came, and nothing is left.
    sends = [s.round for s in network.sent if s.kind == "delta"]
    round_one = sends[sends.index(1) : sends.index(2)]
    assert len(round_one) >= 5 and round_one == [1] + [0, 1] * ((len(round_one) - 1) // 2)
    assert all(s.data == round_zero for s in network.deltas(0))
    await network.publish("ps", "update", 2, path)
    assert await asyncio.wait_for(task, 30) == 0
    assert not list(trainer.work_dir.glob("delta-*"))
    assert 0 not in [s.round for s in network.sent if s.kind == "delta"][sends.index(2) :]


async def test_a_trainer_without_data_still_obeys_done(tmp_path: Path, gpt2_dir: Path) -> None:
    network = _network(tmp_path, gpt2_dir, {"t0": []}, ("t0",), rounds=3)
    calls = 0

    def policy(peer: str, round_number: int, batches: int) -> object:
        nonlocal calls
        calls += 1
        return sync_every({"t0": 1}, rounds=0 if calls >= 3 else None)(peer, round_number, batches)

    network.policy = policy  # type: ignore[assignment]
    trainer = _trainer(network, "t0", idle_min_s=0.001, idle_max_s=0.01)

    assert await asyncio.wait_for(trainer.run(), 30) == 0
    assert calls == 3 and not network.sent
    assert [p[2] for p in network.progress] == [0, 0, 0]


async def test_the_trainer_process_trains_through_the_real_job_bridge(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    """``python -m hypha.worker.executors.diloco_trainer`` against the worker's aiohttp bridge."""
    import sys

    from tests.executors import executor_env, start_real_bridge

    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=2)
    network.policy = sync_every({"t0": 3})
    bridge, record, work_dir = await start_real_bridge(network, "t0")
    ps = _server(network)
    server = asyncio.ensure_future(ps.run())
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hypha.worker.executors.diloco_trainer",
            cwd=work_dir,
            env=executor_env(bridge.socket_path, work_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), 90)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0, output.decode(errors="replace")
        assert await asyncio.wait_for(server, 30) == 0
    finally:
        await bridge.stop()

    assert record.reported_state == "succeeded"
    assert [(s.sender, s.round, s.samples) for s in network.deltas()] == [("t0", 0, 24), ("t0", 1, 24)]
    assert (work_dir / "resources" / "model" / "config.json").exists()  # fetched by the worker
    assert [m[1] for m in network.metrics if m[0] == "t0"] == [0, 1]
    # The trainer's checkpoint holds the θ_global of the last update.
    saved = trainer_state.TrainerState(2, 48)
    model = models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    optimizer = diloco_settings.make_inner_optimizer(model, diloco_settings.InnerSettings())
    assert trainer_state.load_trainer_state(work_dir / "trainer-state", model, optimizer) == saved
    assert ps.core is not None
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ps.core.outer.parameters()[name])


class _LateAnswerBridge(FakeBridge):
    """Answers a report sent as the next batch started only after the trainer ran two more batches."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        super().__init__(network, peer)
        self.steps = 0
        self._held: list[tuple[int, asyncio.Future[None]]] = []

    def stepped(self) -> None:
        """Called on the loop after each train step (which runs in a thread)."""
        self.steps += 1
        for due, held in self._held:
            if self.steps >= due and not held.done():
                held.set_result(None)

    async def progress(self, round: int, batches: int, *args: Any, **kwargs: Any) -> Any:
        answer = await super().progress(round, batches, *args, **kwargs)
        if kwargs.get("next_batch_started"):
            held = asyncio.get_running_loop().create_future()
            self._held.append((batches + 2, held))
            # Awaited bare (no wait_for layer): ``stepped`` runs before the step's own
            # completion reaches the trainer, so this answer is back before the trainer looks.
            await held
        return answer


async def test_progress_travels_while_the_next_batch_trains_and_the_sync_lands_where_it_was_told(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: every answer to an early report comes two batches late.
    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=1)
    network.policy = sync_every({"t0": 5})
    bridge = _LateAnswerBridge(network, "t0")
    loop, real_step = asyncio.get_running_loop(), diloco_trainer.train_step

    def counted(*args: Any) -> float:
        loss = real_step(*args)
        loop.call_soon_threadsafe(bridge.stepped)
        return loss

    monkeypatch.setattr(diloco_trainer, "train_step", counted)
    options = TrainerOptions(fetch_timeout_s=10.0, update_patience_s=60.0, report_interval_s=0.0)
    trainer = DilocoTrainer(bridge, options=options)

    # Execute
    assert await _run(_server(network).run(), trainer.run()) == [0, 0]

    # Assert: reports after batches 1 and 3 went out as the next batch started (the one after
    # batch 2 was skipped: 1's answer was still out); batch 5's was awaited before the sync,
    # which came after exactly the 5 batches that "sync_after 4" (the answer to 1) asked for.
    assert [(p[2], p[5]) for p in network.progress] == [(1, True), (3, True), (5, False)]
    assert [m[2]["batches"] for m in network.metrics if m[0] == "t0"] == [5]
    (delta,) = network.deltas(0)
    assert delta.samples == 5 * network.batch_size


class _FlakyBridge(FakeBridge):
    """The first progress report, slice request, delta send and update fetch fail as 'unavailable'."""

    def __init__(self, network: FakeNetwork, peer: str) -> None:
        super().__init__(network, peer)
        self.failed: set[str] = set()

    def _fail_once(self, call: str) -> None:
        if call not in self.failed:
            self.failed.add(call)
            raise UnavailableError(f"{call}: scheduler unreachable")

    async def progress(self, *args: Any, **kwargs: Any) -> Any:
        self._fail_once("progress")
        return await super().progress(*args, **kwargs)

    async def next_slice(self) -> Any:
        self._fail_once("next_slice")
        return await super().next_slice()

    async def send_tensors(self, *args: Any, **kwargs: Any) -> Any:
        self._fail_once("send_tensors")
        return await super().send_tensors(*args, **kwargs)

    async def fetch_tensors(self, *args: Any, **kwargs: Any) -> Any:
        self._fail_once("fetch_tensors")
        return await super().fetch_tensors(*args, **kwargs)


async def test_an_unreachable_scheduler_or_peer_does_not_end_training(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    network = _network(tmp_path, gpt2_dir, slices, ("t0",), rounds=2)
    network.policy = sync_every({"t0": 3})
    flaky = _FlakyBridge(network, "t0")
    trainer = DilocoTrainer(flaky, options=TrainerOptions(fetch_timeout_s=10.0, idle_min_s=0.001))

    codes = await _run(_server(network).run(), trainer.run())

    assert codes == [0, 0]
    assert flaky.failed == {"progress", "next_slice", "send_tensors", "fetch_tensors"}
    # The lost delta of round 0 went out again while the trainer waited for its update.
    assert [(s.round, s.samples) for s in network.deltas()] == [(0, 24), (1, 24)]
