"""Training on capped links: time to 90 % held-out exact match for our DiLoCo job and for
per-step data parallel, on the same links (issue 30).

    python benchmarks/wan.py [--quick] [--json] [--rates unlimited,1gbit,100mbit,20mbit] [--steps N]
        [--rounds N] [--variants default,fp32,int8,compressed,overlap,slow-link,streaming] [--target 0.9]
        [--eval-every N]
        [--repeats N] [--curve-steps N] [--plot PNG]

Each rate gets a fresh link lab (``hypha.testing.wan``): a hub namespace and one site
namespace per rank or worker, each site joined to the hub by a veth pair capped at the rate
in both directions with ``tbf`` (``unlimited``: no qdisc). The hub routes between sites, so
two sites talk through two capped links, as two machines on slow uplinks would. Needs root
and iproute2. ``--quick`` (CI): 20mbit only, 10 data-parallel steps, ours (the defaults) for 2 rounds
(accuracy reached, no target), no accuracy curve for data parallel.

Ours (``_wan_ours``): the demo's DiLoCo job on a local cluster whose core runs in the hub and
whose 3 workers (2 trainers, the parameter server) each sit behind a capped link, end to end
at every rate, per variant (``--repeats``: medians); ``_wan_figures`` has the top-level figures
and their definitions, ``_wan_plot`` the plot.

Data parallel (``ddp``): ``torch.distributed`` DistributedDataParallel over gloo, 2 ranks,
each a process in its own site namespace (rank 0 listens at its site's address), on the
demo's task and model (``hypha demo``: 3-digit reversed sums, the seeded 0.63M-parameter
GPT-2), with the demo's per-rank batch (64) and inner optimizer (AdamW 2e-3, betas
0.9/0.95, weight decay 0.1, gradient norm clipped to 1.0, linear warmup over 100 steps: the trainer's own
``train_step``), one torch thread per rank. Rank r takes every 2nd batch of rows from the
demo's generator (``synthetic.arithmetic``, seed 0: data order 0), starting at batch r. After
``WARMUP_STEPS`` untimed steps (gloo's connections, DDP's first broadcast), both ranks time
``--steps`` steps (default 50; 10 with ``--quick``). The ranks run ``_wan_ddp``.

Figures per rate: ``ddp_step_s``, the mean step time (the slower rank's), and
``ddp_bytes_per_step``, the bytes through one rank's link per step in both directions
(sent + received, read at the veth counters over the timed steps; mean over ranks);
``ddp_loss``, rank 0's last training loss (the same at every rate: the link changes the
time, not the arithmetic). The
counters see what the veth carried: on a link fast enough that tbf leaves them whole, TCP's
segmentation-offload packets (up to 64 KiB under one set of headers), so bytes on a
fast link read up to ~5 % below a real wire's (one set of headers per MTU). tbf splits the
packets larger than its burst (32 KiB at 20mbit), so slow links read close to the wire.
Last line: ``{"name": "wan", "figure": ddp_step_s at the lowest rate, "unit": "s",
"baseline": ddp_step_s at the highest rate, "ratio": figure / baseline, "rates": {rate:
{...}}, ...}`` and the top-level figures of ``_wan_figures.summary``; ``--json`` prints that
line alone, without the tables. Data parallel's time to the target: its held-out exact match
every 50 steps of a ``--curve-steps`` run on the fastest link per data order (``ddp_curves``;
the link changes its time, not its arithmetic), the median over the orders of the steps to
the target, times its step time at each rate.

Data orders (``--repeats N``): run r of ours and data parallel's r-th curve train on the rows
of ``synthetic.arithmetic(seed=r)``, so both sides' medians are over the same N orders (the
step at which either leaves the task's plateau moves with the order: ``samples_to_target.py``);
the JSON keeps each order's figures beside the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _wan_ours
from _common import report
from _wan_ddp import CURVE_EVERY, RANKS, measure_curve, measure_ddp
from _wan_figures import summary, table
from _wan_plot import time_to_target_plot

from hypha.errors import InvalidArgumentError
from hypha.testing.wan import WanLab, parse_rate, require, wan_lab

#: Ours: 2 trainers and the parameter server's worker, each behind its own link.
SITES = 3
RATES = "unlimited,1gbit,100mbit,20mbit"
QUICK_RATES = "20mbit"
STEPS, QUICK_STEPS = 50, 10
#: Ours: the demo's rounds; --quick: enough to see rounds cross the links, not to train.
ROUNDS, QUICK_ROUNDS = 60, 2
TARGET = 0.90
#: Data parallel's accuracy against steps (on the fastest link only, per data order): steps
#: run, 320,000 samples (``samples_to_target.py``'s cap: one order of three needed more).
CURVE_STEPS = 2500


@dataclass(frozen=True)
class Setup:
    rates: list[str]
    steps: int
    model_dir: Path
    quick: bool
    ours: _wan_ours.OursSetup
    #: Where ours runs (--quick: the slowest rate only).
    ours_rates: list[str]
    #: Data parallel's accuracy curve: measured at this rate, CURVE_STEPS long ("": not measured),
    #: once per data order (as many as ours has runs per variant: run r trains on order r).
    curve_rate: str
    curve_steps: int = CURVE_STEPS
    orders: int = 1


#: One side of the comparison at one rate: its figures, measured in the rate's lab.
Measure = Callable[[WanLab, Setup], Awaitable[dict[str, Any]]]


# ---- the run -------------------------------------------------------------------------------


async def measure_data_parallel(lab: WanLab, setup: Setup) -> dict[str, Any]:
    figures = await measure_ddp(lab, setup.steps, setup.model_dir)
    if lab.rate == setup.curve_rate:
        curves = {}
        for order in range(setup.orders):
            checkpoints = setup.ours.work / f"ddp-curve-{order}"
            curves[str(order)] = await measure_curve(
                lab, setup.curve_steps, setup.model_dir, checkpoints, setup.ours.heldout, order
            )
        figures["ddp_curves"] = curves
    return figures


async def measure_ours(lab: WanLab, setup: Setup) -> dict[str, Any]:
    if lab.rate not in setup.ours_rates:
        return {}
    return await _wan_ours.measure(lab, setup.ours)


#: Everything measured at each rate; each adds its own keys to the rate's figures.
MEASURES: tuple[Measure, ...] = (measure_data_parallel, measure_ours)


async def measure_rate(rate: str, setup: Setup) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with wan_lab(SITES, rate) as lab:
        for measure in MEASURES:
            figures.update(await measure(lab, setup))
    return figures


def _rates_arg(text: str) -> list[str]:
    rates = [part.strip() for part in text.split(",") if part.strip()]
    try:
        for rate in rates:
            parse_rate(rate)
    except InvalidArgumentError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not rates:
        raise argparse.ArgumentTypeError("--rates: at least one rate")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_RATES}, {QUICK_STEPS} steps, ours (the defaults) {QUICK_ROUNDS} rounds",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--rates", type=_rates_arg, help=f"comma-separated tc rates (default {RATES})")
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per rate (default {STEPS}, --quick {QUICK_STEPS})"
    )
    parser.add_argument(
        "--rounds", type=int, help=f"ours: the demo job's rounds (default {ROUNDS}, --quick {QUICK_ROUNDS})"
    )
    parser.add_argument(
        "--variants",
        type=_variants_arg,
        help=f"ours: comma-separated, of {', '.join(_wan_ours.VARIANTS)} (default all, --quick default)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="data orders: ours runs each variant, data parallel its curve, once per order; medians reported",
    )
    parser.add_argument("--target", type=float, default=TARGET, help="held-out exact match to reach")
    parser.add_argument(
        "--eval-every", type=int, help="ours: score every n-th round's θ_global (default 3, --quick 1)"
    )
    parser.add_argument(
        "--curve-steps",
        type=int,
        default=CURVE_STEPS,
        help=f"data parallel's accuracy curve: steps on the fastest link (default {CURVE_STEPS}; 0: none)",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of time to target against link rate")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep every run's node logs, metrics and θ files (they are kept anyway when a run fails)",
    )
    args = parser.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    # Progress bars and notices of model loading in every rank and run would bury the tables.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    eval_every = args.eval_every or (1 if args.quick else 3)
    for name, value in (
        ("--steps", steps),
        ("--rounds", rounds),
        ("--eval-every", eval_every),
        ("--repeats", args.repeats),
    ):
        if value < 1:
            parser.error(f"{name} must be at least 1")
    if not 0.0 < args.target <= 1.0:
        parser.error("--target must be in (0, 1]")

    from hypha.client.demo import BATCH
    from hypha.models import save_arithmetic_model

    require()
    rates_run = args.rates or _rates_arg(QUICK_RATES if args.quick else RATES)
    speed = {rate: parse_rate(rate) or float("inf") for rate in rates_run}
    slowest, fastest = min(speed, key=speed.__getitem__), max(speed, key=speed.__getitem__)
    scratch = Path(tempfile.mkdtemp(prefix="hypha-bench-wan-"))
    try:
        ours = _wan_ours.OursSetup(
            rounds=rounds,
            variants=args.variants or (["default"] if args.quick else list(_wan_ours.VARIANTS)),
            target=args.target,
            eval_every=eval_every,
            # --quick: ±3.5 points at 50 %, enough to see it is a number that moved.
            heldout=200 if args.quick else 1000,
            repeats=args.repeats,
            template=scratch / "template",
            work=scratch / "runs",
            keep=args.keep,
        )
        _wan_ours.prepare_template(ours.template, rounds, args.repeats)
        setup = Setup(
            rates=rates_run,
            steps=steps,
            model_dir=save_arithmetic_model(scratch / "model", seed=0),
            quick=args.quick,
            ours=ours,
            ours_rates=[slowest] if args.quick else rates_run,
            curve_rate="" if args.quick or args.curve_steps < CURVE_EVERY else fastest,
            curve_steps=args.curve_steps,
            orders=args.repeats,
        )
        rates = {rate: asyncio.run(measure_rate(rate, setup)) for rate in setup.rates}
    except BaseException:
        # The node logs, driver logs and θ files say why: keep them.
        print(f"wan: failed; its runs are kept in {scratch}", file=sys.stderr)
        raise
    if args.keep:
        print(f"wan: its runs are kept in {scratch}", file=sys.stderr)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    top = summary(rates, args.target, fastest)
    if args.plot is not None:
        time_to_target_plot(rates, args.plot, args.target)
    if not args.json:
        table(rates, steps, args.target)
    figure, baseline = rates[slowest]["ddp_step_s"], rates[fastest]["ddp_step_s"]
    report(
        "wan",
        figure,
        "s",
        baseline,
        figure / baseline,
        rates=rates,
        slowest=slowest,
        fastest=fastest,
        ranks=RANKS,
        batch_per_rank=BATCH,
        steps=steps,
        quick=args.quick,
        rounds=rounds,
        target=args.target,
        **top,
    )


def _variants_arg(text: str) -> list[str]:
    variants = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [v for v in variants if v not in _wan_ours.VARIANTS]
    if unknown or not variants:
        raise argparse.ArgumentTypeError(
            f"--variants: {', '.join(unknown) or 'none given'}; choose from {', '.join(_wan_ours.VARIANTS)}"
        )
    return variants


if __name__ == "__main__":
    main()
