"""Parameter-server rounds: quorum, deadlines, late and duplicate deltas, and the outer arithmetic."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.diloco.outer import NesterovOuter
from hypha.diloco.rounds import (
    QuorumNotMetError,
    Round,
    RoundState,
    quorum_count,
)
from hypha.diloco.server_core import ParameterServerCore
from hypha.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)

SHAPES = {"w": (5, 4), "b": (4,)}
WORKERS = ("w1", "w2", "w3", "w4")
TIMEOUT_S = 10.0


def _tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES.items()}


def _core(
    quorum: float | int = 0.75, workers: tuple[str, ...] = WORKERS, **kwargs: float
) -> ParameterServerCore:
    outer = NesterovOuter(_tensors(0), lr=0.7, momentum=0.9)
    return ParameterServerCore(outer, workers, TIMEOUT_S, quorum, **kwargs)  # type: ignore[arg-type]


# ---- quorum and the Round state machine --------------------------------------------------


@pytest.mark.parametrize(
    ("quorum", "expected", "needed"),
    [(1.0, 4, 4), (0.75, 4, 3), (0.5, 3, 2), (0.01, 4, 1), (0.7, 10, 7), (2, 4, 2), (9, 4, 4), (1, 1, 1)],
)
def test_quorum_count(quorum: float | int, expected: int, needed: int) -> None:
    assert quorum_count(quorum, expected) == needed


@pytest.mark.parametrize("quorum", [0.0, 1.5, -1.0, 0, -2, True, "half"])
def test_invalid_quorum_is_refused(quorum: object) -> None:
    with pytest.raises(InvalidArgumentError):
        quorum_count(quorum, 4)  # type: ignore[arg-type]


def test_round_moves_collecting_aggregating_published() -> None:
    # Prepare
    rnd = Round(0, {"a", "b"}, deadline=100.0, quorum=1.0)
    rnd.add_delta("b", 3, _tensors(2), now=1.0)
    rnd.add_delta("a", 1, _tensors(1), now=2.0)
    assert rnd.ready(now=2.0)

    # Execute
    contributions = rnd.close()

    # Assert: worker-id order, not arrival order.
    assert [samples for _, samples in contributions] == [1, 3]
    assert rnd.state is RoundState.AGGREGATING
    rnd.publish()
    assert rnd.state is RoundState.PUBLISHED
    assert not rnd.ready(now=1000.0)


def test_round_refuses_illegal_transitions() -> None:
    rnd = Round(0, {"a"}, deadline=100.0, quorum=1.0)
    with pytest.raises(IllegalTransitionError, match="collecting -> published"):
        rnd.publish()
    rnd.close()
    with pytest.raises(IllegalTransitionError, match="aggregating -> aggregating"):
        rnd.close()
    rnd.fail("boom")
    with pytest.raises(IllegalTransitionError, match="failed -> published"):
        rnd.publish()


def test_round_drops_deltas_once_closed() -> None:
    rnd = Round(0, {"a", "b"}, deadline=5.0, quorum=1)
    rnd.add_delta("a", 1, _tensors(1), now=1.0)
    assert rnd.ready(now=5.0)
    rnd.close()
    receipt = rnd.add_delta("b", 1, _tensors(2), now=6.0)
    assert not receipt.accepted and "late" in receipt.reason


# ---- the reference computation -------------------------------------------------------------


def test_rounds_equal_torch_sgd_nesterov_on_the_sample_weighted_average_delta() -> None:
    """3 workers with unequal samples, 4 rounds, against torch.optim.SGD(nesterov=True)."""
    # Prepare
    lr, momentum = 0.7, 0.9
    init = _tensors(0)
    workers = {"alice": 100, "bob": 250, "carol": 37}
    core = ParameterServerCore(NesterovOuter(init, lr, momentum), workers, TIMEOUT_S, 1.0)
    ref = {name: torch.nn.Parameter(t.clone()) for name, t in init.items()}
    ref_opt = torch.optim.SGD(ref.values(), lr=lr, momentum=momentum, nesterov=True)
    theta = {name: t.clone() for name, t in init.items()}  # what every trainer holds
    now = 0.0

    for rnd in range(4):
        deltas = {}
        for i, (worker, samples) in enumerate(workers.items()):
            local = {n: t + 0.01 * _tensors(1000 * rnd + i)[n] for n, t in theta.items()}  # inner steps
            deltas[worker] = ({n: local[n] - theta[n] for n in theta}, samples)

        # Execute: arrivals in reverse order, then completion.
        for worker, (delta, samples) in reversed(deltas.items()):
            now += 1.0
            assert core.add_delta(worker, rnd, samples, delta, now).accepted
        update = core.maybe_complete(now)

        # Reference: grad = -(sum_i samples_i * delta_i / sum_i samples_i), one SGD step.
        total = sum(workers.values())
        for name, p in ref.items():
            avg = sum(d[name] * (s / total) for d, s in deltas.values())
            assert isinstance(avg, torch.Tensor)
            p.grad = -avg
        ref_opt.step()

        # Assert
        assert update is not None and update.round_number == rnd and update.next_round == rnd + 1
        assert update.contributors == ("alice", "bob", "carol") and update.missing == ()
        assert update.samples == total
        buffer = core.outer.momentum_buffer()
        assert buffer is not None
        for name, p in ref.items():
            torch.testing.assert_close(update.params[name], p.detach())
            torch.testing.assert_close(buffer[name], ref_opt.state[p]["momentum_buffer"])
        theta = {n: t.clone() for n, t in update.params.items()}
        assert core.round_number == rnd + 1


def test_aggregation_does_not_depend_on_arrival_order() -> None:
    # Prepare: two huge deltas that cancel and two tiny ones, so that float sums taken in
    # another order round differently (the tiny ones vanish or survive).
    huge = _tensors(10, 1e6)
    tiny = [_tensors(11, 1e-3), _tensors(12, 1e-3)]
    deltas = {
        "w1": (huge, 10),
        "w2": (tiny[0], 10),
        "w3": ({n: -t for n, t in huge.items()}, 10),
        "w4": (tiny[1], 10),
    }
    cores = [_core(1.0), _core(1.0)]

    # Execute
    for core, order in zip(cores, [WORKERS, tuple(reversed(WORKERS))], strict=True):
        for t, worker in enumerate(order):
            core.add_delta(worker, 0, deltas[worker][1], deltas[worker][0], now=float(t))
    updates = [core.maybe_complete(now=10.0) for core in cores]

    # Assert: bit-identical.
    assert updates[0] is not None and updates[1] is not None
    for name in SHAPES:
        assert torch.equal(updates[0].params[name], updates[1].params[name])


# ---- deadlines, quorum, late and duplicate deltas ---------------------------------------------


def test_quorum_completes_at_the_deadline_and_the_missing_workers_late_delta_is_dropped() -> None:
    # Prepare: 4 workers, quorum 3; three arrive, the deadline counts from the first.
    core = _core(0.75)
    for t, worker in enumerate(WORKERS[:3]):
        assert core.add_delta(worker, 0, 10, _tensors(t, 0.01), now=100.0 + t).accepted

    # Execute / Assert: not before the deadline, at the deadline yes.
    assert core.current_round.deadline == 100.0 + TIMEOUT_S
    assert core.maybe_complete(now=109.9) is None
    update = core.maybe_complete(now=110.0)
    assert update is not None
    assert update.contributors == ("w1", "w2", "w3")
    assert update.missing == ("w4",)

    late = core.add_delta("w4", 0, 10, _tensors(9, 0.01), now=111.0)
    assert not late.accepted
    assert "late" in late.reason
    assert core.round_number == 1
    assert core.current_round.arrived == frozenset()
    # The slow worker is still part of the job: it delivers for the next round.
    assert core.round_for("w4") == 1
    assert core.add_delta("w4", 1, 10, _tensors(9, 0.01), now=112.0).accepted


def test_everyone_arriving_completes_before_the_deadline() -> None:
    core = _core(0.5)
    for t, worker in enumerate(WORKERS):
        assert core.add_delta(worker, 0, 10, _tensors(t, 0.01), now=float(t)).accepted
    update = core.maybe_complete(now=4.0)
    assert update is not None
    assert update.contributors == tuple(sorted(WORKERS)) and update.missing == ()
    assert core.round_number == 1


def test_no_deadline_before_the_first_delta() -> None:
    core = _core(0.25)
    assert core.current_round.deadline == math.inf
    assert core.maybe_complete(now=1e9) is None
    assert not core.stalled(now=1e9)


def test_deadline_without_quorum_extends_the_round_until_quorum() -> None:
    # Prepare
    core = _core(0.75)
    core.add_delta("w1", 0, 10, _tensors(1, 0.01), now=0.0)
    core.add_delta("w2", 0, 10, _tensors(2, 0.01), now=1.0)

    # Execute / Assert: stalled, not failed, and a straggler after the deadline still counts.
    assert core.maybe_complete(now=50.0) is None
    assert core.stalled(now=50.0)
    assert core.add_delta("w3", 0, 10, _tensors(3, 0.01), now=60.0).accepted
    assert not core.stalled(now=60.0)
    update = core.maybe_complete(now=60.0)
    assert update is not None and update.missing == ("w4",)


def test_give_up_after_fails_a_stalled_round() -> None:
    # Prepare
    core = _core(0.75, give_up_after_s=30.0)
    core.add_delta("w1", 0, 10, _tensors(1, 0.01), now=0.0)

    # Execute / Assert
    assert core.maybe_complete(now=39.9) is None
    with pytest.raises(QuorumNotMetError, match="w2"):
        core.maybe_complete(now=40.0)
    assert core.current_round.state is RoundState.FAILED
    with pytest.raises(QuorumNotMetError):
        core.maybe_complete(now=41.0)
    assert not core.add_delta("w2", 0, 10, _tensors(2, 0.01), now=41.0).accepted


def test_duplicate_delta_is_rejected() -> None:
    core = _core()
    core.add_delta("w1", 0, 10, _tensors(1, 0.01), now=0.0)
    with pytest.raises(AlreadyExistsError, match="w1"):
        core.add_delta("w1", 0, 10, _tensors(2, 0.01), now=1.0)
    assert core.current_round.samples == 10


def test_unknown_worker_is_denied() -> None:
    with pytest.raises(PermissionDeniedError, match="mallory"):
        _core().add_delta("mallory", 0, 10, _tensors(1), now=0.0)


def test_delta_for_a_future_round_is_refused() -> None:
    with pytest.raises(FailedPreconditionError, match="not started"):
        _core().add_delta("w1", 1, 10, _tensors(1), now=0.0)


@pytest.mark.parametrize("samples", [0, -5])
def test_delta_must_cover_samples(samples: int) -> None:
    with pytest.raises(InvalidArgumentError, match="samples"):
        _core().add_delta("w1", 0, samples, _tensors(1), now=0.0)


def test_delta_of_the_wrong_shape_is_refused_naming_the_tensor() -> None:
    delta = _tensors(1)
    delta["w"] = torch.zeros(4, 5)
    core = _core()
    with pytest.raises(InvalidArgumentError, match="'w'"):
        core.add_delta("w1", 0, 10, delta, now=0.0)
    assert core.current_round.arrived == frozenset()


def _poisoned(seed: int, name: str, value: float) -> dict[str, torch.Tensor]:
    delta = _tensors(seed, 0.01)
    delta[name].view(-1)[2] = value
    return delta


def test_non_finite_deltas_are_refused_when_the_round_aggregates_and_their_workers_may_resend() -> None:
    # Prepare: everyone must deliver; w2 sends a NaN, w3 an infinity.
    core, clean = _core(1.0), _core(1.0)
    theta_before = {n: t.clone() for n, t in core.outer.parameters().items()}
    for t, worker in enumerate(WORKERS):
        clean.add_delta(worker, 0, 10 + t, _tensors(t, 0.01), now=0.0)
    core.add_delta("w1", 0, 10, _tensors(0, 0.01), now=0.0)
    core.add_delta("w2", 0, 11, _poisoned(1, "b", float("nan")), now=0.0)
    core.add_delta("w3", 0, 12, _poisoned(2, "w", float("-inf")), now=0.0)
    core.add_delta("w4", 0, 13, _tensors(3, 0.01), now=0.0)

    # Execute
    update = core.maybe_complete(now=1.0)

    # Assert: only the culprits are refused, θ_global untouched, the round collects again.
    assert update is None
    assert core.current_round.state is RoundState.COLLECTING
    assert core.current_round.arrived == {"w1", "w4"}
    assert [(r.round_number, r.worker) for r in core.refused] == [(0, "w2"), (0, "w3")]
    assert "'b'" in core.refused[0].reason and "NaN" in core.refused[0].reason
    assert "'w'" in core.refused[1].reason
    assert core.outer.steps == 0
    assert all(torch.equal(core.outer.parameters()[n], t) for n, t in theta_before.items())

    # The refused workers send good deltas: the round is exactly the clean one.
    core.add_delta("w2", 0, 11, _tensors(1, 0.01), now=2.0)
    core.add_delta("w3", 0, 12, _tensors(2, 0.01), now=2.0)
    done, expected = core.maybe_complete(now=3.0), clean.maybe_complete(now=3.0)
    assert done is not None and expected is not None
    assert done.contributors == WORKERS and done.samples == expected.samples
    assert all(torch.equal(done.params[n], expected.params[n]) for n in SHAPES)


def test_a_refused_delta_leaves_a_round_that_still_has_quorum_to_complete_without_it() -> None:
    # Prepare: quorum 3 of 4, the deadline has passed, w4's delta holds +inf.
    core, clean = _core(0.75), _core(0.75)
    for t, worker in enumerate(WORKERS[:3]):
        core.add_delta(worker, 0, 10, _tensors(t, 0.01), now=0.0)
        clean.add_delta(worker, 0, 10, _tensors(t, 0.01), now=0.0)
    core.add_delta("w4", 0, 10, _poisoned(3, "b", float("inf")), now=0.0)

    # Execute
    update = core.maybe_complete(now=TIMEOUT_S + 1)

    # Assert
    expected = clean.maybe_complete(now=TIMEOUT_S + 1)
    assert update is not None and expected is not None
    assert update.contributors == ("w1", "w2", "w3") and update.missing == ("w4",)
    assert [r.worker for r in core.refused] == ["w4"]
    assert all(torch.equal(update.params[n], expected.params[n]) for n in SHAPES)
    late = core.add_delta("w4", 0, 10, _tensors(3, 0.01), now=TIMEOUT_S + 2)
    assert not late.accepted and "late" in late.reason


def test_the_finite_check_can_be_turned_off() -> None:
    core = _core(1, ("w1",), reject_non_finite=False)
    core.add_delta("w1", 0, 10, _poisoned(1, "b", float("nan")), now=0.0)

    update = core.maybe_complete(now=0.0)

    assert update is not None and not list(core.refused)
    assert bool(torch.isnan(update.params["b"]).any())


# ---- replacement and late joiners ------------------------------------------------------------


def test_replacement_completes_a_stalled_round_and_the_replaced_worker_is_dropped() -> None:
    # Prepare: quorum of all four, w4 lost.
    core = _core(1.0)
    for t, worker in enumerate(WORKERS[:3]):
        core.add_delta(worker, 0, 10, _tensors(t, 0.01), now=float(t))
    assert core.stalled(now=100.0)

    # Execute
    joined_now = core.replace_worker("w4", "w5")

    # Assert
    assert joined_now
    assert core.round_for("w5") == 0
    dropped = core.add_delta("w4", 0, 10, _tensors(4, 0.01), now=101.0)
    assert not dropped.accepted and "replaced" in dropped.reason
    assert core.add_delta("w5", 0, 10, _tensors(5, 0.01), now=102.0).accepted
    update = core.maybe_complete(now=102.0)
    assert update is not None and update.contributors == ("w1", "w2", "w3", "w5")
    assert core.expected == frozenset({"w1", "w2", "w3", "w5"})
    assert core.current_round.expected == frozenset({"w1", "w2", "w3", "w5"})
    with pytest.raises(PermissionDeniedError):
        core.add_delta("w4", 1, 10, _tensors(4, 0.01), now=103.0)


def test_replacement_after_the_old_worker_delivered_joins_next_round() -> None:
    # Prepare
    core = _core(1.0)
    core.add_delta("w1", 0, 10, _tensors(1, 0.01), now=0.0)

    # Execute
    joined_now = core.replace_worker("w1", "w9")

    # Assert: w1's delta still counts this round; w9 starts with the next one.
    assert not joined_now
    assert core.round_for("w9") == 1
    early = core.add_delta("w9", 0, 10, _tensors(9, 0.01), now=1.0)
    assert not early.accepted and "round 1" in early.reason
    for t, worker in enumerate(WORKERS[1:]):
        core.add_delta(worker, 0, 10, _tensors(t, 0.01), now=2.0 + t)
    update = core.maybe_complete(now=5.0)
    assert update is not None and "w1" in update.contributors
    assert core.current_round.expected == frozenset({"w9", "w2", "w3", "w4"})


def test_replace_worker_refuses_unknown_and_duplicate_ids() -> None:
    core = _core()
    with pytest.raises(NotFoundError):
        core.replace_worker("nobody", "w9")
    with pytest.raises(AlreadyExistsError):
        core.replace_worker("w1", "w2")


def test_global_state_and_updates_are_snapshots() -> None:
    # Prepare
    core = _core(1.0, workers=("w1",))
    core.add_delta("w1", 0, 10, _tensors(1, 0.01), now=0.0)
    update = core.maybe_complete(now=0.0)
    assert update is not None

    # Execute
    state = core.global_state()
    state.params["w"].add_(100.0)
    update.params["b"].add_(100.0)

    # Assert
    assert state.round_number == 1 and state.outer_steps == 1
    live = core.outer.parameters()
    assert not torch.equal(live["w"], state.params["w"])
    assert not torch.equal(live["b"], update.params["b"])


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_round_timeout_must_be_positive(bad: float) -> None:
    with pytest.raises(InvalidArgumentError):
        ParameterServerCore(NesterovOuter(_tensors(0), 0.7, 0.9), WORKERS, bad, 0.5)


# ---- a property: whatever the arrival pattern, the rules hold ----------------------------------


@settings(max_examples=40, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from([*WORKERS, "x"]), st.integers(0, 2), st.floats(0.0, 5.0)),
        max_size=25,
    ),
    quorum=st.sampled_from([0.5, 0.75, 1.0, 1, 3]),
)
def test_rounds_never_count_a_worker_twice_nor_complete_without_quorum(
    events: list[tuple[str, int, float]], quorum: float | int
) -> None:
    core = _core(quorum)
    delta = _tensors(1, 0.01)
    now = 0.0
    for worker, round_offset, dt in events:
        now += dt
        target = max(0, core.round_number - 1 + round_offset)  # past, current or next
        before = set(core.current_round.arrived)
        current_number = core.round_number
        try:
            receipt = core.add_delta(worker, target, 1, delta, now)
        except (AlreadyExistsError, PermissionDeniedError, FailedPreconditionError):
            assert worker in before or worker == "x" or target > current_number
            continue
        if receipt.accepted:
            assert target == current_number and worker not in before
        else:
            assert target < current_number
        rnd = core.current_round
        update = core.maybe_complete(now)
        if update is not None:
            assert len(update.contributors) >= quorum_count(quorum, len(WORKERS))
            assert len(set(update.contributors)) == len(update.contributors)
            assert update.contributors == tuple(sorted(rnd.expected - set(update.missing)))
            assert update.samples == len(update.contributors)
            assert now >= rnd.deadline or not update.missing


# ---- elastic membership (``hypha scale``) ------------------------------------------------------


def test_a_worker_added_mid_round_joins_with_the_next_round() -> None:
    core = _core(1.0, ("w1",))
    core.add_delta("w1", 0, 10, _tensors(1, 0.01), now=0.0)

    added, removed = core.set_workers(["w1", "w2"])

    assert (added, removed) == (["w2"], [])
    early = core.add_delta("w2", 0, 10, _tensors(2, 0.01), now=0.5)
    assert not early.accepted and "round 1" in early.reason
    update = core.maybe_complete(now=1.0)
    assert update is not None and update.contributors == ("w1",)
    assert core.current_round.expected == frozenset({"w1", "w2"})
    assert core.maybe_complete(now=2.0) is None  # round 1 waits for both (quorum 1.0)


def test_a_removed_worker_is_not_waited_for_but_its_delivered_delta_counts() -> None:
    # Prepare: all four expected (quorum 1.0); w4 delivered, w3 did not.
    core = _core(1.0)
    core.add_delta("w4", 0, 30, _tensors(4, 0.01), now=0.0)
    for worker in ("w1", "w2"):
        core.add_delta(worker, 0, 10, _tensors(1, 0.01), now=0.0)

    # Execute: the job shrinks to w1, w2.
    added, removed = core.set_workers(["w1", "w2"])

    # Assert: the round closes at once; w4's work (30 samples) is kept, nobody waits for w3.
    assert (added, removed) == ([], ["w3", "w4"])
    update = core.maybe_complete(now=0.1)
    assert update is not None and update.contributors == ("w1", "w2", "w4") and update.samples == 50
    assert core.current_round.expected == frozenset({"w1", "w2"})
    with pytest.raises(PermissionDeniedError):
        core.add_delta("w3", 1, 10, _tensors(3, 0.01), now=1.0)


def test_set_workers_pairs_the_lost_with_newcomers_first_and_needs_someone() -> None:
    core = _core(1.0)
    assert core.set_workers(["w1", "w2", "w3", "w5", "w6"]) == (["w6"], [])
    assert core.round_for("w5") == 0  # took w4's place in the current round
    assert core.set_workers(["w1", "w2", "w3", "w5", "w6", "w7"], delivering="w7") == (["w7"], [])
    assert core.round_for("w7") == 0 and core.round_for("w6") == 1
    with pytest.raises(InvalidArgumentError):
        core.set_workers([])
