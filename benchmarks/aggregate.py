"""Parameter-server aggregation: 4 workers' deltas of a 25M-parameter model, averaged by samples
and stepped with Nesterov momentum, beside the bare torch ops doing the same arithmetic, in the
same run.

    python benchmarks/aggregate.py [--quick] [--sweep [--sizes 2,4,8,16]]

Ours: one round through ``ParameterServerCore`` as the parameter-server executor runs it:
``add_delta`` for each of the 4 workers (names and shapes checked), then ``maybe_complete``
(``NesterovOuter.step_average``: the weighted average accumulated in worker order straight into a
reused gradient buffer, tensor by tensor, each summed while still in cache to find NaN/inf; then
the Nesterov step; a snapshot of θ_global for publishing). Baseline: the same arithmetic written
as plain per-tensor torch ops (weighted sum with ``add_(alpha=w)``, ``buf = m*buf + g``,
``θ -= lr*(g + m*buf)``), no checks and no snapshot. The model is GPT-2-small-shaped (3 blocks
of 768 wide plus an embedding), about 25.1M fp32 parameters in 40 tensors.

figure = our median milliseconds per round; ratio = figure / baseline (lower is better; the
difference is the safety checks and the published snapshot). ``unchecked_ms`` is our path with
the NaN/inf check turned off (``reject_non_finite=False``), which shows what that check costs.
Results are compared, so the benchmark also fails loudly if they disagree. ``--sweep`` measures
a round at each worker count (default 2, 4, 8 and 16) and reports the series
(``_common.report_sweep``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from _common import median, report, report_sweep, sizes_arg

WORKERS = 4
SWEEP = [2, 4, 8, 16]
HIDDEN = 768
LAYERS = 3
VOCAB = 5000
LR, MOMENTUM = 0.7, 0.9


def _shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"wte": (VOCAB, HIDDEN), "wpe": (1024, HIDDEN)}
    for i in range(LAYERS):
        p = f"h.{i}."
        shapes |= {
            p + "ln_1.weight": (HIDDEN,),
            p + "ln_1.bias": (HIDDEN,),
            p + "attn.c_attn.weight": (HIDDEN, 3 * HIDDEN),
            p + "attn.c_attn.bias": (3 * HIDDEN,),
            p + "attn.c_proj.weight": (HIDDEN, HIDDEN),
            p + "attn.c_proj.bias": (HIDDEN,),
            p + "ln_2.weight": (HIDDEN,),
            p + "ln_2.bias": (HIDDEN,),
            p + "mlp.c_fc.weight": (HIDDEN, 4 * HIDDEN),
            p + "mlp.c_fc.bias": (4 * HIDDEN,),
            p + "mlp.c_proj.weight": (4 * HIDDEN, HIDDEN),
            p + "mlp.c_proj.bias": (HIDDEN,),
        }
    return shapes


def measure(worker_count: int, repeats: int) -> dict[str, Any]:
    """One PS round with ``worker_count`` deltas, ours (checked and unchecked) and the bare ops."""
    import torch

    from hypha.diloco.outer import NesterovOuter
    from hypha.diloco.server_core import ParameterServerCore
    from hypha.memtune import tune_malloc

    tune_malloc()  # as the parameter server's process does (its BridgeClient); the bare ops share it
    torch.set_num_threads(int(os.environ.get("HYPHA_TORCH_THREADS", os.cpu_count() or 1)))
    gen = torch.Generator().manual_seed(0)
    shapes = _shapes()
    theta0 = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    params = sum(t.numel() for t in theta0.values())
    workers = [f"w{i}" for i in range(worker_count)]
    samples = [(64, 128, 96, 32)[i % 4] for i in range(worker_count)]
    deltas = [{n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()} for _ in workers]

    core = ParameterServerCore(NesterovOuter(theta0, LR, MOMENTUM), workers, 60.0, 1.0)
    # The same without the NaN/inf check, to show what that check costs.
    unchecked = ParameterServerCore(
        NesterovOuter(theta0, LR, MOMENTUM), workers, 60.0, 1.0, reject_non_finite=False
    )

    def ours(server: ParameterServerCore, round_number: int) -> float:
        start = time.perf_counter()
        for worker, delta, n in zip(workers, deltas, samples, strict=True):
            receipt = server.add_delta(worker, round_number, n, delta, now=0.0)
            assert receipt.accepted, receipt.reason
        update = server.maybe_complete(now=0.0)
        assert update is not None
        return time.perf_counter() - start

    names = list(shapes)
    bare_theta = [theta0[n].clone() for n in names]
    bare_buf: list[torch.Tensor] | None = None
    weights = [n / sum(samples) for n in samples]

    def bare() -> float:
        nonlocal bare_buf
        start = time.perf_counter()
        avg = [deltas[0][n] * weights[0] for n in names]
        for delta, w in zip(deltas[1:], weights[1:], strict=True):
            for acc, name in zip(avg, names, strict=True):
                acc.add_(delta[name], alpha=w)
        grads = [a.neg_() for a in avg]
        if bare_buf is None:
            bare_buf = [g.clone() for g in grads]
        else:
            for b, g in zip(bare_buf, grads, strict=True):
                b.mul_(MOMENTUM).add_(g)
        for theta, g, b in zip(bare_theta, grads, bare_buf, strict=True):
            theta.add_(g.add_(b, alpha=MOMENTUM), alpha=-LR)
        return time.perf_counter() - start

    ours_s, unchecked_s, bare_s = [], [], []
    for r in range(repeats + 1):  # round 0 warms up all three (and creates the momentum buffers)
        o, u, b = ours(core, r), ours(unchecked, r), bare()
        if r:
            ours_s.append(o)
            unchecked_s.append(u)
            bare_s.append(b)

    final = core.outer.parameters()
    worst = max(float((final[n] - t).abs().max()) for n, t in zip(names, bare_theta, strict=True))
    assert worst < 1e-5, f"ours and the bare ops disagree by {worst}"
    ours_ms, bare_ms = median(ours_s) * 1e3, median(bare_s) * 1e3
    return dict(
        workers=worker_count,
        figure=round(ours_ms, 3),
        baseline=round(bare_ms, 3),
        ratio=round(ours_ms / bare_ms, 4),
        ours_ms_all=[round(x * 1e3, 1) for x in ours_s],
        bare_ms_all=[round(x * 1e3, 1) for x in bare_s],
        unchecked_ms=round(median(unchecked_s) * 1e3, 3),
        unchecked_ratio=round(median(unchecked_s) / median(bare_s), 4),
        parameters=params,
        threads=torch.get_num_threads(),
        max_abs_difference=worst,
    )


def main(quick: bool, sweep: list[int] | None) -> None:
    repeats = 3 if quick else 10
    if sweep:
        report_sweep("aggregate", "ms/round", "workers", [measure(n, repeats) for n in sweep])
        return
    point = measure(WORKERS, repeats)
    figure, base, ratio = point.pop("figure"), point.pop("baseline"), point.pop("ratio")
    report("aggregate", figure, "ms/round", base, ratio, **point)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="a round at several worker counts")
    parser.add_argument("--sizes", type=sizes_arg, default=SWEEP, help="worker counts for --sweep")
    args = parser.parse_args()
    main(args.quick, args.sizes if args.sweep else None)
