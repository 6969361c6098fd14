"""Samples to 90 % held-out exact match on the demo's task: per-step data parallel beside DiLoCo
settings, over several data orders, in one run (issue 30, "Fit the sync to the link").

    python benchmarks/samples_to_target.py [--quick] [--variants ddp,diloco,int8,overlap,h10,outer-0.7-0.9]
        [--seeds 0,1,2] [--max-samples N] [--eval-every N] [--target 0.9] [--plot PNG]

The link does not change the arithmetic of a synchronous job, only its time: this benchmark
measures the arithmetic alone, in this process, so that ``benchmarks/wan.py``'s times can be
read against it. Everything is the demo's (``hypha demo``): the task (3-digit reversed sums,
held-out pairs never trained on), the seeded 0.63M-parameter GPT-2, 2 trainers (or ranks) of
batch 64, the inner AdamW (2e-3, betas 0.9/0.95, weight decay 0.1, clipping at 1.0, warmup over 100 steps: the
trainer's own ``train_step``), plain averaging as the outer step (lr 1, momentum 0), one torch
thread per run. Seed s is the order of the training rows (``synthetic.arithmetic(seed=s)``);
the model's initial weights are the same in every run.

Variants (``VARIANTS``): ``ddp``, one AdamW step per 128 rows (2 ranks x 64, gradients
averaged: a rank's batches concatenated); ``diloco``, 50 inner steps per trainer a round (the
demo's job, fp32 both ways); ``int8``, the same with Δ up and the update down in int8 with
error feedback (``delta_dtype`` and ``update_dtype``, the real codecs:
``hypha.tensors.deltas.DeltaEncoder``, ``hypha.diloco.updates``); ``overlap``, the demo's job
with each round's update merged one round late (``overlap_sync`` on a link slow enough that
the update lands at the end of the next round: the worst case, kept steps rebased as the
trainer does); ``h10``, 10 inner steps a round; ``outer-LR-M`` (any learning rate and
momentum, e.g. ``outer-0.7-0.9``, the DiLoCo paper's and the job's default), the demo's job
with that outer Nesterov step instead of plain averaging; ``overlap-K``, overlapped rounds whose
update lands after K of the next round's inner steps (a fast link: the update's flight is
a few steps); ``int8-overlap-K`` (and ``int8-overlap``), the same with int8 both ways: the job
file's defaults, as the cluster runs them.

Held-out exact match (greedy, 500 held-out sums: ``demo_eval.score``) every ``--eval-every``
samples (all trainers together), until the target or ``--max-samples``. Runs go two at a
time in worker processes (the machine's 2 cores). Last line: ``{"name":
"samples_to_target", "figure": median samples to the target of diloco, "unit": "samples",
"baseline": that of ddp, "ratio": figure / baseline, "variants": {variant: {"samples":
[per seed, None if not reached], "median": ..., "curves": ...}}}``; a run that never reached
the target counts as ``--max-samples`` in a median (said in ``median_is``).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import demo_inner_settings, report

VARIANTS = ("ddp", "diloco", "int8", "overlap", "h10")
#: ``outer-LR-M``: the demo's job with that outer learning rate and momentum.
OUTER = "outer-"
#: ``overlap-K``: overlapped rounds whose update lands after K of the next round's inner steps.
OVERLAP = "overlap-"
#: ``int8-overlap-K``: the same with int8 both ways (the job file's defaults in the cluster).
INT8 = "int8-"
TRAINERS = 2
HELDOUT = 500


@dataclass(frozen=True)
class Run:
    variant: str
    seed: int
    max_samples: int
    eval_every: int
    target: float
    model_dir: str


def run(spec: Run) -> dict[str, Any]:
    """One variant and seed, to the target: its curve of (samples, held-out exact match)."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    from hypha.client import demo, demo_eval
    from hypha.datasets import synthetic

    torch.set_num_threads(1)
    rows = synthetic.arithmetic(spec.max_samples, seed=spec.seed).tensors
    heldout = demo_eval.heldout(HELDOUT)
    curve: list[tuple[int, float]] = []
    started = time.perf_counter()

    def scored(samples: int, model: torch.nn.Module) -> bool:
        model.eval()
        _, accuracy = demo_eval.score(model, heldout)
        model.train()
        curve.append((samples, accuracy))
        return accuracy >= spec.target

    def rows_at(start: int, count: int) -> dict[str, torch.Tensor]:
        return {k: v[start : start + count] for k, v in rows.items()}

    train = _ddp if spec.variant == "ddp" else _diloco
    train(spec, rows_at, scored, demo.BATCH)
    reached = next((s for s, a in curve if a >= spec.target), None)
    return {**asdict(spec), "curve": curve, "samples": reached, "seconds": time.perf_counter() - started}


def _model(spec: Run) -> tuple[Any, Any, Any]:
    from transformers import AutoModelForCausalLM

    from hypha.worker.executors.diloco_settings import make_inner_optimizer

    settings = demo_inner_settings()
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir)
    model.train()
    return model, make_inner_optimizer(model, settings), settings


def _ddp(spec: Run, rows_at: Callable[..., Any], scored: Callable[..., bool], batch: int) -> None:
    from hypha.models import ModelKind
    from hypha.worker.executors.inner_steps import train_step

    model, optimizer, settings = _model(spec)
    samples, due = 0, spec.eval_every
    while samples + TRAINERS * batch <= spec.max_samples:
        train_step(model, optimizer, ModelKind.CAUSAL_LM, rows_at(samples, TRAINERS * batch), settings)
        samples += TRAINERS * batch
        if samples >= due:
            due += spec.eval_every
            if scored(samples, model):
                return


def _diloco(spec: Run, rows_at: Callable[..., Any], scored: Callable[..., bool], batch: int) -> None:
    import torch

    from hypha.diloco.outer import NesterovOuter
    from hypha.diloco.updates import UpdateEncoder, apply_change
    from hypha.models import ModelKind
    from hypha.tensors.deltas import DeltaEncoder
    from hypha.tensors.payload import decode_state
    from hypha.worker.executors.inner_steps import apply_global, compute_delta, parameter_state, train_step

    inner_steps = 10 if spec.variant == "h10" else 50
    trainers = [_model(spec) for _ in range(TRAINERS)]
    theta = parameter_state(trainers[0][0])
    outer = NesterovOuter(theta, *outer_settings(spec.variant))
    int8 = spec.variant == "int8" or spec.variant.startswith(INT8)
    up = [DeltaEncoder("int8") for _ in trainers] if int8 else None
    down = UpdateEncoder("int8", theta) if int8 else None
    late: tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]] | None = None
    lag = overlap_lag(spec.variant, inner_steps)

    def merge(model: torch.nn.Module, new: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
        """The last round's update lands: θ_global plus the steps taken since the send."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(new[name] - before[name])

    samples, due, round_number = 0, spec.eval_every, 0
    while samples + TRAINERS * inner_steps * batch <= spec.max_samples:
        for t, (model, optimizer, settings) in enumerate(trainers):
            for i in range(inner_steps):
                if late is not None and i == lag:
                    merge(model, late[0], late[1][t])
                start = samples + (t * inner_steps + i) * batch
                train_step(model, optimizer, ModelKind.CAUSAL_LM, rows_at(start, batch), settings)
            if late is not None and lag == inner_steps:
                merge(model, late[0], late[1][t])
        samples += TRAINERS * inner_steps * batch
        if late is not None:
            theta, late = late[0], None
        deltas = [compute_delta(model, theta) for model, _, _ in trainers]
        if up is not None:
            deltas = [decode_state(e.encode(d), torch.float32) for e, d in zip(up, deltas, strict=True)]
        live = outer.step_average([(d, 1) for d in deltas])
        if down is not None:
            change = down.encode(live, list(live), round_number, {})
            new = apply_change(change, theta)
        else:
            new = {n: t.clone() for n, t in live.items()}
        round_number += 1
        if lag is not None:
            late = (new, [parameter_state(model) for model, _, _ in trainers])
        else:
            theta = new
            for model, _, _ in trainers:
                apply_global(model, new)
        if samples >= due:
            due += spec.eval_every
            scoring = trainers[0][0]
            if lag is not None:
                scoring = _model(spec)[0]
                apply_global(scoring, new)
            if scored(samples, scoring):
                return


def overlap_lag(variant: str, inner_steps: int) -> int | None:
    """Overlapped rounds: after how many of the next round's inner steps a round's update lands
    (``overlap``: all of them; ``overlap-K`` and ``int8-overlap-K``: K). None: synchronous rounds."""
    variant = variant.removeprefix(INT8)
    if variant == "overlap":
        return inner_steps
    if variant.startswith(OVERLAP):
        return int(variant.removeprefix(OVERLAP))
    return None


def outer_settings(variant: str) -> tuple[float, float]:
    """The outer step's (learning rate, momentum): the demo's plain averaging unless the variant
    is ``outer-LR-M``."""
    if not variant.startswith(OUTER):
        return 1.0, 0.0
    lr, _, momentum = variant.removeprefix(OUTER).partition("-")
    return float(lr), float(momentum)


def _known(variant: str) -> bool:
    if variant in VARIANTS:
        return True
    if variant.startswith(INT8):
        variant = variant.removeprefix(INT8)
        if variant == "overlap":
            return True
        if not variant.startswith(OVERLAP):
            return False
    if variant.startswith(OVERLAP):
        lag = variant.removeprefix(OVERLAP)
        return lag.isdigit() and 1 <= int(lag) <= 50
    try:
        lr, momentum = outer_settings(variant)
    except ValueError:
        return False
    return variant.startswith(OUTER) and lr > 0 and 0 <= momentum < 1


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError("at least one value")
        return values

    return parse


def summarize(runs: list[Mapping[str, Any]], max_samples: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = sorted((r for r in runs if r["variant"] == variant), key=lambda r: r["seed"])
        reached = [r["samples"] for r in mine]
        out[variant] = {
            "seeds": [r["seed"] for r in mine],
            "samples": reached,
            "median": statistics.median(s if s is not None else max_samples for s in reached),
            "curves": [r["curve"] for r in mine],
        }
    return out


def plot(variants: Mapping[str, Any], path: Path, target: float) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from hypha.fsutil import write_atomic

    fig = Figure(figsize=(8.0, 5.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots()
    colors = {variant: f"C{i % 10}" for i, variant in enumerate(variants)}
    for variant, row in variants.items():
        for i, curve in enumerate(row["curves"]):
            axes.plot(
                [s / 1000 for s, _ in curve],
                [100 * a for _, a in curve],
                color=colors[variant],
                alpha=0.8,
                label=variant if i == 0 else None,
            )
    axes.axhline(100 * target, color="grey", linestyle=":")
    axes.set_xlabel("samples, all trainers together (thousands)")
    axes.set_ylabel("held-out exact match (%)")
    axes.set_title("the demo's task: accuracy against samples, one line per data order")
    axes.grid(True, alpha=0.3)
    axes.legend()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, png.getvalue(), mode=0o644)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="ddp and diloco, one seed, 12,800 samples")
    parser.add_argument(
        "--variants",
        type=_csv(str),
        help=f"of {', '.join(VARIANTS)}, outer-LR-M, overlap-K, int8-overlap-K (default the five)",
    )
    parser.add_argument("--seeds", type=_csv(int), help="data orders (default 0,1,2; --quick 0)")
    parser.add_argument("--max-samples", type=int, help="per run, all trainers (default 400,000)")
    parser.add_argument("--eval-every", type=int, help="samples between scores (default 12,800)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--plot", type=Path, help="write a PNG of accuracy against samples")
    parser.add_argument("--workers", type=int, default=2, help="runs at once")
    args = parser.parse_args()
    variants = args.variants or (["ddp", "diloco"] if args.quick else list(VARIANTS))
    unknown = [v for v in variants if not _known(v)]
    if unknown:
        parser.error(
            f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}, outer-LR-M"
            " (LR > 0, 0 <= M < 1), overlap-K or int8-overlap-K (1 <= K <= 50)"
        )
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    max_samples = args.max_samples or (12_800 if args.quick else 400_000)
    eval_every = args.eval_every or (6_400 if args.quick else 12_800)
    if max_samples < eval_every or eval_every < 1 or not 0 < args.target <= 1:
        parser.error("need 1 <= --eval-every <= --max-samples and --target in (0, 1]")

    from hypha.models import save_arithmetic_model

    model_dir = save_arithmetic_model(Path(tempfile.mkdtemp(prefix="hypha-bench-stt-")) / "model", seed=0)
    specs = [Run(v, s, max_samples, eval_every, args.target, str(model_dir)) for v in variants for s in seeds]
    # spawn: this process has imported torch (fork after its thread pools start can hang).
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.workers), mp_context=context) as pool:
        runs = list(pool.map(run, specs))
    for r in runs:
        print(
            f"{r['variant']:8s} seed {r['seed']}: "
            + (f"{r['samples']:,} samples" if r["samples"] else f"not reached in {max_samples:,}")
            + f" (best {max(a for _, a in r['curve']):.1%}, {r['seconds']:.0f} s)",
            flush=True,
        )
    table = summarize(runs, max_samples)
    if args.plot is not None:
        plot(table, args.plot, args.target)
    first = "diloco" if "diloco" in table else variants[0]
    figure = table[first]["median"]
    baseline = table["ddp"]["median"] if "ddp" in table else figure
    print(json.dumps({v: (row["samples"], row["median"]) for v, row in table.items()}))
    report(
        "samples_to_target",
        figure,
        "samples",
        baseline,
        figure / baseline,
        figure_is=f"median samples to {args.target:.0%} of {first}",
        median_is=f"a run that never reached the target counts as --max-samples ({max_samples})",
        variants=table,
        seeds=seeds,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
