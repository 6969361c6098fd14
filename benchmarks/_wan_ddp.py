"""``benchmarks/wan.py``'s data-parallel side: DistributedDataParallel over gloo, one rank per
site of the lab (the setup and the figures are described in ``wan.py``'s docstring).

Each rank is this file run as a script inside its site's namespace (``--rank``); the
benchmark's process starts the ranks, tells them when to start timing, and reads the link
counters around the timed steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import demo_inner_settings

from hypha.testing.wan import SITE_LINK, LinkBytes, WanLab

RANKS = 2
#: Rank 0 saves the model this often in an accuracy-curve run.
CURVE_EVERY = 50
#: Untimed steps first: gloo connects and DDP broadcasts rank 0's parameters.
WARMUP_STEPS = 2
#: Rank 0's rendezvous port; nothing else listens in a fresh site namespace.
MASTER_PORT = 29500
#: Until a rank has started and taken its warmup steps (imports and a 20 Mbit/s link are slow).
READY_TIMEOUT_S = 300.0
#: Per timed step, beyond a fixed minute: ~2 s at 20 Mbit/s measured, far more is a hang.
STEP_TIMEOUT_S = 30.0
SCRIPT = Path(__file__).resolve()


async def measure_ddp(lab: WanLab, steps: int, model_dir: Path) -> dict[str, Any]:
    """Per-step data parallel, one rank per site, timed over ``steps`` steps (data order 0: the
    order changes the arithmetic, not the time)."""
    results, moved = await _run_ddp(lab, model_dir, steps)
    seconds = max(float(result["seconds"]) for result in results)
    per_rank = statistics.mean(link.total for link in moved[:RANKS])
    return {
        "ddp_step_s": round(seconds / steps, 4),
        "ddp_bytes_per_step": round(per_rank / steps),
        "ddp_loss": round(float(results[0]["loss"]), 4),
    }


async def measure_curve(
    lab: WanLab, steps: int, model_dir: Path, checkpoints: Path, heldout: int, order: int
) -> dict[str, float]:
    """Data parallel's held-out exact match against steps (``heldout`` sums) on data ``order``,
    step -> exact match, once per order: the link changes its time, not its arithmetic. Rank 0
    saves the model every ``CURVE_EVERY`` steps into ``checkpoints``; they are scored after the
    run, as ours are."""
    from hypha.client import demo_eval

    await _run_ddp(lab, model_dir, steps, checkpoints, order)
    data = demo_eval.heldout(heldout)
    curve: dict[str, float] = {}
    for step in range(CURVE_EVERY, steps + 1, CURVE_EVERY):
        model = demo_eval.load_model(model_dir, checkpoints / f"theta-{step}.safetensors")
        curve[str(step)] = round(demo_eval.score(model, data)[1], 4)
    return curve


async def _run_ddp(
    lab: WanLab, model_dir: Path, steps: int, curve_dir: Path | None = None, order: int = 0
) -> tuple[list[dict[str, Any]], list[LinkBytes]]:
    """Each rank's report of ``steps`` timed steps, and each site's bytes over them."""
    curve = ["--curve-dir", str(curve_dir)] if curve_dir is not None else []
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
            str(steps),
            "--model-dir",
            str(model_dir),
            "--order",
            str(order),
            *curve,
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
        timeout = 60.0 + steps * STEP_TIMEOUT_S
        results = await asyncio.gather(*(_line(rank, timeout) for rank in ranks))
        moved = [after - start for after, start in zip(lab.all_counters(), before, strict=True)]
    finally:
        await _stop(ranks)
    return results, moved


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


def run_rank(
    rank: int, master: str, steps: int, model_dir: Path, order: int, curve_dir: Path | None = None
) -> None:
    """One data-parallel rank (inside its site namespace): warm up, say so, wait for "go",
    time ``steps`` steps on data ``order`` (the rows of ``synthetic.arithmetic(seed=order)``),
    report them, and wait for stdin to close before leaving the group.
    With ``curve_dir``, rank 0 also saves the model there every ``CURVE_EVERY`` steps
    (warmup steps count: they trained too)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    from hypha.client import demo
    from hypha.datasets import synthetic
    from hypha.models import ModelKind
    from hypha.tensors.payload import encode_state
    from hypha.worker.executors.diloco_settings import make_inner_optimizer
    from hypha.worker.executors.inner_steps import train_step

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}", rank=rank, world_size=RANKS, timeout=timedelta(minutes=10)
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.train()
    ddp = DistributedDataParallel(model)
    settings = demo_inner_settings()
    optimizer = make_inner_optimizer(ddp, settings)
    total = WARMUP_STEPS + steps
    rows = synthetic.arithmetic(total * RANKS * demo.BATCH, seed=order).tensors

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
        if curve_dir is not None and rank == 0 and (step + 1) % CURVE_EVERY == 0:
            curve_dir.mkdir(parents=True, exist_ok=True)
            state = encode_state(dict(ddp.module.named_parameters()))
            (curve_dir / f"theta-{step + 1}.safetensors").write_bytes(state)
    seconds = time.perf_counter() - started
    print(json.dumps({"rank": rank, "seconds": seconds, "loss": loss}), flush=True)
    sys.stdin.read()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="one data-parallel rank of benchmarks/wan.py")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--order", type=int, default=0)
    parser.add_argument("--curve-dir", type=Path)
    args = parser.parse_args()
    # Notices of model loading in every rank would bury the benchmark's table.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    run_rank(args.rank, args.master, args.steps, args.model_dir, args.order, args.curve_dir)


if __name__ == "__main__":
    main()
