"""Streaming DiLoCo with the real trainer and parameter-server executors, over fake bridges."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hypha import models
from hypha.diloco.streaming import FragmentedOuter, partition
from hypha.tensors.payload import decode_state, encode_state
from hypha.v1 import common_pb2
from hypha.worker.executors import bridge_api, inner_steps
from hypha.worker.executors.diloco_trainer import DilocoTrainer, TrainerOptions
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions
from tests.executors import FakeBridge, FakeNetwork, diloco_spec, sync_every

OUTER_LR, MOMENTUM = 0.7, 0.9


class _Rounds:
    """The highest round each trainer has reported progress for, with a condition to wait on."""

    def __init__(self) -> None:
        self.reported: dict[str, int] = {}
        self.changed = asyncio.Condition()

    async def report(self, peer: str, round_number: int) -> None:
        async with self.changed:
            self.reported[peer] = max(self.reported.get(peer, -1), round_number)
            self.changed.notify_all()


class _TrainerBridge(FakeBridge):
    """Records progress rounds and the size of every update fetched."""

    def __init__(self, network: FakeNetwork, peer: str, rounds: _Rounds) -> None:
        super().__init__(network, peer)
        self.rounds = rounds
        self.updates: dict[int, int] = {}

    async def progress(self, round: int, *args: Any, **kwargs: Any) -> Any:
        await self.rounds.report(self.peer, round)
        return await super().progress(round, *args, **kwargs)

    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        data = await super().fetch_tensors(peer, kind, round, timeout_s)
        if data is not None and kind == bridge_api.UPDATE:
            self.updates[round] = len(data)
        return data


class _GatedServerBridge(FakeBridge):
    """Takes no delta of round r before ``waits_for`` has trained in round r+1.

    A trainer that waited for round r's update before training on would never
    get there: the job would hang, so the gate proves the overlap.
    """

    def __init__(self, network: FakeNetwork, rounds: _Rounds, waits_for: str, last_round: int) -> None:
        super().__init__(network, network.ps_id)
        self.rounds = rounds
        self.waits_for = waits_for
        self.last_round = last_round
        self.server: ParameterServer | None = None

    async def inbox(self, kind: str, timeout_s: float) -> Any:
        core = self.server.core if self.server is not None else None
        if kind == bridge_api.DELTA and core is not None and core.round_number < self.last_round:
            current = core.round_number
            async with self.rounds.changed:
                await self.rounds.changed.wait_for(
                    lambda: self.rounds.reported.get(self.waits_for, -1) > current
                )
        return await super().inbox(kind, timeout_s)


def _gated_job(
    network: FakeNetwork, batches: dict[str, int], rounds: int
) -> tuple[ParameterServer, dict[str, _TrainerBridge], dict[str, DilocoTrainer]]:
    """The job's executors: trainers syncing after ``batches`` each, and a server that takes no
    delta of round r before t0 trains in round r+1 (``_GatedServerBridge``)."""
    network.policy = sync_every(batches)
    progress = _Rounds()
    ps_bridge = _GatedServerBridge(network, progress, waits_for="t0", last_round=rounds - 1)
    ps = ParameterServer(ps_bridge, options=ServerOptions(poll_s=0.05, linger_s=0.0))
    ps_bridge.server = ps
    bridges = {peer: _TrainerBridge(network, peer, progress) for peer in batches}
    options = TrainerOptions(fetch_timeout_s=10.0, update_patience_s=60.0)
    return ps, bridges, {peer: DilocoTrainer(b, options=options) for peer, b in bridges.items()}


def _reference(
    theta0: Mapping[str, torch.Tensor], fragments: list[list[str]], network: FakeNetwork, rounds: int
) -> dict[str, torch.Tensor]:
    """θ_global from the deltas sent, stepped by ``hypha.diloco.streaming.FragmentedOuter``."""
    outer = FragmentedOuter(theta0, fragments, OUTER_LR, MOMENTUM)
    for r in range(rounds):
        first_per_sender = {s.sender: s for s in reversed(network.deltas(r))}
        ordered = [first_per_sender[peer] for peer in sorted(first_per_sender)]
        outer.step(r % len(fragments), [(decode_state(s.data, torch.float32), s.samples) for s in ordered])
    return {name: t.clone() for name, t in outer.parameters().items()}


async def test_two_fragments_sync_half_the_model_each_overlapped_and_match_the_reference(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    # Prepare: F=2, t0 syncs after 2 batches a round, t1 after 4; the server takes round r's
    # deltas only once t0 trains in round r+1 (it must not wait for its fragment's update).
    rounds, batches = 4, {"t0": 2, "t1": 4}
    network = FakeNetwork(
        spec=diloco_spec(rounds=rounds, outer_lr=OUTER_LR, momentum=MOMENTUM),
        root=tmp_path / "jobs",
        model_dir=gpt2_dir,
        trainer_ids=tuple(batches),
        slices=slices,
    )
    network.spec.diloco.streaming_fragments = 2
    ps, bridges, trainers = _gated_job(network, batches, rounds)

    # Execute
    codes = await asyncio.wait_for(asyncio.gather(ps.run(), *(t.run() for t in trainers.values())), 120)

    # Assert: the job completes; round r carries fragment r mod 2 only, about half the bytes,
    # weighted by the samples since that fragment's last sync.
    assert list(codes) == [0, 0, 0]
    theta0 = inner_steps.parameter_state(
        models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    )
    fragments = partition({n: t.numel() for n, t in theta0.items()}, 2)
    full_bytes = len(encode_state(theta0))
    for r in range(rounds):
        sent = network.deltas(r)
        assert {s.sender for s in sent} == set(batches), r
        for s in sent:
            assert set(decode_state(s.data)) == set(fragments[r % 2]), r
            assert 0.35 < len(s.data) / full_bytes < 0.65, (r, len(s.data) / full_bytes)
        for bridge in bridges.values():
            assert 0.35 < bridge.updates[r] / full_bytes < 0.65, r
    samples = {peer: [s.samples for s in network.deltas() if s.sender == peer] for peer in batches}
    assert samples == {"t0": [16, 32, 32, 32], "t1": [32, 64, 64, 64]}
    # θ_global is FragmentedOuter's over the deltas sent, and every trainer holds it.
    expected = _reference(theta0, fragments, network, rounds)
    assert ps.core is not None and ps.core.round_number == rounds and ps.core.outer.steps == rounds
    theta_global = ps.core.outer.parameters()
    for name, value in expected.items():
        assert torch.equal(theta_global[name], value), name  # same arithmetic, bit for bit
    for trainer in trainers.values():
        for name, value in trainer._global_sync.theta_global.items():
            assert torch.equal(value, theta_global[name]), name
        assert trainer.model is not None
        # The last fragment landed after the last step: the model holds its θ_global exactly.
        params = dict(trainer.model.named_parameters())
        assert all(torch.equal(params[n].detach(), theta_global[n]) for n in fragments[(rounds - 1) % 2])
    # One metrics report per round and trainer, with the idle time at its sync and the Δ's size.
    for peer in batches:
        reports = [m for m in network.metrics if m[0] == peer]
        assert [m[1] for m in reports] == list(range(rounds))
        assert all(m[2]["sync_idle_seconds"] >= 0 for m in reports)
        assert [int(m[2]["delta_bytes"]) for m in reports] == [
            len(s.data) for s in network.deltas() if s.sender == peer
        ]
    assert network.statuses["ps"][-1][0] == "succeeded"
    # A parameter server restarted from its checkpoint keeps the fragments and re-publishes the
    # last round's update as that fragment alone, and the whole θ_global as "global".
    restarted = ParameterServer(
        network.bridge(network.ps_id), options=ServerOptions(poll_s=0.05, linger_s=0.0)
    )
    core = await restarted.start()
    assert core.fragments == fragments and core.round_number == rounds
    update = decode_state(network.published[(network.ps_id, bridge_api.UPDATE, rounds - 1)].read_bytes())
    assert set(update) == set(fragments[(rounds - 1) % 2])
    assert all(torch.equal(update[n], theta_global[n]) for n in update)
    assert set(
        decode_state(network.published[(network.ps_id, bridge_api.GLOBAL, rounds)].read_bytes())
    ) == set(theta0)


async def test_overlap_sync_keeps_training_while_whole_model_rounds_travel(
    tmp_path: Path, gpt2_dir: Path, slices: dict[str, list[Path]]
) -> None:
    # Prepare: whole-model rounds with overlap_sync; the server takes round r's deltas only once
    # t0 trains in round r+1, which a trainer waiting for its update would never do.
    rounds, batches = 3, {"t0": 2, "t1": 3}
    network = FakeNetwork(
        spec=diloco_spec(rounds=rounds, outer_lr=OUTER_LR, momentum=MOMENTUM),
        root=tmp_path / "jobs",
        model_dir=gpt2_dir,
        trainer_ids=tuple(batches),
        slices=slices,
    )
    network.spec.diloco.overlap_sync = True
    ps, _, trainers = _gated_job(network, batches, rounds)

    # Execute
    codes = await asyncio.wait_for(asyncio.gather(ps.run(), *(t.run() for t in trainers.values())), 120)

    # Assert: every round's delta is the whole model, θ_global is plain DiLoCo's outer step over
    # the deltas sent, and each trainer ends on it (its last update landed after its last step).
    assert list(codes) == [0, 0, 0]
    theta0 = inner_steps.parameter_state(
        models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), gpt2_dir)
    )
    for r in range(rounds):
        assert {s.sender for s in network.deltas(r)} == set(batches), r
        assert all(set(decode_state(s.data)) == set(theta0) for s in network.deltas(r)), r
    expected = _reference(theta0, [list(theta0)], network, rounds)
    assert ps.core is not None and ps.core.fragments is None
    theta_global = ps.core.outer.parameters()
    for name, value in expected.items():
        assert torch.allclose(theta_global[name], value, atol=1e-6), name
    for trainer in trainers.values():
        assert trainer.model is not None
        params = dict(trainer.model.named_parameters())
        assert all(torch.equal(params[n].detach(), theta_global[n]) for n in theta0)
    samples = {peer: [s.samples for s in network.deltas() if s.sender == peer] for peer in batches}
    assert samples == {"t0": [16, 16, 16], "t1": [24, 24, 24]}
    # Each round says how stale its update was when it landed: t0 trained at least one batch of
    # the next round before the server took the round (the gate), and at most that round's
    # batches (the next sync waits for it); the last round's landed after the last step.
    for peer, per_round in batches.items():
        lags = [int(m[2]["update_lag_batches"]) for m in network.metrics if m[0] == peer]
        assert len(lags) == rounds and lags[-1] == 0, (peer, lags)
        assert all(0 <= lag <= per_round for lag in lags), (peer, lags)
        if peer == "t0":
            assert all(lag >= 1 for lag in lags[:-1]), lags
