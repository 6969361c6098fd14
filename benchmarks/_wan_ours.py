"""``benchmarks/wan.py``'s other side: our DiLoCo job, end to end, on the same capped links.

Per rate and variant, a fresh local cluster (``hypha.testing.wan_cluster``: ``hypha up``'s
nodes, the gateways, data node and scheduler in the lab's hub, worker i behind site i's
capped link) runs the demo's job (``hypha.client.demo.job_toml``: 2 trainers and a parameter
server, the same dataset, model, seeds, batch, inner optimizer and samples per trainer), with
one torch thread per job as data parallel's ranks have. A driver process in the hub (the
lab's addresses exist only there) starts the cluster, submits, follows the job, copies each
θ_global the parameter server publishes (``demo.collect_thetas``: the file's mtime is when
the round's θ was written), reads the veth counters just before the submit and when the job
is over, and stops the cluster; this process then scores each kept θ on held-out sums
(``demo_eval.score``, greedy exact match) after the job, so scoring costs the training no CPU.

Variants (``VARIANTS``): ``default`` (the job file's defaults: int8 both ways and
``overlap_sync``, the same job as ``slow-link``), ``fp32`` (fp32 both ways, synchronous: the
defaults before 2026-11-30), ``int8`` (Δ up in int8 with error
feedback; θ_global comes down in fp32), ``compressed`` (int8 both ways: ``update_dtype =
"int8"`` sends each round's change of θ_global in int8), ``overlap`` (fp32 and ``overlap_sync``),
``slow-link`` (int8 both ways and ``overlap_sync``), ``streaming`` (fp32, 2 fragments, half the
samples a round and twice the rounds: the same inner steps between two syncs of a fragment,
the same samples in all), ``fit`` (int8 both ways, rounds fitted to the link: from 10
inner steps a round up to 200, ``max_samples_per_round``; twice the rounds).

Figures per rate, each ``{variant: median over --repeats runs}`` (run r on data order r):
``ours_time_to_target_s``, submit to the write of the first θ_global at or above the target
(None: never reached); ``ours_accuracy``, the last scored θ's held-out exact match;
``ours_seconds``, submit to the job's end; ``ours_start_s``, submit to θ_0 (scheduling and the
executors' start); ``ours_round_s``, the median time between two published θ;
``ours_samples_per_trainer``, the samples a trainer trained (mean over the trainers, from
their round metrics); ``ours_bytes``, every worker link's veth counters over the job, both
directions (a trainer's exchange with the parameter server counts on both links); ``ours_trainer_bytes``, a
trainer's own link (Δ up; θ_global and its data slices down; control traffic);
``utilization`` (see ``utilization``); ``ours_update_lag_batches`` (overlapped variants, see
``update_lag``); ``ours_curve``, per run, round -> [seconds since the
submit, samples per trainer, held-out exact match] of each scored θ.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _wan_figures import median_or_none

from hypha.client.demo import BATCH
from hypha.testing.wan import WanLab

SCRIPT = Path(__file__).resolve()
_FP32 = 'delta_dtype = "fp32"\nupdate_dtype = "fp32"'
_INT8 = 'delta_dtype = "int8"\nupdate_dtype = "int8"'
#: Variant -> (extra ``[job]`` lines, inner steps a round, rounds per demo round).
VARIANTS: dict[str, tuple[str, int, int]] = {
    # The job file's defaults (``hypha.jobfile.common.Defaults``: int8 both ways, overlap_sync).
    "default": ("", 50, 1),
    "fp32": (f"{_FP32}\noverlap_sync = false", 50, 1),
    "int8": ('delta_dtype = "int8"\nupdate_dtype = "fp32"\noverlap_sync = false', 50, 1),
    "compressed": (f"{_INT8}\noverlap_sync = false", 50, 1),
    "overlap": (f"{_FP32}\noverlap_sync = true", 50, 1),
    "slow-link": (f"{_INT8}\noverlap_sync = true", 50, 1),
    "streaming": (f"{_FP32}\nstreaming_fragments = 2", 25, 2),
    # Rounds fitted to the link: from 10 inner steps a round up to 200 (``link_fit``).
    "fit": (f"{_INT8}\noverlap_sync = false\nmax_samples_per_round = 25600", 10, 2),
}
#: Jobs get one torch thread, as each data-parallel rank has.
OVERRIDES = {"worker": ["worker.jobs.threads_per_job=1"]}
#: Cluster start, allocation and the executors' imports, before the first round.
START_TIMEOUT_S = 300.0
#: Per round, beyond that: ~11 s at 20 Mbit/s measured, far more is a hang.
ROUND_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class OursSetup:
    """What every run of ours shares: the job's length, what to run, and how to score it."""

    rounds: int
    variants: list[str]
    target: float
    #: Score every n-th round's θ (and the rounds just before the first that reaches the target).
    eval_every: int
    heldout: int
    #: Runs per variant; their medians are the figures. Run r trains on data order r (the
    #: round at which the model "gets" the sums moves with the order of the rows, and between
    #: runs of one order: the medians are over both, as data parallel's are over the orders).
    repeats: int
    #: The prepared datasets (``data-<order>/``) and initial model, copied into each cluster.
    template: Path
    work: Path
    #: Keep each run's cluster state (node logs, job state) after a successful run (``--keep``).
    keep: bool = False


def prepare_template(template: Path, rounds: int, orders: int) -> None:
    """The demo's dataset in ``orders`` data orders (seeds 0, 1, ...; each enough for ``rounds``
    demo rounds) and its initial model, made once."""
    from hypha.client import demo
    from hypha.datasets.prepare import prepare_synthetic
    from hypha.models import save_arithmetic_model

    samples = rounds * demo.SAMPLES_PER_ROUND
    for order in range(orders):
        data = template / f"data-{order}"
        prepare_synthetic(demo.DATASET, data, demo.DATASET, samples, demo.SAMPLES_PER_SLICE, seed=order)
    save_arithmetic_model(template / "models" / "arithmetic-gpt2", seed=0)


# ---- this process: one run per variant, then its figures ------------------------------------


async def measure(lab: WanLab, setup: OursSetup) -> dict[str, Any]:
    """Every variant at the lab's rate: per-variant figures under ``ours_*`` and ``utilization``."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for variant in setup.variants:
        for repeat in range(setup.repeats):
            run_dir = setup.work / lab.rate / variant / str(repeat)
            run = await _run(lab, setup, variant, run_dir, order=repeat)
            run["curve"] = score_curve(run, setup, run_dir / "thetas")
            runs.setdefault(variant, []).append(run)
    return figures(runs, setup.target)


async def _run(lab: WanLab, setup: OursSetup, variant: str, run_dir: Path, order: int) -> dict[str, Any]:
    settings, inner_steps, factor = VARIANTS[variant]
    state = run_dir / "state"
    shutil.rmtree(run_dir, ignore_errors=True)
    # Hard links: the dataset is read only, and copying it per run would cost a run's disk.
    shutil.copytree(setup.template / f"data-{order}", state / "data", copy_function=_link)
    shutil.copytree(setup.template / "models", state / "models")
    rounds = setup.rounds * factor
    spec = {
        "prefix": lab.prefix,
        "sites": len(lab.sites),
        "state": str(state),
        "thetas": str(run_dir / "thetas"),
        "rounds": rounds,
        "inner_steps": inner_steps,
        "settings": settings,
        "out": str(run_dir / "result.json"),
        "log": str(run_dir / "driver.log"),
    }
    (run_dir / "spec.json").write_text(json.dumps(spec))
    # Its output goes to driver.log (``_redirect``): --json's stdout is the result line only.
    driver = await lab.spawn(
        lab.hub, sys.executable, str(SCRIPT), str(run_dir / "spec.json"), stdout=asyncio.subprocess.DEVNULL
    )
    timeout = START_TIMEOUT_S + rounds * ROUND_TIMEOUT_S
    try:
        code = await asyncio.wait_for(driver.wait(), timeout)
    except TimeoutError:
        driver.kill()  # the lab's teardown ends the nodes it started
        await driver.wait()
        raise RuntimeError(f"ours ({variant}) at {lab.rate}: no result within {timeout:.0f} s") from None
    if code != 0:
        raise RuntimeError(f"ours ({variant}) at {lab.rate}: the driver exited {code}; see {run_dir}")
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    if result["state"] != "JOB_STATE_SUCCEEDED":
        raise RuntimeError(f"ours ({variant}) at {lab.rate}: job {result['state']}: {result['reason']}")
    result["samples_per_round"] = BATCH * inner_steps  # per trainer
    if not setup.keep:
        shutil.rmtree(state, ignore_errors=True)
    return result


def _link(src: str, dst: str) -> None:
    Path(dst).hardlink_to(src)


def score_curve(run: Mapping[str, Any], setup: OursSetup, thetas: Path) -> dict[int, float]:
    """Round -> held-out exact match of θ_global after it: every ``eval_every``-th round and the
    last, then back from the first that reached the target to the first round that did."""
    from hypha.client import demo_eval

    have = sorted(int(r) for r in run["thetas"])
    if not have:
        return {}
    data = demo_eval.heldout(setup.heldout)
    model_dir = setup.template / "models" / "arithmetic-gpt2"
    curve: dict[int, float] = {}

    def accuracy(r: int) -> float:
        if r not in curve:
            model = demo_eval.load_model(model_dir, thetas / run["thetas"][str(r)]["file"])
            curve[r] = round(demo_eval.score(model, data)[1], 4)
        return curve[r]

    for r in have:
        if r % setup.eval_every == 0 or r == have[-1]:
            accuracy(r)
    reached = [r for r in sorted(curve) if curve[r] >= setup.target]
    if reached:
        r = reached[0]
        while (earlier := r - 1) in have and accuracy(earlier) >= setup.target:
            r = earlier
    return dict(sorted(curve.items()))


#: Figures of one run, each a median over a variant's runs.
FIGURES = (
    "ours_time_to_target_s",
    "ours_accuracy",
    "ours_seconds",
    "ours_start_s",
    "ours_round_s",
    "ours_bytes",
    "ours_trainer_bytes",
    "ours_samples_per_trainer",
    "utilization",
    "ours_update_lag_batches",
)


def figures(runs: Mapping[str, Sequence[Mapping[str, Any]]], target: float) -> dict[str, Any]:
    """Per figure, variant -> the median of its runs; ``ours_time_to_target_runs_s`` and
    ``ours_curve`` keep every run's."""
    out: dict[str, dict[str, Any]] = {
        key: {} for key in (*FIGURES, "ours_time_to_target_runs_s", "ours_curve")
    }
    for variant, repeats in runs.items():
        each = [run_figures(run, target) for run in repeats]
        for key in FIGURES:
            out[key][variant] = median_or_none([figure[key] for figure in each])
        out["ours_time_to_target_runs_s"][variant] = [figure["ours_time_to_target_s"] for figure in each]
        out["ours_curve"][variant] = [figure["ours_curve"] for figure in each]
    return out


def run_figures(run: Mapping[str, Any], target: float) -> dict[str, Any]:
    curve: dict[int, float] = run["curve"]
    at = {int(r): float(theta["at"]) for r, theta in run["thetas"].items()}
    reached = [r for r in sorted(curve) if curve[r] >= target]
    times = [at[r] for r in sorted(at)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    links = [LinkTotal(**link) for link in run["links"]]
    trainers = [links[i].total for i in run["trainer_sites"]]
    return {
        # From the submit to when the first θ_global at or above the target was written.
        "ours_time_to_target_s": round(at[reached[0]], 1) if reached else None,
        "ours_accuracy": curve[max(curve)] if curve else None,
        "ours_seconds": round(run["seconds"], 1),
        # Submit to θ_0 published: scheduling, leases, the executors' start (no training yet).
        "ours_start_s": round(at[0], 1) if 0 in at else None,
        "ours_round_s": round(statistics.median(gaps), 2) if gaps else None,
        "ours_bytes": sum(link.total for link in links),
        "ours_trainer_bytes": round(statistics.mean(trainers)) if trainers else None,
        "ours_samples_per_trainer": samples_before(run, run["rounds"]),
        "utilization": run["utilization"],
        "ours_update_lag_batches": run.get("update_lag_batches"),
        # Round -> (seconds since the submit, samples per trainer, held-out exact match).
        "ours_curve": {str(r): [round(at[r], 1), samples_before(run, r), acc] for r, acc in curve.items()},
    }


def samples_by_round(points: Sequence[Any], trainers: Sequence[str]) -> dict[str, float]:
    """Round -> the samples a trainer trained in it (mean over ``trainers``), from their metrics.

    Not the planned figure: the scheduler splits a round between the trainers by their pace and
    each stops at the batch its directive names, so a round's total may be a batch off the plan,
    and rounds fitted to the link (``max_samples_per_round``) vary in size."""
    by_round = _by_round(points, trainers, "samples")
    return {str(r): statistics.mean(v) for r, v in sorted(by_round.items())}


def _by_round(points: Sequence[Any], trainers: Sequence[str], name: str) -> dict[int, list[float]]:
    """Round -> the values of metric ``name`` that ``trainers`` reported for it."""
    by_round: dict[int, list[float]] = {}
    for p in points:
        if p.name == name and p.worker_id in trainers:
            by_round.setdefault(int(p.round), []).append(p.value)
    return by_round


def samples_before(run: Mapping[str, Any], rounds: int) -> int:
    """A trainer's samples in the first ``rounds`` rounds (the planned size where a round
    reported none)."""
    reported = run.get("samples_by_round", {})
    return round(sum(reported.get(str(r), run["samples_per_round"]) for r in range(rounds)))


@dataclass(frozen=True)
class LinkTotal:
    sent: int
    received: int

    @property
    def total(self) -> int:
        return self.sent + self.received


# ---- the driver: in the hub namespace, one job on one fresh cluster -------------------------


def drive(spec: Mapping[str, Any]) -> None:
    from hypha.client.supervisor import Supervisor
    from hypha.testing.wan_cluster import lab_cluster

    lab = WanLab(spec["prefix"], spec["sites"])
    cluster = lab_cluster(lab, Path(spec["state"]), OVERRIDES)
    supervisor = Supervisor(cluster)
    try:
        supervisor.start_all()
        result = asyncio.run(_job(lab, supervisor, spec))
    finally:
        supervisor.stop_all()
    Path(spec["out"]).write_text(json.dumps(result))


async def _job(lab: WanLab, supervisor: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
    from hypha.client import demo, demo_eval
    from hypha.client.follow import TERMINAL, follow_job
    from hypha.net.channel import secure_channel
    from hypha.net.tls import PathsTls, TlsMaterial
    from hypha.v1 import common_pb2, scheduler_pb2_grpc

    cluster = supervisor.cluster
    model_dir = cluster.models_dir / "arithmetic-gpt2"
    toml = demo.job_toml(model_dir, spec["rounds"], spec["inner_steps"], spec["settings"])
    tls = TlsMaterial.load(PathsTls.from_certs_dir(cluster.pki_dir, "client"))
    thetas: dict[int, Path] = {}
    into = Path(spec["thetas"])
    async with secure_channel(tls, supervisor.info["scheduler"]["address"]) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        before = lab.all_counters()
        submitted = time.time()
        job = await demo.submit_when_announced(stub, toml, demo_eval.LiveView(quiet=True))
        job_id = job.job_id
        follow = asyncio.create_task(_last_event(follow_job(stub, job_id), TERMINAL))
        while not follow.done():
            # θ files are copied while the job runs: the parameter server prunes old ones.
            await asyncio.to_thread(demo.collect_thetas, cluster.state_dir, job_id, into, thetas)
            await asyncio.wait([follow], timeout=0.5)
        job = follow.result() or job
        seconds = time.time() - submitted
        after = lab.all_counters()
        await asyncio.to_thread(demo.collect_thetas, cluster.state_dir, job_id, into, thetas)
        points = await demo._final_metrics(stub, job_id, spec["rounds"])
    peers = {supervisor.info[f"worker{site.index}"]["peer_id"]: site.index for site in lab.sites}
    # The parameter server reports round metrics too; only trainers report training speed.
    trainer_ids = sorted(
        {p.worker_id for p in points if p.name == "samples_per_second" and p.worker_id in peers}
    )
    return {
        "state": common_pb2.JobState.Name(job.state),
        "reason": job.reason,
        "rounds": spec["rounds"],
        "seconds": seconds,
        "thetas": {
            str(r): {"file": path.name, "at": path.stat().st_mtime - submitted} for r, path in thetas.items()
        },
        "links": [
            asdict(LinkTotal(a.sent - b.sent, a.received - b.received))
            for a, b in zip(after, before, strict=True)
        ],
        "trainer_sites": [peers[w] for w in trainer_ids],
        "utilization": utilization(points, trainer_ids),
        "samples_by_round": samples_by_round(points, trainer_ids),
        "update_lag_batches": update_lag(points, trainer_ids),
        # Every round metric the job reported (trainers and parameter server), for a closer look.
        "metrics": [
            [p.round, p.worker_id, p.name, p.value, p.at.ToMicroseconds() / 1e6 - submitted] for p in points
        ],
    }


async def _last_event(events: AsyncIterator[Any], terminal: frozenset[int]) -> Any:
    """The job as its last event showed it (its final state, unless the stream ended first)."""
    job = None
    async for event in events:
        job = event.job
        if job.state in terminal:
            break
    return job


def utilization(points: Sequence[Any], trainers: Sequence[str]) -> float | None:
    """The trainers' mean fraction of wall time spent in inner steps, from their own reports.

    A trainer's round metrics carry its samples and samples per second of training time
    (``train_seconds``: the inner steps alone); the scheduler stamps each report's arrival.
    Between its first and its last report a trainer spent the training time of the rounds
    after the first: that over the time between the two reports.
    """
    fractions = []
    for worker in trainers:
        rounds: dict[int, dict[str, float]] = {}
        stamps: dict[int, float] = {}
        for p in points:
            if p.worker_id == worker and p.name in ("samples", "samples_per_second"):
                rounds.setdefault(p.round, {})[p.name] = p.value
                stamps[p.round] = max(stamps.get(p.round, 0.0), p.at.ToMicroseconds() / 1e6)
        done = sorted(r for r, v in rounds.items() if v.get("samples_per_second", 0.0) > 0 and "samples" in v)
        if len(done) < 2:
            continue
        span = stamps[done[-1]] - stamps[done[0]]
        training = sum(rounds[r]["samples"] / rounds[r]["samples_per_second"] for r in done[1:])
        if span > 0:
            fractions.append(min(1.0, training / span))
    return round(statistics.mean(fractions), 3) if fractions else None


def update_lag(points: Sequence[Any], trainers: Sequence[str]) -> float | None:
    """Overlapped rounds: the median over trainers and rounds of the batches trained while an
    update was on its way (the trainers' ``update_lag_batches``; the last round's, landing after
    the last step, left out). None: synchronous rounds."""
    by_round = _by_round(points, trainers, "update_lag_batches")
    lags = [lag for r in sorted(by_round)[:-1] for lag in by_round[r]]
    return statistics.median(lags) if lags else None


def _redirect(log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


if __name__ == "__main__":
    SPEC = json.loads(Path(sys.argv[1]).read_text())
    _redirect(Path(SPEC["log"]))
    drive(SPEC)
