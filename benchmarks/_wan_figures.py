"""``benchmarks/wan.py``'s figures across rates: data parallel's time to target, the issue's
top-level ratios (issue 30, "Figures"), and the table a person reads.

A figure whose parts were not measured (a rate not run, ``--quick``, a run that never reached
the target) is ``None``, never a guess.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

#: Rows of data per data-parallel step and rank (the demo's batch).
BATCH = 64
#: The job settings the top-level figures are about (the job file's defaults).
DEFAULT = "default"


def _ours(rates: Mapping[str, Mapping[str, Any]], rate: str, key: str, variant: str = DEFAULT) -> Any:
    value = rates.get(rate, {}).get(key)
    return value.get(variant) if isinstance(value, Mapping) else None


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top is not None and bottom else None


def ddp_steps_to_target(curve: Mapping[str, float], target: float) -> int | None:
    reached = [int(step) for step, accuracy in curve.items() if accuracy >= target]
    return min(reached) if reached else None


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median, a missing value counting as infinite (a run that never reached the target
    took longer than any that did): None when that is where the median falls, or no values."""
    if not values:
        return None
    middle = statistics.median(math.inf if value is None else value for value in values)
    return None if math.isinf(middle) else round(middle, 4)


def summary(rates: dict[str, dict[str, Any]], target: float, fastest: str) -> dict[str, Any]:
    """Adds ``ddp_time_to_target_s`` (the median over the data orders) and
    ``ddp_time_to_target_runs_s`` (per order) to each rate's figures; the top-level figures."""
    curves: Mapping[str, Mapping[str, float]] = rates.get(fastest, {}).get("ddp_curves") or {}
    per_order = [ddp_steps_to_target(curves[order], target) for order in sorted(curves, key=int)]
    steps = median_or_none(per_order)
    for row in rates.values():
        row["ddp_time_to_target_s"] = round(steps * row["ddp_step_s"], 1) if steps is not None else None
        row["ddp_time_to_target_runs_s"] = [
            round(n * row["ddp_step_s"], 1) if n is not None else None for n in per_order
        ]
    if not curves:
        method = "not measured (no accuracy curve for data parallel: --quick or --curve-steps 0)"
    else:
        every = min(int(step) for curve in curves.values() for step in curve)
        method = (
            f"steps to {target:.0%} held-out exact match, scored every {every} steps of one run "
            f"per data order ({len(curves)}, the median over them) on the {fastest} link (the link "
            "changes data parallel's time, not its arithmetic), times ddp_step_s measured at each rate"
        )

    def to_target(rate: str) -> tuple[float | None, float | None]:
        return rates.get(rate, {}).get("ddp_time_to_target_s"), _ours(rates, rate, "ours_time_to_target_s")

    ddp_20, ours_20 = to_target("20mbit")
    ddp_unlimited, ours_unlimited = to_target("unlimited")
    return {
        "ddp_steps_to_target": steps,
        "ddp_steps_to_target_runs": per_order,
        "ddp_time_to_target_method": method,
        "ddp_over_ours_20mbit": _ratio(ddp_20, ours_20),
        # Order by order (ours' run r and data parallel's curve r trained on the same rows).
        "ddp_over_ours_20mbit_runs": _paired(rates.get("20mbit", {})),
        "ours_20mbit_over_unlimited": _ratio(ours_20, ours_unlimited),
        "ours_over_ddp_unlimited": _ratio(ours_unlimited, ddp_unlimited),
        "utilization_100mbit": _ours(rates, "100mbit", "utilization"),
        "utilization_20mbit": _ours(rates, "20mbit", "utilization"),
        "bytes_ratio": bytes_ratio(rates, "20mbit", "fp32"),
        "bytes_ratio_int8": bytes_ratio(rates, "20mbit", "int8"),
        # The defaults compress both ways too (and overlap, which moves no byte).
        "bytes_ratio_compressed": bytes_ratio(rates, "20mbit", "compressed")
        or bytes_ratio(rates, "20mbit", DEFAULT),
        "bytes_ratio_is": (
            "at 20mbit: data parallel's bytes per rank (veth counters, both directions) at equal "
            "samples ÷ ours per trainer (its link's counters over the job: Δ up, θ_global and "
            "data slices down, and the control traffic)"
        ),
    }


def _paired(row: Mapping[str, Any]) -> list[float | None]:
    ddp = row.get("ddp_time_to_target_runs_s") or []
    ours = (row.get("ours_time_to_target_runs_s") or {}).get(DEFAULT) or []
    return [_ratio(d, o) for d, o in zip(ddp, ours, strict=False)]


def bytes_ratio(rates: Mapping[str, Mapping[str, Any]], rate: str, variant: str) -> float | None:
    trainer = _ours(rates, rate, "ours_trainer_bytes", variant)
    samples = _ours(rates, rate, "ours_samples_per_trainer", variant)
    per_step = rates.get(rate, {}).get("ddp_bytes_per_step")
    if trainer is None or samples is None or per_step is None:
        return None
    return _ratio(per_step * samples / BATCH, trainer)


def table(rates: Mapping[str, Mapping[str, Any]], steps: int, target: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    first = next(iter(rates.values()))["ddp_step_s"]
    ddp = Table(title=f"data parallel, 2 ranks over capped links ({steps} timed steps each)")
    for column in ("link (each site, both ways)", "step", "x first", "MB per step per rank", "to target"):
        ddp.add_column(column, justify="left" if column.startswith("link") else "right")
    for rate, row in rates.items():
        reached = row.get("ddp_time_to_target_s")
        ddp.add_row(
            rate,
            f"{row['ddp_step_s'] * 1000:,.0f} ms",
            f"{row['ddp_step_s'] / first:.1f}",
            f"{row['ddp_bytes_per_step'] / 1e6:.2f}",
            f"{reached:,.0f} s" if reached is not None else "-",
        )
    console.print(ddp)
    ours = Table(title=f"ours: the demo's DiLoCo job, held-out exact match to {target:.0%}")
    columns = ("link", "variant", "to target", "accuracy", "job", "round", "MB per trainer", "util.", "lag")
    for column in columns:
        ours.add_column(column, justify="left" if column in ("link", "variant") else "right")
    for rate, row in rates.items():
        for variant, seconds in (row.get("ours_time_to_target_s") or {}).items():
            accuracy = row["ours_accuracy"][variant]
            round_s = row["ours_round_s"][variant]
            util = row["utilization"][variant]
            lag = (row.get("ours_update_lag_batches") or {}).get(variant)
            ours.add_row(
                rate,
                variant,
                f"{seconds:,.0f} s" if seconds is not None else "-",
                f"{accuracy:.1%}" if accuracy is not None else "-",
                f"{row['ours_seconds'][variant]:,.0f} s",
                f"{round_s:.1f} s" if round_s is not None else "-",
                _mb(row["ours_trainer_bytes"][variant]),
                f"{util:.2f}" if util is not None else "-",
                f"{lag:g} batches" if lag is not None else "-",
            )
    console.print(ours)


def _mb(value: float | None) -> str:
    return f"{value / 1e6:,.1f}" if value is not None else "-"
