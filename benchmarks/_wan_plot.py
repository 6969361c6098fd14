"""``benchmarks/wan.py --plot``: time to the target against link rate, ours and data parallel,
both axes logarithmic (issue 30, "Figures").

Drawn on matplotlib's object API with the Agg canvas, as ``hypha.client.plot`` is: no display,
no global figure registry. ``unlimited`` has no rate: it is drawn 10x right of the fastest
capped rate (10 Gbit/s when none is capped), with its own tick label. A point whose run never
reached the target, or was not measured, is left out.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hypha.fsutil import write_atomic
from hypha.testing.wan import parse_rate


def _positions(rates: list[str]) -> dict[str, float]:
    """Rate -> Mbit/s on the x axis."""
    capped = {rate: bits / 1e6 for rate in rates if (bits := parse_rate(rate)) is not None}
    unlimited = 10 * max(capped.values()) if capped else 10_000.0
    return {rate: capped.get(rate, unlimited) for rate in rates}


def time_to_target_plot(rates: Mapping[str, Mapping[str, Any]], path: Path, target: float) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 5.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots()
    x = _positions(list(rates))
    series: dict[str, dict[str, float]] = {"data parallel": {}}
    for rate, row in rates.items():
        if row.get("ddp_time_to_target_s") is not None:
            series["data parallel"][rate] = row["ddp_time_to_target_s"]
        for variant, seconds in (row.get("ours_time_to_target_s") or {}).items():
            if seconds is not None:
                series.setdefault(f"ours ({variant})", {})[rate] = seconds
    for label, points in series.items():
        if not points:
            continue
        ordered = sorted(points, key=x.__getitem__)
        axes.plot(
            [x[rate] for rate in ordered],
            [points[rate] for rate in ordered],
            marker="o",
            linestyle="--" if label == "data parallel" else "-",
            label=label,
        )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(sorted(x.values()), [rate for rate in sorted(x, key=x.__getitem__)])
    axes.set_xlabel("link rate (each site, both ways)")
    axes.set_ylabel(f"seconds to {target:.0%} held-out exact match")
    axes.set_title("time to target on capped links: our DiLoCo job and per-step data parallel")
    axes.grid(True, which="both", alpha=0.3)
    if any(series.values()):
        axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, png.getvalue(), mode=0o644)
    return path
