"""``hypha demo``: the main job a newcomer runs first, and what it shows.

It brings up the local cluster if none is running (and stops it again
afterwards), prepares the synthetic arithmetic dataset (3-digit sums, answers
reversed, held-out pairs never trained on) and a 0.6M-parameter GPT-2,
submits a DiLoCo job (two trainers and a parameter server, all leased through
the market), shows live progress, fetches the trained model and reports:

- the loss on answer tokens of the initial and the fetched model, on held-out
  sums (the prompt's random digits are not in the loss: nothing to learn there);
- held-out exact match by greedy generation, before, after, and along the way:
  the parameter server writes θ_global after every round into its work dir
  (``published/theta-<round>.safetensors``, the files it serves to trainers);
  on the local cluster the demo copies them as they appear and scores them
  after the job, so the curve costs the training no CPU;
- the tensor bytes the workers measured on the wire for this job, beside the
  computed figure for per-step data-parallel training;
- a matplotlib PNG of loss, accuracy and per-worker throughput by round.

Settings and why they are what they are: the README, "What ``hypha demo`` does".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from hypha.client import demo_eval
from hypha.client.cluster import Cluster
from hypha.client.follow import TERMINAL, follow_job
from hypha.client.plot import training_plot
from hypha.client.supervisor import stop_process
from hypha.client.worker_names import WorkerNames
from hypha.errors import HyphaError
from hypha.filestream import receive_files
from hypha.net.channel import secure_channel
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

DATASET = "arithmetic"
TRAINERS = 2
BATCH = 64
#: Inner AdamW steps each trainer takes between two syncs.
INNER_STEPS = 50
ROUNDS = 60
#: How long the demo waits for a just-prepared dataset to be announced (data.announce_poll_s is 10 s).
ANNOUNCE_WAIT_S = 60.0
SAMPLES_PER_ROUND = TRAINERS * INNER_STEPS * BATCH
#: One slice is one trainer's round, so slices and rounds line up.
SAMPLES_PER_SLICE = INNER_STEPS * BATCH
#: 2e-3 rather than 3e-3 (the value before the wider position embeddings): in an in-process
#: probe with 3e-3 one data order of five stayed on the plateau past 1,500 data-parallel
#: steps, with 2e-3 none did.
INNER_LR = 2e-3
#: β2 0.95 instead of 0.999: Adam's step-size estimate follows the gradients faster, which
#: keeps a long plateau from ending in a loss spike (seen with 0.999 after ~1,000 steps).
INNER_BETAS = (0.9, 0.95)
#: Each step's gradient norm clipped to 1.0, the rate warmed up over each trainer's first two
#: rounds: without them the loss sat on its plateau for a varying 10 to 60+ rounds.
INNER_MAX_GRAD_NORM = 1.0
INNER_WARMUP_ROUNDS = 2
#: AdamW's decoupled weight decay, 0.1 rather than the job file's 0.01: with the model's wider
#: position embeddings (``hypha.models.ARITHMETIC_POSITION_STD``) and this rate, the step at
#: which the model leaves its plateau moves far less with the data order (either change alone
#: still left some order on it: docs/performance.md, "A steadier exit from the plateau").
INNER_WEIGHT_DECAY = 0.1
OUTER_LR = 1.0
OUTER_MOMENTUM = 0.0
#: Points of the accuracy curve (besides before and after).
CURVE_POINTS = 10


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def prepare(cluster: Cluster, rounds: int, say: Callable[[str], None]) -> Path:
    """The dataset (large enough that no trainer sees a sample twice) and the initial model."""
    from hypha.datasets.format import Dataset
    from hypha.datasets.prepare import prepare_synthetic
    from hypha.datasets.synthetic import ARITHMETIC_FORMAT
    from hypha.models import refresh_arithmetic_model

    cluster.data_dir.mkdir(parents=True, exist_ok=True)
    target = cluster.data_dir / DATASET
    needed = rounds * SAMPLES_PER_ROUND
    have, current = 0, True
    if (target / "manifest.json").exists():
        manifest = Dataset.open(target).manifest
        have = manifest.sample_count
        current = manifest.metadata.get("format") == ARITHMETIC_FORMAT
    if (have < needed or not current) and (have == 0 or cluster.running() is None):
        say(f"preparing {needed:,} fresh arithmetic problems (held-out pairs excluded) ...")
        prepare_synthetic(
            DATASET, cluster.data_dir, DATASET, needed, SAMPLES_PER_SLICE, seed=0, overwrite=have > 0
        )
    elif have < needed or not current:
        say(f"note: the running cluster serves an older or smaller {DATASET} dataset ({have:,} samples)")
    model_dir = cluster.models_dir / "arithmetic-gpt2"
    had = (model_dir / "config.json").exists()
    if refresh_arithmetic_model(model_dir) and had:
        say(f"replaced {model_dir}: it held an earlier release's initial model")
    return model_dir


def job_toml(model_dir: Path, rounds: int, inner_steps: int = INNER_STEPS, settings: str = "") -> str:
    """The demo's job; ``settings`` are more ``[job]`` lines (``benchmarks/wan.py``'s variants:
    ``delta_dtype = "int8"``, ``overlap_sync = true``)."""
    return f"""
[job]
name = "demo-arithmetic"
dataset = "{DATASET}"
rounds = {rounds}
samples_per_round = {TRAINERS * inner_steps * BATCH}
min_batch_size = {BATCH}
max_batch_size = {BATCH}
quorum = 0.5
round_timeout_s = 120
{settings}

[job.model]
local_path = {json.dumps(str(model_dir))}
type = "causal-lm"

[job.inner_optimizer]
learning_rate = {INNER_LR}
betas = [{INNER_BETAS[0]}, {INNER_BETAS[1]}]
max_grad_norm = {INNER_MAX_GRAD_NORM}
weight_decay = {INNER_WEIGHT_DECAY}
warmup_steps = {INNER_WARMUP_ROUNDS * inner_steps}

[job.outer_optimizer]
learning_rate = {OUTER_LR}
momentum = {OUTER_MOMENTUM}

[job.resources]
num_workers = {TRAINERS}
"""


def ensure_cluster(cluster: Cluster, timeout_s: float = 120.0) -> subprocess.Popen[bytes] | None:
    """Start ``hypha up`` in the background unless a cluster runs; returns what to stop later."""
    if cluster.running():
        return None
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    log = open(cluster.state_dir / "up.log", "ab")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hypha.client.cli",
            "up",
            "--state-dir",
            str(cluster.state_dir),
            "--workers",
            str(cluster.workers),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while cluster.running() is None:
        if proc.poll() is not None:
            raise RuntimeError(f"hypha up exited with {proc.returncode}; see {cluster.state_dir / 'up.log'}")
        if time.monotonic() > deadline:
            stop_process(proc)
            raise RuntimeError("the local cluster did not come up in time")
        time.sleep(0.1)
    return proc


@dataclass
class JobRun:
    """What the demo learnt about its job while it ran."""

    job_id: str = ""
    seconds: float = 0.0
    #: Round -> θ_global after that many rounds, copied from the parameter server's work dir.
    thetas: dict[int, Path] = field(default_factory=dict)
    metrics: list[scheduler_pb2.MetricPoint] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)


def collect_thetas(state_dir: Path, job_id: str, into: Path, have: dict[int, Path]) -> None:
    """Copy the θ_global files the job's parameter server published since the last call.

    The server writes them in place, so a file may still be being written: a copy
    that safetensors cannot read whole is dropped and taken again next call. (Waiting
    for a newer file instead lost the last-but-one θ: the server's work dir is swept
    as soon as the job ends.)
    """
    found: dict[int, Path] = {}
    # os.walk, not Path.glob: nodes remove their own job dirs (the scheduler's ps-state
    # copies, finished work dirs) while this walks, and walk skips what vanished.
    for folder, _dirs, files in os.walk(state_dir / "nodes"):
        here = Path(folder)
        if here.name != "published" or not here.parent.name.startswith(job_id):
            continue
        for name in files:
            stem = name.removeprefix("theta-").removesuffix(".safetensors")
            if name.startswith("theta-") and name.endswith(".safetensors") and stem.isdigit():
                found[int(stem)] = here / name
    for number, path in found.items():
        if number in have:
            continue
        into.mkdir(parents=True, exist_ok=True)
        try:
            copy = Path(shutil.copy2(path, into / path.name))
        except FileNotFoundError:  # pruned by the parameter server meanwhile
            continue
        if _complete(copy):
            have[number] = copy
        else:
            copy.unlink(missing_ok=True)


def _complete(path: Path) -> bool:
    """Whether a safetensors file holds every byte its header declares."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError, ValueError):
        return False
    return True


async def _collect_while(
    stop: asyncio.Event, state_dir: Path, job_id: str, into: Path, have: dict[int, Path]
) -> None:
    """Collect θ files every half second until ``stop``: watch events alone come too late for
    a round whose file is written after the scheduler heard the round complete."""
    while not stop.is_set():
        await asyncio.to_thread(collect_thetas, state_dir, job_id, into, have)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


async def run_job(
    tls: TlsMaterial,
    address: str,
    model_dir: Path,
    cluster: Cluster | None,
    rounds: int,
    view: demo_eval.LiveView,
    results: Path,
    server_name: str | None = None,
    inner_steps: int = INNER_STEPS,
) -> JobRun:
    """Submit, watch, fetch. ``cluster`` is the local one (its θ_global files give the
    accuracy curve), or ``None`` for a cluster elsewhere (compose, remote): then only
    the initial and the fetched model are scored."""
    run = JobRun()
    result_dir = results / "demo"
    thetas_dir = results / "demo-rounds"
    shutil.rmtree(thetas_dir, ignore_errors=True)
    async with secure_channel(tls, address, server_name=server_name) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        t0 = time.monotonic()
        job = await submit_when_announced(stub, job_toml(model_dir, rounds, inner_steps), view)
        run.job_id = job.job_id
        names = WorkerNames(stub, node_names(cluster) if cluster is not None else {})
        await names.learn([])
        run.names = view.names = names.known
        view.submitted(job.job_id, rounds)
        stop = asyncio.Event()
        collector = None
        if cluster is not None:
            collector = asyncio.create_task(
                _collect_while(stop, cluster.state_dir, run.job_id, thetas_dir, run.thetas)
            )
        try:
            async for event in follow_job(stub, run.job_id, on_lost=view.note):
                job = event.job
                await names.learn([w.worker_id for w in event.workers])
                view.event(job.round, job.loss, [(w.worker_id, w.samples_per_second) for w in event.workers])
                if job.state in TERMINAL:
                    break
        finally:
            stop.set()
            if collector is not None:
                await collector
        run.seconds = time.monotonic() - t0
        view.done()
        if job.state != common_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"job {run.job_id} ended {common_pb2.JobState.Name(job.state)}: {job.reason}")
        # The same checked download as `hypha fetch`.
        stream = stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=run.job_id), timeout=120)
        await receive_files(((piece.path, piece.chunk) async for piece in stream), result_dir)
        run.metrics = await _final_metrics(stub, run.job_id, rounds)
    return run


async def submit_when_announced(
    stub: scheduler_pb2_grpc.SchedulerStub, toml: str, view: demo_eval.LiveView
) -> scheduler_pb2.Job:
    """Submit, waiting up to ``ANNOUNCE_WAIT_S`` for the dataset to be announced.

    On a cluster that was already running (``hypha up`` in another terminal) the
    dataset was just prepared, and its data node announces it only at its next
    look at the data dir (``data.announce_poll_s``): the scheduler refuses the job
    until then.
    """
    deadline = time.monotonic() + ANNOUNCE_WAIT_S
    told = False
    while True:
        try:
            return await stub.SubmitJob(scheduler_pb2.SubmitJobRequest(toml=toml), timeout=30)
        except grpc.aio.AioRpcError as err:
            unannounced = err.code() is grpc.StatusCode.NOT_FOUND and "announces" in (err.details() or "")
            if not unannounced or time.monotonic() >= deadline:
                raise
            if not told:
                view.note("waiting for the data node to announce the dataset ...")
                told = True
            await asyncio.sleep(1.0)  # polling the scheduler with a deadline


def node_names(cluster: Cluster) -> dict[str, str]:
    """Peer id -> node name of the local cluster's nodes, read from their certificates."""
    from hypha.pki.identity import identity_of_pem

    names = {}
    for name, _ in cluster.node_names():
        cert = cluster.pki_dir / f"{name}-cert.pem"
        if cert.is_file():
            names[identity_of_pem(cert.read_bytes()).peer_id] = name
    return names


async def _final_metrics(
    stub: scheduler_pb2_grpc.SchedulerStub, job_id: str, rounds: int, wait_s: float = 10.0
) -> list[scheduler_pb2.MetricPoint]:
    """The job's metrics, once every trainer's last round is in (they may trail the end by a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        reply = await stub.GetJobMetrics(scheduler_pb2.GetJobMetricsRequest(job_id=job_id), timeout=10)
        points = list(reply.points)
        last = {p.worker_id for p in points if p.name == "loss" and p.round == rounds - 1}
        if len(last) >= TRAINERS or time.monotonic() > deadline:
            return points
        await asyncio.sleep(0.2)


def demo(state_dir: Path, workers: int, output: str, rounds: int = ROUNDS) -> int:
    cluster = Cluster(state_dir, max(workers, TRAINERS + 1))
    quiet = output == "json"
    view = demo_eval.LiveView(quiet)
    started = None
    try:
        _quiet_transformers()
        model_dir = prepare(cluster, rounds, view.say)
        view.say(
            f"starting the local cluster in {state_dir} ..."
            if not cluster.running()
            else "using the running cluster"
        )
        started = ensure_cluster(cluster)
        state = cluster.running()
        assert state is not None
        tls = TlsMaterial.load(PathsTls.from_certs_dir(cluster.pki_dir, "client"))
        results = cluster.state_dir / "results"
        run = asyncio.run(
            run_job(tls, state["nodes"]["scheduler"]["address"], model_dir, cluster, rounds, view, results)
        )
        return _finish(run, model_dir, results, rounds, view)
    except (RuntimeError, HyphaError, grpc.aio.AioRpcError) as err:
        return _failed(err, view)
    finally:
        if started is not None:
            stop_process(started, grace_s=30)


def demo_remote(
    address: str,
    tls: TlsMaterial,
    output: str,
    model_path: str,
    out_dir: Path,
    rounds: int = ROUNDS,
    server_name: str | None = None,
    inner_steps: int = INNER_STEPS,
) -> int:
    """The demo on a cluster started elsewhere (``docker compose up``, a real deployment).

    The cluster must serve the ``arithmetic`` dataset and hold the demo's initial
    model at ``model_path`` on its workers (compose does both). The same model is
    made here from the same seed to score the "before" figures; the trained one
    is fetched into ``out_dir``.
    """
    from hypha.models import save_arithmetic_model

    view = demo_eval.LiveView(output == "json")
    try:
        _quiet_transformers()
        local_initial = out_dir / "initial"
        if not (local_initial / "config.json").exists():
            save_arithmetic_model(local_initial, seed=0)
        view.say(f"training {model_path} on the cluster at {address} ...")
        run = asyncio.run(
            run_job(
                tls,
                address,
                Path(model_path),
                None,
                rounds,
                view,
                out_dir,
                server_name=server_name,
                inner_steps=inner_steps,
            )
        )
        return _finish(run, local_initial, out_dir, rounds, view, inner_steps)
    except (RuntimeError, HyphaError, grpc.aio.AioRpcError) as err:
        return _failed(err, view)


def _finish(
    run: JobRun,
    initial: Path,
    results: Path,
    rounds: int,
    view: demo_eval.LiveView,
    inner_steps: int = INNER_STEPS,
) -> int:
    """Score, plot and report a finished demo job; exit status 0 when the held-out loss fell."""
    view.say("scoring θ_global on held-out sums (greedy generation) ...")
    report = demo_eval.report(
        run, initial, results, rounds=rounds, trainers=TRAINERS, inner_steps=inner_steps, points=CURVE_POINTS
    )
    report.update(
        job_id=run.job_id,
        rounds=rounds,
        workers=TRAINERS,
        seconds=round(run.seconds, 1),
        model=str((results / "demo").resolve()),
    )
    figures = demo_eval.figures(run.metrics, run.names)
    title = (
        f"hypha demo: DiLoCo, {TRAINERS} trainers x {inner_steps} inner steps x {rounds} rounds "
        f"(held-out exact match {report['accuracy_after']:.0%})"
    )
    plot = training_plot(
        figures.losses,
        {int(k): v for k, v in report["accuracy_curve"].items()},
        figures.throughput,
        results / "demo.png",
        title=title,
    )
    report["plot"] = str(plot.resolve())
    view.final(report)
    return 0 if report["final_loss"] < report["initial_loss"] else 1


def _failed(err: Exception, view: demo_eval.LiveView) -> int:
    view.done()
    message = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
    print(f"hypha demo: error: {message}", file=sys.stderr)
    return 1
