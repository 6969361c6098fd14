"""Draw the scaling curves of ``docs/performance.md`` from saved ``--sweep`` results.

    python benchmarks/<name>.py --sweep [--quick] | tail -n 1 > docs/perf/<name>.json
    python scripts/plot_benchmarks.py [docs/perf/*.json] [--out docs/perf]

Each input file holds a benchmark's output; its last line is the JSON result
whose ``sweep`` carries the series (``benchmarks/_common.report_sweep``). One
PNG per file, ``<out>/<name>.png``: our figure and the same run's baseline
against the swept size on log-log axes, with a dotted line of slope 1 through
the first point, so a curve that rises faster than linearly is plain to see.

The figure uses matplotlib's object API on the Agg canvas (no ``pyplot``, no
display), as the demo's plot does. Needs matplotlib (the ``[dev]`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "perf"
SIZE_IN = (6.4, 4.4)
DPI = 100

#: What each benchmark's figure means, for the axis label.
LABELS = {
    "pubsub": "time until the last subscriber has it (p50)",
    "market": "allocation of 4 leases (p50)",
    "dht": "provider lookup, 2 nodes dead, cache off (p50)",
    "aggregate": "one parameter-server round (median)",
    "relay": "aggregate throughput (median)",
}


def load(path: Path) -> dict[str, Any]:
    """The JSON result on the last non-empty line of ``path``; it must carry a ``sweep``."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty")
    result: dict[str, Any] = json.loads(lines[-1])
    if "sweep" not in result:
        raise ValueError(f"{path}: not a --sweep result (no 'sweep' key)")
    return result


def plot(result: dict[str, Any], out: Path) -> Path:
    """Write ``<out>/<name>.png`` for one sweep result and return its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    name, unit = result["name"], result["unit"]
    size_name = result["sweep"]["size"]
    points = result["sweep"]["points"]
    sizes = [p[size_name] for p in points]
    ours = [p["figure"] for p in points]
    base = [p["baseline"] for p in points]

    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(sizes, ours, marker="o", color="tab:blue", label=f"{name} (ours)")
    ax.plot(sizes, base, marker="s", color="tab:gray", label="baseline, same run")
    if len(sizes) > 1 and ours[0] > 0:
        linear = [ours[0] * s / sizes[0] for s in sizes]
        ax.plot(sizes, linear, linestyle=":", color="tab:red", label="linear from the first point")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())
    for size, value, point in zip(sizes, ours, points, strict=True):
        if point.get("short"):  # market: allocations that ended with fewer leases than asked
            ax.annotate(
                f"{point['short']} short", (size, value), textcoords="offset points", xytext=(-52, -4)
            )
    ax.set_xlabel(size_name)
    ax.set_ylabel(f"{LABELS.get(name, 'figure')} [{unit}]")
    ax.set_title(f"{name} --sweep")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.savefig(path, format="png")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path, help="saved results (default: docs/perf/*.json)")
    parser.add_argument("--out", type=Path, default=PERF, help="where the PNGs go (default: docs/perf)")
    args = parser.parse_args(argv)
    files = args.results or sorted(PERF.glob("*.json"))
    if not files:
        print("no results to plot", file=sys.stderr)
        return 1
    try:
        results = [load(path) for path in files]  # all read before any PNG is written
    except (OSError, ValueError) as err:
        print(f"plot_benchmarks: {err}", file=sys.stderr)
        return 2
    for result in results:
        print(plot(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
