"""The outer optimizer: sample-weighted averaging and Nesterov steps equal to torch's SGD."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hypha.diloco.outer import NesterovOuter, NonFiniteDeltaError, weighted_average
from hypha.errors import InvalidArgumentError

SHAPES = {"w": (4, 3), "b": (3,), "scale": ()}


def _random_state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES.items()}


def test_weighted_average_weights_by_samples() -> None:
    # Prepare
    deltas = [(_random_state(i), samples) for i, samples in enumerate([10, 30, 60])]

    # Execute
    avg = weighted_average(deltas)

    # Assert
    for name in SHAPES:
        expected = 0.1 * deltas[0][0][name] + 0.3 * deltas[1][0][name] + 0.6 * deltas[2][0][name]
        torch.testing.assert_close(avg[name], expected)
        assert avg[name].dtype == torch.float32


def test_weighted_average_ignores_zero_sample_deltas_and_keeps_inputs() -> None:
    # Prepare
    a, b = _random_state(1), _random_state(2)
    a_before = {k: v.clone() for k, v in a.items()}

    # Execute
    avg = weighted_average([(a, 5), (b, 0)])

    # Assert
    for name in SHAPES:
        torch.testing.assert_close(avg[name], a[name], rtol=0, atol=0)
        assert torch.equal(a[name], a_before[name])
        assert avg[name].data_ptr() != a[name].data_ptr()


def test_weighted_average_sums_half_precision_deltas_in_fp32() -> None:
    deltas = [({"w": torch.full((4,), 1.0, dtype=torch.bfloat16)}, 1), ({"w": torch.full((4,), 2.0)}, 3)]
    avg = weighted_average(deltas)
    assert avg["w"].dtype == torch.float32
    torch.testing.assert_close(avg["w"], torch.full((4,), 1.75))


@pytest.mark.parametrize(
    ("deltas", "needle"),
    [
        ([], "no deltas"),
        ([({"w": torch.ones(2)}, 0), ({"w": torch.ones(2)}, 0)], "zero samples"),
        ([({"w": torch.ones(2)}, -1)], "non-negative"),
        ([({"w": torch.ones(2)}, 1), ({"w": torch.ones(3)}, 1)], "'w'"),
        ([({"w": torch.ones(2)}, 1), ({"v": torch.ones(2)}, 1)], "'w'"),
        ([({"w": torch.ones(2, dtype=torch.int64)}, 1)], "floating"),
    ],
)
def test_weighted_average_refuses_bad_input(
    deltas: list[tuple[dict[str, torch.Tensor], int]], needle: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=needle):
        weighted_average(deltas)


def _torch_reference(
    init: dict[str, torch.Tensor], lr: float, momentum: float
) -> tuple[dict[str, torch.nn.Parameter], torch.optim.SGD]:
    params = {name: torch.nn.Parameter(t.clone()) for name, t in init.items()}
    return params, torch.optim.SGD(params.values(), lr=lr, momentum=momentum, nesterov=True)


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.5), (0.1, 0.99)])
def test_steps_equal_torch_sgd_nesterov_with_negated_delta_as_grad(lr: float, momentum: float) -> None:
    # Prepare
    init = _random_state(0)
    outer = NesterovOuter(init, lr=lr, momentum=momentum)
    ref_params, ref_opt = _torch_reference(init, lr, momentum)

    for step in range(5):
        delta = _random_state(100 + step, scale=0.01)

        # Execute
        new_global = outer.step(delta)
        for name, p in ref_params.items():
            p.grad = -delta[name]
        ref_opt.step()

        # Assert
        for name, p in ref_params.items():
            torch.testing.assert_close(new_global[name], p.detach())
            torch.testing.assert_close(outer.momentum_buffer()[name], ref_opt.state[p]["momentum_buffer"])  # type: ignore[index]
    assert outer.steps == 5


def test_zero_momentum_is_plain_delta_averaging() -> None:
    init, delta = _random_state(0), _random_state(1)
    outer = NesterovOuter(init, lr=1.0, momentum=0.0)
    new_global = outer.step(delta)
    for name in SHAPES:
        torch.testing.assert_close(new_global[name], init[name] + delta[name])


def test_outer_copies_its_parameters_and_leaves_the_delta_alone() -> None:
    # Prepare
    init, delta = _random_state(0), _random_state(1)
    init_before = {k: v.clone() for k, v in init.items()}
    delta_before = {k: v.clone() for k, v in delta.items()}
    outer = NesterovOuter(init, lr=0.7, momentum=0.9)

    # Execute
    outer.step(delta)

    # Assert
    for name in SHAPES:
        assert torch.equal(init[name], init_before[name])
        assert torch.equal(delta[name], delta_before[name])
        assert not torch.equal(outer.parameters()[name], init[name])


def test_momentum_buffer_is_absent_before_the_first_step() -> None:
    assert NesterovOuter(_random_state(0), lr=0.7, momentum=0.9).momentum_buffer() is None


def test_state_dict_round_trip_continues_identically() -> None:
    # Prepare: two steps, then copy the state into a fresh optimizer.
    outer = NesterovOuter(_random_state(0), lr=0.7, momentum=0.9)
    for i in range(2):
        outer.step(_random_state(10 + i, scale=0.01))
    state = outer.state_dict()
    resumed = NesterovOuter.from_state_dict(
        {
            "params": {k: v.clone() for k, v in state["params"].items()},
            "momentum_buffer": {k: v.clone() for k, v in (state["momentum_buffer"] or {}).items()},
            "lr": state["lr"],
            "momentum": state["momentum"],
            "steps": state["steps"],
        }
    )

    # Execute
    for i in range(3):
        delta = _random_state(20 + i, scale=0.01)
        a = outer.step(delta)
        b = resumed.step(delta)

        # Assert: bit-for-bit, not just close.
        for name in SHAPES:
            assert torch.equal(a[name], b[name])
    assert resumed.steps == outer.steps == 5


def test_load_state_dict_refuses_a_different_model() -> None:
    outer = NesterovOuter(_random_state(0), lr=0.7, momentum=0.9)
    other = NesterovOuter({"w": torch.ones(4, 4)}, lr=0.7, momentum=0.9)
    with pytest.raises(InvalidArgumentError, match="'b' is missing from the state"):
        outer.load_state_dict(other.state_dict())


def test_step_refuses_a_delta_for_a_different_model() -> None:
    outer = NesterovOuter(_random_state(0), lr=0.7, momentum=0.9)
    with pytest.raises(InvalidArgumentError, match="'w'"):
        outer.step({"w": torch.ones(3, 4), "b": torch.ones(3), "scale": torch.ones(())})


@pytest.mark.parametrize(
    ("lr", "momentum", "params"),
    [
        (0.0, 0.9, {"w": torch.ones(1)}),
        (0.7, 1.0, {"w": torch.ones(1)}),
        (0.7, -0.1, {"w": torch.ones(1)}),
        (0.7, 0.9, {}),
        (0.7, 0.9, {"ids": torch.ones(1, dtype=torch.int64)}),
    ],
)
def test_invalid_settings_are_refused(lr: float, momentum: float, params: dict[str, torch.Tensor]) -> None:
    with pytest.raises(InvalidArgumentError):
        NesterovOuter(params, lr=lr, momentum=momentum)


@settings(max_examples=30, deadline=None)
@given(samples=st.lists(st.integers(0, 1000), min_size=1, max_size=6).filter(lambda s: sum(s) > 0))
def test_average_of_identical_deltas_is_that_delta(samples: list[int]) -> None:
    delta = _random_state(3)
    avg = weighted_average([(delta, n) for n in samples])
    for name in SHAPES:
        torch.testing.assert_close(avg[name], delta[name])


def test_fused_step_average_is_bit_identical_to_step_of_the_average() -> None:
    # Prepare: three deltas (one bf16, one with zero samples, dicts in another order than θ)
    gen = torch.Generator().manual_seed(3)
    theta = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    deltas = [
        ({"b": torch.randn(5, generator=gen), "w": torch.randn(6, 5, generator=gen)}, 7),
        ({n: torch.randn(t.shape, generator=gen).to(torch.bfloat16) for n, t in theta.items()}, 3),
        ({n: torch.randn(t.shape, generator=gen) for n, t in theta.items()}, 0),
    ]
    kept = [{n: t.clone() for n, t in d.items()} for d, _ in deltas]
    fused, plain = NesterovOuter(theta, 0.7, 0.9), NesterovOuter(theta, 0.7, 0.9)

    # Execute: three rounds each way (the momentum buffer and the reused scratch both matter)
    for _ in range(3):
        fused.step_average(deltas)
        plain.step(weighted_average(deltas))

    # Check
    for name in theta:
        assert torch.equal(fused.parameters()[name], plain.parameters()[name])
        assert torch.equal(fused.momentum_buffer()[name], plain.momentum_buffer()[name])  # type: ignore[index]
    for (delta, _), before in zip(deltas, kept, strict=True):
        assert all(torch.equal(delta[n], before[n]) for n in before)


def test_step_average_names_the_non_finite_deltas_and_changes_nothing() -> None:
    # Prepare: one step taken (a momentum buffer exists), then a round where #1 and #3 are bad.
    gen = torch.Generator().manual_seed(5)
    theta = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(5, generator=gen)}
    outer = NesterovOuter(theta, 0.7, 0.9)
    outer.step_average([({n: torch.randn(t.shape, generator=gen) for n, t in theta.items()}, 1)])
    good = {n: torch.randn(t.shape, generator=gen) for n, t in theta.items()}
    nan = {n: t.clone() for n, t in good.items()}
    nan["w"][3, 1] = float("nan")
    inf = {n: t.clone() for n, t in good.items()}
    inf["b"][0] = float("-inf")
    params = {n: t.clone() for n, t in outer.parameters().items()}
    buffer = {n: t.clone() for n, t in outer.momentum_buffer().items()}  # type: ignore[union-attr]

    # Execute
    with pytest.raises(NonFiniteDeltaError) as caught:
        outer.step_average([(good, 3), (nan, 2), (good, 1), (inf, 4)], reject_non_finite=True)

    # Assert
    assert caught.value.culprits == {1: "w", 3: "b"}
    assert outer.steps == 1
    assert all(torch.equal(outer.parameters()[n], t) for n, t in params.items())
    assert all(torch.equal(outer.momentum_buffer()[n], t) for n, t in buffer.items())  # type: ignore[index]


def test_a_finite_sum_that_overflows_is_not_mistaken_for_a_bad_delta() -> None:
    # Every element is finite, but the sums the check takes overflow to infinity.
    theta = {"w": torch.zeros(4)}
    huge = {"w": torch.full((4,), 3e38)}
    checked, plain = NesterovOuter(theta, 0.7, 0.9), NesterovOuter(theta, 0.7, 0.9)

    checked.step_average([(huge, 1), (huge, 1)], reject_non_finite=True)
    plain.step_average([(huge, 1), (huge, 1)])

    assert checked.steps == 1
    assert torch.equal(checked.parameters()["w"], plain.parameters()["w"])
