"""Training on capped links: what a slow link does to per-step data parallel, the baseline
DiLoCo is measured against (issue 30).

    python benchmarks/wan.py [--quick] [--json] [--rates unlimited,1gbit,100mbit,20mbit] [--steps N]

Each rate gets a fresh link lab (``hypha.testing.wan``): a hub namespace and one site
namespace per rank, each site joined to the hub by a veth pair capped at the rate in both
directions with ``tbf`` (``unlimited``: no qdisc). The hub routes between sites, so the
ranks talk through two capped links, as two machines on slow uplinks would. Needs root and
iproute2.

Data parallel (``ddp``): ``torch.distributed`` DistributedDataParallel over gloo, 2 ranks,
each a process in its own site namespace (rank 0 listens at its site's address), on the
demo's task and model (``hypha demo``: 3-digit reversed sums, the seeded 0.63M-parameter
GPT-2), with the demo's per-rank batch (64) and inner optimizer (AdamW 3e-3, betas
0.9/0.95, gradient norm clipped to 1.0, linear warmup over 100 steps: the trainer's own
``train_step``), one torch thread per rank. Rank r takes every 2nd batch of rows from the
demo's generator (``synthetic.arithmetic``, seed 0), starting at batch r. After
``WARMUP_STEPS`` untimed steps (gloo's connections, DDP's first broadcast), both ranks time
``--steps`` steps (default 50; 10 with ``--quick``, which also runs only ``unlimited,20mbit``).

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
{...}}, ...}``; ``--json`` prints that line alone, without the table. DiLoCo's figures per
rate join ``MEASURES`` as one more function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import report

from hypha.errors import InvalidArgumentError
from hypha.testing.wan import SITE_LINK, WanLab, parse_rate, require, wan_lab

RANKS = 2
RATES = "unlimited,1gbit,100mbit,20mbit"
QUICK_RATES = "unlimited,20mbit"
STEPS, QUICK_STEPS = 50, 10
#: Untimed steps first: gloo connects and DDP broadcasts rank 0's parameters.
WARMUP_STEPS = 2
#: Rank 0's rendezvous port; nothing else listens in a fresh site namespace.
MASTER_PORT = 29500
#: Until a rank has started and taken its warmup steps (imports and a 20 Mbit/s link are slow).
READY_TIMEOUT_S = 300.0
#: Per timed step, beyond a fixed minute: ~2 s at 20 Mbit/s measured, far more is a hang.
STEP_TIMEOUT_S = 30.0
SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class Setup:
    rates: list[str]
    steps: int
    model_dir: Path
    quick: bool


#: One side of the comparison at one rate: its figures, measured in the rate's lab.
Measure = Callable[[WanLab, Setup], Awaitable[dict[str, float]]]


# ---- data parallel -------------------------------------------------------------------------


async def measure_ddp(lab: WanLab, setup: Setup) -> dict[str, float]:
    """Per-step data parallel, one rank per site, timed over ``setup.steps`` steps."""
    master = f"{lab.sites[0].address}:{MASTER_PORT}"
    # gloo picks its interface from the hostname otherwise, which means nothing in a site.
    env = {**os.environ, "GLOO_SOCKET_IFNAME": SITE_LINK, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # Sites have no names to resolve: c10d's warning about each peer's hostname is noise.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ranks = [
        await lab.spawn(
            site.namespace,
            sys.executable,
            str(SCRIPT),
            "--rank",
            str(rank),
            "--master",
            master,
            "--steps",
            str(setup.steps),
            "--model-dir",
            str(setup.model_dir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        for rank, site in enumerate(lab.sites[:RANKS])
    ]
    try:
        await asyncio.gather(*(_line(rank, READY_TIMEOUT_S) for rank in ranks))
        before = lab.all_counters()
        for rank in ranks:
            assert rank.stdin is not None
            rank.stdin.write(b"go\n")
            await rank.stdin.drain()
        timeout = 60.0 + setup.steps * STEP_TIMEOUT_S
        results = await asyncio.gather(*(_line(rank, timeout) for rank in ranks))
        moved = [after - start for after, start in zip(lab.all_counters(), before, strict=True)]
    finally:
        await _stop(ranks)
    seconds = max(float(result["seconds"]) for result in results)
    per_rank = statistics.mean(link.total for link in moved[:RANKS])
    return {
        "ddp_step_s": round(seconds / setup.steps, 4),
        "ddp_bytes_per_step": round(per_rank / setup.steps),
        "ddp_loss": round(float(results[0]["loss"]), 4),
    }


async def _line(rank: asyncio.subprocess.Process, timeout_s: float) -> dict[str, Any]:
    assert rank.stdout is not None
    line = await asyncio.wait_for(rank.stdout.readline(), timeout_s)
    if not line:
        raise RuntimeError(f"a data-parallel rank ended early (exit code {await rank.wait()})")
    parsed: dict[str, Any] = json.loads(line)
    return parsed


async def _stop(ranks: list[asyncio.subprocess.Process]) -> None:
    """Closing stdin lets a rank leave the process group and exit; the lab ends the rest."""
    for rank in ranks:
        if rank.stdin is not None and not rank.stdin.is_closing():
            rank.stdin.close()
    for rank in ranks:
        try:
            await asyncio.wait_for(rank.wait(), 30)
        except TimeoutError:
            rank.kill()
            await rank.wait()


def run_rank(rank: int, master: str, steps: int, model_dir: Path) -> None:
    """One data-parallel rank (inside its site namespace): warm up, say so, wait for "go",
    time ``steps`` steps, report them, and wait for stdin to close before leaving the group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from hypha.client import demo
    from hypha.datasets import synthetic
    from hypha.models import ModelKind
    from hypha.worker.executors.training import InnerSettings, make_inner_optimizer, train_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}", rank=rank, world_size=RANKS, timeout=timedelta(minutes=10)
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    ddp = DistributedDataParallel(model)
    settings = InnerSettings(
        lr=demo.INNER_LR,
        beta1=demo.INNER_BETAS[0],
        beta2=demo.INNER_BETAS[1],
        max_grad_norm=demo.INNER_MAX_GRAD_NORM,
        warmup_steps=demo.INNER_WARMUP_ROUNDS * demo.INNER_STEPS,
    )
    optimizer = make_inner_optimizer(ddp, settings)
    total = WARMUP_STEPS + steps
    rows = synthetic.arithmetic(total * RANKS * demo.BATCH, seed=0).tensors

    def batch(step: int) -> dict[str, torch.Tensor]:
        start = (step * RANKS + rank) * demo.BATCH
        return {k: v[start : start + demo.BATCH] for k, v in rows.items()}

    for step in range(WARMUP_STEPS):
        train_step(ddp, optimizer, ModelKind.CAUSAL_LM, batch(step), settings)
    print(json.dumps({"ready": rank}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    dist.barrier()
    started = time.perf_counter()
    loss = float("nan")
    for step in range(WARMUP_STEPS, total):
        loss = train_step(ddp, optimizer, ModelKind.CAUSAL_LM, batch(step), settings)
    seconds = time.perf_counter() - started
    print(json.dumps({"rank": rank, "seconds": seconds, "loss": loss}), flush=True)
    sys.stdin.read()
    dist.destroy_process_group()


# ---- the run -------------------------------------------------------------------------------

#: Everything measured at each rate; each adds its own keys to the rate's figures.
MEASURES: tuple[Measure, ...] = (measure_ddp,)


async def measure_rate(rate: str, setup: Setup) -> dict[str, float]:
    figures: dict[str, float] = {}
    with wan_lab(RANKS, rate) as lab:
        for measure in MEASURES:
            figures.update(await measure(lab, setup))
    return figures


def _table(setup: Setup, rates: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    first = rates[setup.rates[0]]["ddp_step_s"]
    table = Table(title=f"data parallel, {RANKS} ranks over capped links ({setup.steps} timed steps each)")
    table.add_column("link (each site, both ways)")
    table.add_column("step", justify="right")
    table.add_column(f"x {setup.rates[0]}", justify="right")
    table.add_column("MB per step per rank", justify="right")
    for rate, row in rates.items():
        table.add_row(
            rate,
            f"{row['ddp_step_s'] * 1000:,.0f} ms",
            f"{row['ddp_step_s'] / first:.1f}",
            f"{row['ddp_bytes_per_step'] / 1e6:.2f}",
        )
    Console(highlight=False).print(table)


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
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_RATES}, {QUICK_STEPS} steps")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--rates", type=_rates_arg, help=f"comma-separated tc rates (default {RATES})")
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per rate (default {STEPS}, --quick {QUICK_STEPS})"
    )
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    # Progress bars and notices of model loading in every rank would bury the table.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if args.rank is not None:
        run_rank(args.rank, args.master, steps, args.model_dir)
        return
    if steps < 1:
        parser.error("--steps must be at least 1")

    from hypha.client.demo import BATCH
    from hypha.models import save_arithmetic_model

    require()
    scratch = Path(tempfile.mkdtemp(prefix="hypha-bench-wan-"))
    try:
        setup = Setup(
            rates=args.rates or _rates_arg(QUICK_RATES if args.quick else RATES),
            steps=steps,
            model_dir=save_arithmetic_model(scratch / "model", seed=0),
            quick=args.quick,
        )
        rates = {rate: asyncio.run(measure_rate(rate, setup)) for rate in setup.rates}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if not args.json:
        _table(setup, rates)
    speed = {rate: parse_rate(rate) or float("inf") for rate in setup.rates}
    slowest, fastest = min(speed, key=speed.__getitem__), max(speed, key=speed.__getitem__)
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
    )


if __name__ == "__main__":
    main()
