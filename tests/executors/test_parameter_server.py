"""The parameter-server executor, fed deltas directly through a fake bridge."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from torch import nn

from hypha import models
from hypha.diloco import checkpoint
from hypha.errors import FailedPreconditionError
from hypha.models import ModelKind
from hypha.tensors.payload import decode_state, encode_state, read_metadata
from hypha.v1 import common_pb2
from hypha.worker.executors import inner_steps
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions
from tests.executors import FakeNetwork, FakeReceived, diloco_spec
from tests.helpers import FakeClock

TRAINERS = ("t0", "t1", "t2")

OUTER_LR, MOMENTUM = 0.5, 0.8


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.save_tiny_model(ModelKind.VISION_CLASSIFICATION, tmp_path_factory.mktemp("m") / "vit")


@pytest.fixture(scope="module")
def theta0(vit_dir: Path) -> dict[str, torch.Tensor]:
    spec = common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_VISION_CLASSIFICATION)
    return inner_steps.parameter_state(models.build_model(spec, vit_dir))


def _network(root: Path, vit_dir: Path, rounds: int = 3, **spec: object) -> FakeNetwork:
    return FakeNetwork(
        spec=diloco_spec(
            rounds=rounds,
            model_type=common_pb2.MODEL_TYPE_VISION_CLASSIFICATION,
            outer_lr=OUTER_LR,
            momentum=MOMENTUM,
            **spec,  # type: ignore[arg-type]
        ),
        root=root,
        model_dir=vit_dir,
        trainer_ids=TRAINERS,
    )


def _server(network: FakeNetwork, clock: FakeClock) -> ParameterServer:
    return ParameterServer(
        network.bridge("ps"), options=ServerOptions(poll_s=0.02, linger_s=0.0, clock=clock)
    )


def _delta(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) * 0.01 for n, t in template.items()}


def _received(peer: str, round_number: int, samples: int, delta: dict[str, torch.Tensor]) -> FakeReceived:
    return FakeReceived(encode_state(delta), peer, "delta", round_number, samples)


#: Unequal samples per trainer and round.
SAMPLES = {
    0: {"t0": 8, "t1": 24, "t2": 40},
    1: {"t0": 32, "t1": 8, "t2": 16},
    2: {"t0": 5, "t1": 50, "t2": 1},
}


def _reference(theta0: dict[str, torch.Tensor], rounds: int) -> dict[str, torch.Tensor]:
    names = list(theta0)
    params = [nn.Parameter(theta0[n].clone()) for n in names]
    sgd = torch.optim.SGD(params, lr=OUTER_LR, momentum=MOMENTUM, nesterov=True)
    for r in range(rounds):
        total = sum(SAMPLES[r].values())
        deltas = [(_delta(theta0, 10 * r + i), SAMPLES[r][p] / total) for i, p in enumerate(TRAINERS)]
        for name, param in zip(names, params, strict=True):
            param.grad = -sum((d[name] * w for d, w in deltas), torch.zeros_like(param))
        sgd.step()
    return {n: p.detach() for n, p in zip(names, params, strict=True)}


async def _feed_round(ps: ParameterServer, theta0: dict[str, torch.Tensor], r: int) -> None:
    for i, peer in enumerate(TRAINERS):
        receipt = await ps.handle(_received(peer, r, SAMPLES[r][peer], _delta(theta0, 10 * r + i)))
        assert receipt is not None and receipt.accepted
    update = await ps.tick()
    assert update is not None and update.round_number == r


async def test_the_run_loop_matches_torch_sgd_nesterov_and_publishes_the_result(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    network = _network(tmp_path, vit_dir)
    ps = _server(network, FakeClock(50.0))
    task = asyncio.ensure_future(ps.run())
    for r in range(3):
        for i, peer in reversed(list(enumerate(TRAINERS))):  # arrival order does not matter
            network.deliver(
                peer, "ps", "delta", r, SAMPLES[r][peer], encode_state(_delta(theta0, 10 * r + i))
            )
        update = await network.fetch("ps", "update", r, timeout_s=30)
        assert update is not None

    assert await asyncio.wait_for(task, 30) == 0

    expected = _reference(theta0, 3)
    assert ps.core is not None
    for name, value in expected.items():
        torch.testing.assert_close(ps.core.outer.parameters()[name], value, rtol=0, atol=1e-6)
    last = decode_state(network.published[("ps", "update", 2)].read_bytes())
    assert all(torch.equal(last[n], ps.core.outer.parameters()[n]) for n in last)
    assert read_metadata(network.published[("ps", "global", 3)].read_bytes())["global_round"] == "3"
    from transformers import AutoModelForImageClassification

    final = AutoModelForImageClassification.from_pretrained(network.results["ps"])
    for name, p in final.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-6)
    assert network.statuses["ps"] == [("succeeded", "3 rounds, 3 outer steps")]
    assert [m[2]["samples"] for m in network.metrics] == [72.0, 56.0, 56.0]


async def test_a_failed_local_checkpoint_fails_the_server_before_its_update_goes_out(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The local checkpoint is written beside the state's publication and commit; both must
    # be durable before the round's update leaves, so a disk that refuses it stops the round.
    def full_disk(written: object) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "commit", full_disk)
    network = _network(tmp_path, vit_dir)
    ps = _server(network, FakeClock(50.0))
    task = asyncio.ensure_future(ps.run())
    for i, peer in enumerate(TRAINERS):
        network.deliver(peer, "ps", "delta", 0, SAMPLES[0][peer], encode_state(_delta(theta0, i)))

    assert await asyncio.wait_for(task, 30) == 1

    assert ("ps", "update", 0) not in network.published
    assert ("ps", "global", 1) not in network.published
    (state, message) = network.statuses["ps"][-1]
    assert state == "failed" and "No space left on device" in message


async def test_a_restarted_server_resumes_identical_state_and_republishes(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    uninterrupted = _server(_network(tmp_path / "a", vit_dir), FakeClock(50.0))
    await uninterrupted.start()
    for r in range(3):
        await _feed_round(uninterrupted, theta0, r)

    network = _network(tmp_path / "b", vit_dir)
    first = _server(network, FakeClock(50.0))
    await first.start()
    for r in range(2):
        await _feed_round(first, theta0, r)
    # Half of round 2 arrives, then the process dies: that round is collected again.
    await first.handle(_received("t0", 2, SAMPLES[2]["t0"], _delta(theta0, 20)))
    network.published.clear()

    second = _server(network, FakeClock(50.0))
    core = await second.start()

    assert first.core is not None
    assert core.round_number == 2 and core.outer.steps == 2 and not core.current_round.arrived
    before, after = first.core.outer.state_dict(), core.outer.state_dict()
    assert before["momentum_buffer"] is not None and after["momentum_buffer"] is not None
    for name in theta0:
        assert torch.equal(before["params"][name], after["params"][name])
        assert torch.equal(before["momentum_buffer"][name], after["momentum_buffer"][name])
    assert set(network.published) == {("ps", "update", 1), ("ps", "global", 2)}
    await _feed_round(second, theta0, 2)
    assert uninterrupted.core is not None
    for name, value in uninterrupted.core.outer.parameters().items():
        assert torch.equal(core.outer.parameters()[name], value)


async def test_a_missing_trainer_round_completes_by_quorum_at_the_deadline(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    clock = FakeClock(50.0)
    network = _network(tmp_path, vit_dir, quorum=0.6, round_timeout_s=20.0)
    ps = _server(network, clock)
    await ps.start()
    await ps.handle(_received("t0", 0, 10, _delta(theta0, 1)))
    clock.now += 5
    await ps.handle(_received("t1", 0, 30, _delta(theta0, 2)))

    clock.now += 14.9  # 19.9 s after the first delta: quorum, but not yet the deadline
    assert await ps.tick() is None
    clock.now += 0.2
    update = await ps.tick()

    assert update is not None
    assert update.contributors == ("t0", "t1") and update.missing == ("t2",) and update.samples == 40
    assert ("ps", "update", 0) in network.published
    late = await ps.handle(_received("t2", 0, 10, _delta(theta0, 3)))
    assert late is not None and not late.accepted and "late" in late.reason
    assert ps.core is not None and ps.core.round_number == 1 and not ps.core.current_round.arrived


async def test_duplicate_unknown_and_malformed_deltas_are_dropped(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    ps = _server(_network(tmp_path, vit_dir), FakeClock(50.0))
    await ps.start()
    assert await ps.handle(_received("t0", 0, 10, _delta(theta0, 1))) is not None

    assert await ps.handle(_received("t0", 0, 10, _delta(theta0, 1))) is None  # a re-send
    assert await ps.handle(_received("stranger", 0, 10, _delta(theta0, 1))) is None
    assert await ps.handle(FakeReceived(b"not safetensors", "t1", "delta", 0, 10)) is None
    wrong_shape = {n: torch.zeros(3) for n in theta0}
    assert await ps.handle(_received("t1", 0, 10, wrong_shape)) is None
    assert await ps.handle(_received("t1", 5, 10, _delta(theta0, 1))) is None  # a future round

    assert ps.core is not None and ps.core.current_round.arrived == {"t0"}


async def test_a_poisoned_delta_is_refused_at_aggregation_and_its_trainer_may_resend(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    # Prepare: t1's delta is all NaN, the others are good.
    network = _network(tmp_path, vit_dir)
    ps = _server(network, FakeClock(50.0))
    await ps.start()
    nan = {n: torch.full_like(t, float("nan")) for n, t in theta0.items()}
    for peer, delta in (("t0", _delta(theta0, 1)), ("t1", nan), ("t2", _delta(theta0, 3))):
        assert await ps.handle(_received(peer, 0, 10, delta)) is not None

    # Execute: the round is aggregated, t1's delta found bad.
    assert await ps.tick() is None

    # Assert: nothing published, t1 missing again; its good delta completes the round.
    assert ps.core is not None and ps.core.current_round.arrived == {"t0", "t2"}
    assert [r.worker for r in ps.core.refused] == ["t1"]
    assert not any(kind == "update" for _, kind, _ in network.published)
    assert await ps.handle(_received("t1", 0, 10, _delta(theta0, 2))) is not None
    update = await ps.tick()
    assert update is not None and update.contributors == TRAINERS
    assert all(bool(torch.isfinite(t).all()) for t in update.params.values())


async def test_a_replacement_trainer_named_by_the_job_takes_the_lost_ones_place(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    network = _network(tmp_path, vit_dir)
    ps = _server(network, FakeClock(50.0))
    await ps.start()
    await ps.handle(_received("t0", 0, 10, _delta(theta0, 1)))
    await ps.handle(_received("t1", 0, 10, _delta(theta0, 2)))
    network.trainer_ids = ("t0", "t1", "t3")  # the scheduler replaced t2 with t3

    receipt = await ps.handle(_received("t3", 0, 10, _delta(theta0, 3)))

    assert receipt is not None and receipt.accepted
    update = await ps.tick()
    assert update is not None and update.contributors == ("t0", "t1", "t3")
    assert ps.core is not None and ps.core.expected == {"t0", "t1", "t3"}


async def test_a_job_without_rounds_fails_with_a_status(tmp_path: Path, vit_dir: Path) -> None:
    network = _network(tmp_path, vit_dir, rounds=0)

    assert await _server(network, FakeClock(50.0)).run() == 1
    assert network.statuses["ps"][0][0] == "failed" and "rounds" in network.statuses["ps"][0][1]


async def test_the_result_carries_the_preprocessor_files_beside_the_model(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    network = _network(tmp_path, vit_dir, rounds=1)
    network.spec.diloco.preprocessor.local_path = "/unused"
    network.preprocessor_dir = tmp_path / "preprocessor"
    network.preprocessor_dir.mkdir()
    (network.preprocessor_dir / "preprocessor_config.json").write_text('{"do_resize": false}')
    (network.preprocessor_dir / "config.json").write_text('{"not": "the model config"}')
    ps = _server(network, FakeClock(50.0))
    await ps.start()
    for i, peer in enumerate(TRAINERS):
        await ps.handle(_received(peer, 0, 8, _delta(theta0, i)))
    assert await ps.tick() is not None

    result = await ps.finish()

    assert (result / "preprocessor_config.json").read_text() == '{"do_resize": false}'
    assert "not" not in (result / "config.json").read_text()  # the model's own config wins
    assert network.results["ps"] == result


async def test_a_replacement_server_elsewhere_restores_the_pushed_state_bit_for_bit(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    # Prepare: a server completes three rounds; a round's update goes out only once the
    # scheduler holds the state of the round before (it pulls a round's state while the next trains).
    network = _network(tmp_path / "a", vit_dir)
    bridge = network.bridge("ps")
    committed: list[int] = []
    held_before_update: list[bool] = []
    report, publish = bridge.metrics, bridge.publish_tensors

    async def metrics(round: int, values: Mapping[str, float]) -> None:
        await report(round, values)
        committed.append(int(values["state_round"]))

    async def publish_tensors(*, kind: str, round: int, path: Path) -> None:
        if kind == "update":
            # Round r's update needs the state that starts round r (round r-1's) held; the
            # final round's its own too, since the trainers end once they have it.
            needed = {round, round + 1} if round == 2 else {round}
            held_before_update.append(round == 0 or needed <= set(committed))
        await publish(kind=kind, round=round, path=path)

    bridge.metrics = metrics  # type: ignore[method-assign]
    bridge.publish_tensors = publish_tensors  # type: ignore[method-assign, assignment]
    first = ParameterServer(bridge, options=ServerOptions(poll_s=0.02, linger_s=0.0, clock=FakeClock(50.0)))
    await first.start()
    digests = []
    for r in range(3):
        await _feed_round(first, theta0, r)
        assert first.core is not None
        digests.append(checkpoint.state_digest(first.core.outer.state_dict()))
    assert held_before_update == [True, True, True]
    assert [m[2]["state_round"] for m in network.metrics] == [1.0, 2.0, 3.0]
    blob = network.published[("ps", "ps-state", 2)].read_bytes()
    last = network.published[("ps", "ps-state", 3)].read_bytes()

    # Execute: another machine (empty work dir), with t2 replaced by t3 meanwhile, gets the state.
    elsewhere = _network(tmp_path / "b", vit_dir)
    elsewhere.trainer_ids = ("t0", "t1", "t3")
    elsewhere.start_rounds["ps"] = 2
    elsewhere.deliver("scheduler", "ps", "ps-state", 2, 0, blob)
    second = _server(elsewhere, FakeClock(50.0))
    core = await second.start()

    # Assert: the same θ_global and momentum bit for bit, the newcomer expected, the round republished.
    assert core.round_number == 2 and core.outer.steps == 2
    assert checkpoint.state_digest(core.outer.state_dict()) == digests[1]
    assert core.expected == {"t0", "t1", "t3"}
    assert set(elsewhere.published) == {("ps", "update", 1), ("ps", "global", 2)}

    # A server lost after its final update went out (the trainers ended with it) but before it
    # handed over the result is restored at the last round: it waits for no Δ, it writes the result.
    after = _network(tmp_path / "c", vit_dir)
    after.start_rounds["ps"] = 3
    after.deliver("scheduler", "ps", "ps-state", 3, 0, last)
    third = _server(after, FakeClock(50.0))
    assert await asyncio.wait_for(third.run(), timeout=60) == 0
    assert third.core is not None and third.core.round_number == 3
    assert checkpoint.state_digest(third.core.outer.state_dict()) == digests[2]
    assert after.results["ps"] == tmp_path / "c" / "ps" / "result"


@pytest.mark.parametrize("update_dtype", [common_pb2.DELTA_DTYPE_FP32, common_pb2.DELTA_DTYPE_INT8])
async def test_a_server_restored_one_round_behind_redoes_it_from_the_resent_deltas_then_sends_whole(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor], update_dtype: int
) -> None:
    # Prepare: a server completes rounds 0-2 and is lost while the scheduler still pulls round
    # 2's state: what it holds is the state after two rounds.
    network = _network(tmp_path / "a", vit_dir, rounds=6)
    network.spec.diloco.update_dtype = update_dtype  # type: ignore[assignment]
    lost = _server(network, FakeClock(50.0))
    await lost.start()
    for r in range(3):
        await _feed_round(lost, theta0, r)
    assert lost.core is not None
    after_three = lost.core.outer.state_dict()
    held = network.published[("ps", "ps-state", 2)].read_bytes()
    elsewhere = _network(tmp_path / "b", vit_dir, rounds=6)
    elsewhere.spec.diloco.update_dtype = update_dtype  # type: ignore[assignment]
    elsewhere.start_rounds["ps"] = 2
    elsewhere.deliver("scheduler", "ps", "ps-state", 2, 0, held)
    restored = _server(elsewhere, FakeClock(50.0))
    await restored.start()

    # Execute: a trainer's round-3 delta comes first (it holds round 2's update), then each
    # trainer sends its kept round-2 delta again, then the rest of round 3.
    early = _received("t0", 3, 7, _delta(theta0, 30))
    assert await restored.handle(early) is None
    for i, peer in enumerate(TRAINERS):
        await restored.handle(_received(peer, 2, SAMPLES[2][peer], _delta(theta0, 20 + i)))
    redone = await restored.tick()
    assert restored.core is not None
    redone_state = {
        part: {n: t.clone() for n, t in (restored.core.outer.state_dict()[part] or {}).items()}
        for part in ("params", "momentum_buffer")
    }
    for i, peer in enumerate(TRAINERS[1:]):
        await restored.handle(_received(peer, 3, 7, _delta(theta0, 31 + i)))
    after = await restored.tick()

    # Assert: round 2 redone bit for bit as the lost server did it; the early delta counted in
    # round 3; both updates whole (no base round), so every trainer holds the restored θ_global.
    # (θ_global exactly as an fp32 update sent it; with int8 updates up to the rounding a
    # change carried, which the whole update then sets every trainer to).
    assert redone is not None and redone.round_number == 2
    assert after_three["momentum_buffer"] is not None
    for name, momentum in after_three["momentum_buffer"].items():
        assert torch.equal(redone_state["momentum_buffer"][name], momentum)
        theta = redone_state["params"][name]
        if update_dtype == common_pb2.DELTA_DTYPE_FP32:
            assert torch.equal(theta, after_three["params"][name])
        else:
            assert torch.allclose(theta, after_three["params"][name], atol=1e-3)
    assert after is not None and after.round_number == 3 and after.contributors == TRAINERS
    for r in (2, 3):
        update = elsewhere.published[("ps", "update", r)].read_bytes()
        assert "update_base_round" not in read_metadata(update)


async def test_a_server_left_behind_serves_the_newer_state_its_scheduler_pushed_when_a_later_delta_comes(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    # Prepare: the job went on without this server (cut off past its lease) and reached round 2
    # on another one; its scheduler took this execution back and pushed the state of round 2.
    ahead = _network(tmp_path / "a", vit_dir)
    other = _server(ahead, FakeClock(50.0))
    await other.start()
    for r in range(2):
        await _feed_round(other, theta0, r)
    newer = ahead.published[("ps", "ps-state", 2)].read_bytes()
    network = _network(tmp_path / "b", vit_dir)
    behind = _server(network, FakeClock(50.0))
    await behind.start()
    await _feed_round(behind, theta0, 0)  # it completed round 0 alone, then lost touch
    early = _received("t0", 2, SAMPLES[0]["t0"], _delta(theta0, 99))
    assert await behind.handle(early) is None  # nothing pushed yet: a later round is refused

    # Execute: the pushed state arrives (an older one is ignored), then a delta for round 2.
    network.deliver("scheduler", "ps", "ps-state", 2, 0, newer)
    network.deliver("scheduler", "ps", "ps-state", 0, 0, ahead.published[("ps", "ps-state", 1)].read_bytes())
    receipt = await behind.handle(_received("t0", 2, 8, _delta(theta0, 20)))

    # Assert: it serves round 2 bit for bit as the server that got there, and takes the delta.
    assert receipt is not None and receipt.accepted
    assert behind.core is not None and other.core is not None
    assert behind.core.round_number == 2
    assert checkpoint.state_digest(behind.core.outer.state_dict()) == checkpoint.state_digest(
        other.core.outer.state_dict()
    )
    assert ("ps", "global", 2) in network.published
    assert checkpoint.load(tmp_path / "b" / "ps" / "ps-checkpoint").round_number == 2


async def test_a_replacement_server_without_a_pushed_state_fails(tmp_path: Path, vit_dir: Path) -> None:
    network = _network(tmp_path, vit_dir)
    network.start_rounds["ps"] = 3
    ps = ParameterServer(
        network.bridge("ps"),
        options=ServerOptions(poll_s=0.01, linger_s=0.0, restore_wait_s=0.1),
    )
    with pytest.raises(FailedPreconditionError, match="no state to resume round 3"):
        await ps.start()


async def test_trainers_that_left_are_not_waited_for_and_a_newcomer_joins_when_it_delivers(
    tmp_path: Path, vit_dir: Path, theta0: dict[str, torch.Tensor]
) -> None:
    network = _network(tmp_path, vit_dir)
    ps = _server(network, FakeClock(50.0))
    await ps.start()
    await ps.handle(_received("t0", 0, 10, _delta(theta0, 1)))
    await ps.handle(_received("t1", 0, 10, _delta(theta0, 2)))
    # t2 was lost and t9 already leased in its place, still starting (or: scaled, t2 left and
    # t9 joins): the round in flight is not held up for either.
    network.trainer_ids = ("t0", "t1", "t9")

    await ps._follow_trainers()  # the idle path

    assert ps.core is not None and ps.core.expected == {"t0", "t1"}
    update = await ps.tick()
    assert update is not None and update.contributors == ("t0", "t1")
    # t9 has started: it delivers for round 1 and joins
    early = await ps.handle(_received("t9", 1, 10, _delta(theta0, 3)))
    assert early is not None and early.accepted
    assert ps.core.expected == {"t0", "t1", "t9"}
