"""Shared scaffolding for benchmarks (ARCHITECTURE §11): a throwaway PKI,
percentiles, and the one-JSON-line result every benchmark prints last."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for `tests.conftest.make_pki` when run as a script


def temp_pki() -> Any:
    from tests.conftest import make_pki

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
