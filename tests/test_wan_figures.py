"""``benchmarks/wan.py``'s top-level figures over data orders, from made-up measurements: data
parallel's time to target is the median over its orders' curves, a curve that never reached the
target counts as longer than any, and each order is compared with ours' run on the same order."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _wan_figures import median_or_none, summary


def _curve(reached_at: int | None, last: int = 400) -> dict[str, float]:
    return {
        str(step): 0.95 if reached_at is not None and step >= reached_at else 0.1
        for step in range(50, last + 1, 50)
    }


def _rates(curves: dict[str, dict[str, float]], ours_20: list[float | None]) -> dict[str, dict[str, Any]]:
    return {
        "unlimited": {"ddp_step_s": 0.1, "ddp_curves": curves},
        "20mbit": {
            "ddp_step_s": 1.0,
            "ours_time_to_target_s": {"default": median_or_none(ours_20)},
            "ours_time_to_target_runs_s": {"default": ours_20},
        },
    }


def test_data_parallel_takes_the_median_order_and_each_order_meets_ours_on_the_same_rows() -> None:
    # Order 0 reaches 90 % at step 100, order 1 at 300, order 2 not within its 400 steps.
    rates = _rates({"0": _curve(100), "1": _curve(300), "2": _curve(None)}, [20.0, 25.0, None])
    top = summary(rates, 0.9, "unlimited")
    assert top["ddp_steps_to_target_runs"] == [100, 300, None]
    assert top["ddp_steps_to_target"] == 300
    assert rates["unlimited"]["ddp_time_to_target_s"] == pytest.approx(30.0)
    assert rates["20mbit"]["ddp_time_to_target_s"] == pytest.approx(300.0)
    assert rates["20mbit"]["ddp_time_to_target_runs_s"] == [100.0, 300.0, None]
    # Ours' median (25 s: the miss counts as the longest) against data parallel's 300 s.
    assert top["ddp_over_ours_20mbit"] == pytest.approx(12.0)
    # Order by order: 100/20, 300/25, and nothing where either side never got there.
    assert top["ddp_over_ours_20mbit_runs"] == [pytest.approx(5.0), pytest.approx(12.0), None]
    assert "per data order (3, the median over them)" in top["ddp_time_to_target_method"]


def test_two_orders_of_three_that_never_reach_the_target_leave_no_time_to_target() -> None:
    rates = _rates({"0": _curve(100), "1": _curve(None), "2": _curve(None)}, [20.0, None, None])
    top = summary(rates, 0.9, "unlimited")
    assert top["ddp_steps_to_target"] is None
    assert rates["20mbit"]["ddp_time_to_target_s"] is None and top["ddp_over_ours_20mbit"] is None


def test_without_curves_nothing_is_guessed() -> None:
    rates = _rates({}, [20.0])
    top = summary(rates, 0.9, "unlimited")
    assert top["ddp_steps_to_target"] is None and top["ddp_steps_to_target_runs"] == []
    assert top["ddp_time_to_target_method"].startswith("not measured")
    assert rates["20mbit"]["ddp_time_to_target_s"] is None
