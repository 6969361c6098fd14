"""Round efficiency: how much worker time is lost waiting at DiLoCo sync points.

Workers of different speeds train between syncs; a round ends when the last
one arrives, and everyone who arrived earlier idles until then. We measure
the fraction of worker time spent idle at sync points with the scheduler's
performance-aware planner (``hypha.scheduler.diloco.round_planner.RoundPlanner``: each
worker is told how many more batches to run so all arrive together) against
the baseline of equal batch counts per worker (``hypha.testing.rounds_sim.EqualBatchPlanner``), both
on the same simulated workers in the same run. The simulation is a
discrete-event one driving the real planner code: every batch is reported
to the planner and its directive obeyed; batch durations carry 10% noise.

Scenarios: one worker at a third of the others' speed (the issue's case), a
spread of six speeds, and mixed batch sizes (GPU-sized batches on faster
workers). Figure: median idle fraction of the spread scenario, ours;
baseline: the same with equal batch counts; ratio = ours / baseline.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import median, report

from hypha.scheduler.diloco.round_planner import Planner, RoundPlanner
from hypha.testing.rounds_sim import EqualBatchPlanner, SimWorker, heterogeneous_workers, simulate

SAMPLES_PER_ROUND = 4096


def scenarios() -> dict[str, list[SimWorker]]:
    return {
        "one_third": heterogeneous_workers([1.0, 1.0, 1.0, 1 / 3], batch_size=16, jitter=0.1),
        "spread": heterogeneous_workers([2.0, 1.5, 1.0, 0.8, 0.5, 0.33], batch_size=16, jitter=0.1),
        "mixed_batches": [
            SimWorker("a100", 64, 0.20, 0.1),
            SimWorker("a10", 32, 0.25, 0.1),
            SimWorker("t4", 16, 0.30, 0.1),
            SimWorker("cpu", 8, 1.20, 0.1),
        ],
    }


def run(planner: Planner, workers: list[SimWorker], rounds: int, seed: int) -> dict[str, float]:
    result = simulate(planner, workers, rounds, seed=seed)
    return {"idle": result.idle_fraction, "wall_s": sum(result.round_seconds)}


def main(quick: bool) -> None:
    seeds = range(5 if quick else 25)
    rounds = 10 if quick else 30
    results: dict[str, dict[str, list[float]]] = {}
    per_report_us: list[float] = []
    for name, workers in scenarios().items():
        ours, base, speedup = [], [], []
        for seed in seeds:
            mine = run(RoundPlanner(SAMPLES_PER_ROUND, rounds), workers, rounds, seed)
            equal = run(EqualBatchPlanner(SAMPLES_PER_ROUND, rounds), workers, rounds, seed)
            ours.append(mine["idle"])
            base.append(equal["idle"])
            speedup.append(equal["wall_s"] / mine["wall_s"])
        results[name] = {"ours": ours, "baseline": base, "speedup": speedup}
    # Planner cost: wall-clock time per progress report in the spread scenario.
    workers = scenarios()["spread"]
    planner = RoundPlanner(SAMPLES_PER_ROUND, rounds)
    started = time.perf_counter()
    result = simulate(planner, workers, rounds, seed=0)
    elapsed = time.perf_counter() - started
    by_size = {w.worker_id: w.batch_size for w in workers}
    calls = sum(n // by_size[w] for r in result.samples for w, n in r.items())
    per_report_us.append(elapsed / calls * 1e6)
    lookahead: dict[str, float] = {}
    for fraction in (0.1, 0.25, 0.5):
        idle = [
            simulate(
                RoundPlanner(SAMPLES_PER_ROUND, rounds, lookahead=fraction), workers, rounds, seed=s
            ).idle_fraction
            for s in seeds
        ]
        lookahead[str(fraction)] = round(median(idle), 5)

    m: dict[str, Any] = {}
    for name, r in results.items():
        m[f"{name}_idle_ours"] = round(median(r["ours"]), 5)
        m[f"{name}_idle_equal_batches"] = round(median(r["baseline"]), 5)
        m[f"{name}_wall_speedup"] = round(median(r["speedup"]), 3)
    for name, r in results.items():
        print(
            f"{name:14s} idle at sync points: performance-aware {median(r['ours']):.4f}, "
            f"equal batch counts {median(r['baseline']):.4f}; "
            f"rounds finish {median(r['speedup']):.2f}x sooner"
        )
    print(f"planner: {per_report_us[0]:.1f} us per progress report; idle by look-ahead fraction: {lookahead}")
    headline = results["spread"]
    figure, baseline = median(headline["ours"]), median(headline["baseline"])
    report(
        "rounds",
        figure,
        "fraction of worker time idle at sync points",
        baseline,
        figure / baseline,
        scenario="spread (speeds 2, 1.5, 1, 0.8, 0.5, 0.33; 10% noise)",
        seeds=len(seeds),
        rounds=rounds,
        samples_per_round=SAMPLES_PER_ROUND,
        planner_us_per_report=round(per_report_us[0], 2),
        idle_by_lookahead=lookahead,
        **m,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer seeds and rounds (seconds)")
    main(parser.parse_args().quick)
