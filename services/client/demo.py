"""``hypha demo``: the main job a newcomer runs first.

It brings up the local cluster if none is running (and stops it again
afterwards), prepares the synthetic arithmetic dataset and a tiny GPT-style
causal LM, submits a DiLoCo job (two trainers and a parameter server, all
leased through the market), shows live progress, fetches the trained model
and reports: initial and final loss, exact-match accuracy on held-out sums
before and after, the bytes DiLoCo exchanged beside what per-step
data-parallel training would have exchanged, and a PNG of the loss curve.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from hypha.client.cli import FileSink
from hypha.client.cluster import Cluster, stop_process
from hypha.client.plot import line_plot
from hypha.errors import HyphaError
from hypha.net.channel import secure_channel
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

DATASET = "arithmetic"
ROUNDS = 20
SAMPLES_PER_ROUND = 1024
BATCH = 16
TRAINERS = 2
HELDOUT = 100
TERMINAL = {common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED}


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def prepare(cluster: Cluster) -> Path:
    """The dataset and the initial model, written before the nodes start (reused later)."""
    from hypha.data.prepare import prepare_synthetic
    from hypha.worker.executors.models import save_tiny_model

    cluster.data_dir.mkdir(parents=True, exist_ok=True)
    if not (cluster.data_dir / DATASET).exists():
        prepare_synthetic(DATASET, cluster.data_dir, DATASET, samples=4096, samples_per_slice=64, seed=0)
    model_dir = cluster.models_dir / "tiny-gpt2"
    if not (model_dir / "config.json").exists():
        save_tiny_model("causal-lm", model_dir, seed=0)
    return model_dir


def job_toml(model_dir: Path, rounds: int) -> str:
    return f"""
[job]
name = "demo-arithmetic"
dataset = "{DATASET}"
rounds = {rounds}
samples_per_round = {SAMPLES_PER_ROUND}
min_batch_size = {BATCH}
max_batch_size = {BATCH}
quorum = 0.5
round_timeout_s = 30

[job.model]
local_path = {json.dumps(str(model_dir))}
type = "causal-lm"

[job.inner_optimizer]
learning_rate = 0.005

[job.outer_optimizer]
learning_rate = 0.7
momentum = 0.9

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


def evaluate(model_dir: Path, data_dir: Path) -> tuple[float, float]:
    """(loss on the first slices, exact-match accuracy on held-out sums) of a saved model."""
    import torch
    from transformers import AutoModelForCausalLM

    from hypha.data.synthetic import decode_bytes, encode_bytes, exact_match_accuracy, heldout_sums
    from hypha.worker.executors.models import ModelKind
    from hypha.worker.executors.training import evaluate_loss, load_slice

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    slices = sorted((data_dir / DATASET).glob("slice-*.safetensors"))[:4]
    loss = evaluate_loss(model, ModelKind.CAUSAL_LM, [load_slice(path) for path in slices])

    def generate(prompt: str) -> str:
        # Greedy decoding by hand: transformers' generate() costs ~100x more per call on a model this small.
        ids = encode_bytes(prompt)
        out: list[int] = []
        with torch.no_grad():
            for _ in range(4):
                logits = model(torch.tensor([ids + out])).logits[0, -1]
                token = int(logits.argmax())
                if token >= 256 or token == ord("\n"):
                    break
                out.append(token)
        return decode_bytes(out)

    return loss, exact_match_accuracy(generate, heldout_sums(HELDOUT, seed=0))


async def run_job(
    tls: TlsMaterial, address: str, model_dir: Path, out_dir: Path, rounds: int, say: Any
) -> dict[str, Any]:
    curve: list[tuple[int, float]] = []
    async with secure_channel(tls, address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        job = await stub.SubmitJob(
            scheduler_pb2.SubmitJobRequest(toml=job_toml(model_dir, rounds)), timeout=10
        )
        job_id = job.job_id
        say(f"submitted DiLoCo job {job_id}: {TRAINERS} trainers + 1 parameter server, {rounds} rounds")
        last_round = -1
        async for event in stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id), timeout=900):
            job = event.job
            if job.round != last_round and job.loss > 0:
                last_round = job.round
                curve.append((job.round, job.loss))
                speeds = ", ".join(f"{w.worker_id[:8]} {w.samples_per_second:.0f}/s" for w in event.workers)
                say(f"  round {job.round}/{rounds}  loss {job.loss:.3f}  {speeds}")
            if job.state in TERMINAL:
                break
        if job.state != common_pb2.JOB_STATE_SUCCEEDED:
            raise RuntimeError(f"job {job_id} ended {common_pb2.JobState.Name(job.state)}: {job.reason}")
        sink = FileSink(out_dir)  # the same checked download as `hypha fetch`
        try:
            async for piece in stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=job_id), timeout=120):
                sink.feed(piece)
        except BaseException:
            sink.abort()
            raise
        sink.close()
    return {"job_id": job_id, "curve": curve}


def demo(state_dir: Path, workers: int, output: str, rounds: int = ROUNDS) -> int:
    cluster = Cluster(state_dir, max(workers, TRAINERS + 1))
    quiet = output == "json"

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    started = None
    try:
        _quiet_transformers()
        model_dir = prepare(cluster)
        say(
            f"starting the local cluster in {state_dir} ..."
            if not cluster.running()
            else "using the running cluster"
        )
        started = ensure_cluster(cluster)
        state = cluster.running()
        assert state is not None
        tls = TlsMaterial.load(PathsTls.from_certs_dir(cluster.pki_dir, "client"))
        result_dir = cluster.state_dir / "results" / "demo"
        result_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        ran = asyncio.run(
            run_job(tls, state["nodes"]["scheduler"]["address"], model_dir, result_dir, rounds, say)
        )
        elapsed = time.monotonic() - t0
        say("evaluating the initial and the trained model on held-out sums ...")
        loss_before, acc_before = evaluate(model_dir, cluster.data_dir)
        loss_after, acc_after = evaluate(result_dir, cluster.data_dir)
        params = sum(p.numel() for p in _load(result_dir).parameters())
        param_bytes = 4 * params
        # DiLoCo: each trainer sends one delta and receives one update per round.
        exchanged = 2 * param_bytes * TRAINERS * rounds
        # Data-parallel: every inner step all-reduces the gradients (≈ send + receive the model).
        steps_per_trainer = rounds * SAMPLES_PER_ROUND // (TRAINERS * BATCH)
        data_parallel = 2 * param_bytes * TRAINERS * steps_per_trainer
        curve = ran["curve"]
        plot = line_plot(
            [float(r) for r, _ in curve],
            [loss for _, loss in curve],
            cluster.state_dir / "results" / "demo-loss.png",
        )
        report = {
            "job_id": ran["job_id"],
            "initial_loss": round(loss_before, 4),
            "final_loss": round(loss_after, 4),
            "accuracy_before": round(acc_before, 4),
            "accuracy_after": round(acc_after, 4),
            "bytes_exchanged": exchanged,
            "data_parallel_bytes": data_parallel,
            "rounds": rounds,
            "workers": TRAINERS,
            "plot": str(plot.resolve()),
            "model": str(result_dir.resolve()),
            "seconds": round(elapsed, 1),
        }
        if quiet:
            print(json.dumps(report))
        else:
            say(
                f"done in {elapsed:.0f}s: loss {loss_before:.3f} -> {loss_after:.3f}, held-out exact match "
                f"{acc_before:.0%} -> {acc_after:.0%}"
            )
            say(
                f"bytes exchanged {exchanged / 1e6:.1f} MB vs {data_parallel / 1e6:.1f} MB for per-step "
                f"data-parallel training ({data_parallel / exchanged:.0f}x less)"
            )
            say(f"loss curve: {plot}\ntrained model: {result_dir} (loads with from_pretrained)")
        return 0 if loss_after < loss_before else 1
    except (RuntimeError, HyphaError, grpc.aio.AioRpcError) as err:
        message = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
        print(f"hypha demo: error: {message}", file=sys.stderr)
        return 1
    finally:
        if started is not None:
            stop_process(started, grace_s=30)


def _load(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)
