"""Shared scaffolding for benchmarks (ARCHITECTURE §11): a throwaway PKI,
percentiles, and the one-JSON-line result every benchmark prints last.

Benchmarks import harness code only from here and ``hypha.testing``, never from ``tests``."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from hypha.testing.pki import Pki, make_pki


def temp_pki() -> Pki:
    return make_pki(Path(tempfile.mkdtemp(prefix="hypha-bench-")) / "pki")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(name: str, figure: float, unit: str, baseline: float, ratio: float, **extra: Any) -> None:
    result = {
        "name": name,
        "figure": round(figure, 6),
        "unit": unit,
        "baseline": round(baseline, 6),
        "ratio": round(ratio, 4),
        **extra,
    }
    print(json.dumps(result), flush=True)


def sizes_arg(text: str) -> list[int]:
    """``--sizes 10,100,1000`` -> [10, 100, 1000] (argparse ``type``)."""
    return [int(part) for part in text.split(",") if part.strip()]


def report_sweep(name: str, unit: str, size_name: str, points: list[dict[str, Any]], **extra: Any) -> None:
    """The last line of a ``--sweep`` run: the series, one point per size, each with its own
    ``figure`` / ``baseline`` / ``ratio`` measured at that size; the top-level figure is the
    largest size's, so the line still reads like any other result (and plots from
    ``scripts/plot_benchmarks.py``)."""
    last = points[-1]
    report(
        name,
        last["figure"],
        unit,
        last["baseline"],
        last["ratio"],
        sweep={"size": size_name, "points": points},
        **extra,
    )
