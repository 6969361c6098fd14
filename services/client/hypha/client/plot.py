"""The demo's figure: what the job learnt, round by round, drawn by matplotlib.

Top: the trainers' loss on answer tokens per round (left axis) and the
held-out exact-match accuracy of θ_global (right axis). Bottom: each
worker's training throughput per round.

NOTE: the figure is drawn on matplotlib's object API with the Agg canvas
(``Figure`` + ``FigureCanvasAgg``), not ``pyplot``: no global backend or
figure registry, so it works without a display and in any thread.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

from hypha.fsutil import write_atomic

#: Figure size in inches at ``DPI``: an 960x720-pixel PNG.
SIZE_IN = (9.6, 7.2)
DPI = 100


def training_plot(
    losses: Mapping[int, float],
    accuracy: Mapping[int, float],
    throughput: Mapping[str, Mapping[int, float]],
    path: Path,
    *,
    title: str,
) -> Path:
    """Write the figure as a PNG at ``path`` and return it.

    ``losses`` and ``accuracy`` map a number of completed rounds to the
    figure then (accuracy's 0 is the model before training);
    ``throughput`` maps a worker's name to its samples per second by round.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    fig.suptitle(title)

    rounds = sorted(losses)
    top.plot(rounds, [losses[r] for r in rounds], marker="o", color="tab:blue", label="loss (answer tokens)")
    top.set_ylabel("loss on answer tokens", color="tab:blue")
    top.set_title("training loss and held-out exact match")
    top.grid(True, alpha=0.3)
    acc_axis = top.twinx()
    points = sorted(accuracy)
    acc_axis.plot(
        points,
        [100 * accuracy[r] for r in points],
        marker="s",
        color="tab:green",
        label="held-out exact match",
    )
    acc_axis.set_ylabel("held-out exact match (%)", color="tab:green")
    acc_axis.set_ylim(0, 100)
    lines = top.get_legend_handles_labels()
    more = acc_axis.get_legend_handles_labels()
    top.legend(lines[0] + more[0], lines[1] + more[1], loc="center right")

    for worker, by_round in sorted(throughput.items()):
        xs: Sequence[int] = sorted(by_round)
        bottom.plot(xs, [by_round[r] for r in xs], marker=".", label=worker)
    bottom.set_title("throughput per worker")
    bottom.set_xlabel("rounds completed")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylabel("samples / s")
    bottom.set_ylim(bottom=0)
    bottom.grid(True, alpha=0.3)
    if throughput:
        bottom.legend(loc="lower right")

    path.parent.mkdir(parents=True, exist_ok=True)
    # Rendered in memory and written atomically: an interrupted run never leaves half a PNG
    # over the previous figure.
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, png.getvalue(), mode=0o644)
    return path
