"""Trainer throughput under the job bridge beside a bare torch loop on the same model and data,
in the same run.

    python benchmarks/trainer_overhead.py [--quick]

Model: a GPT-2 of ~0.85M parameters (4 blocks, 128 wide) on the synthetic arithmetic corpus,
batches of 16 x 64 tokens, AdamW, one torch thread everywhere (what the worker gives each
trainer on a small machine).

Ours, two ways, each a full DiLoCo job of R rounds x H batches with a parameter server:
- ``real``: ``python -m hypha.worker.executors.diloco_trainer`` as its own process, talking
  HTTP over the Unix socket to the worker's real ``JobBridge`` (aiohttp) in this process; the
  scheduler and the parameter server's worker are played in-process (``tests.executors``). Slices
  go through the bridge into the work dir, progress is reported (at most every
  ``report_interval_s``), Δ goes out and θ_global comes back through the bridge each round, and
  the trainer checkpoints the last round (at most every ``checkpoint_interval_s`` before that).
- ``fake``: the same trainer loop in this process over the in-process fake bridge.
- ``overlap_sync``: ``real`` with the job's ``overlap_sync = true`` (training goes on while the
  round's Δ and update travel; ``overlap_sync_ratio``).
Throughput is the samples counted between the first and the last progress report over the time
between them (so process start and model loading are excluded, the syncs between rounds are
included; the trainer reports at most every ``report_interval_s``, not every batch).

Baseline: a plain loop (zero_grad, forward, backward, step) over the same batches of the same
slice files, timed from the end of its first batch to the end of its last.

figure = ``real`` samples/s (median over repeats); ratio = figure / baseline (issue 15's target >= 0.97,
i.e. <= 3 % overhead). ``steady_ratio`` compares the median time per batch between two
reports of a round (no syncs); ``paired_ratio`` is the median of each repeat's own real/bare
ratio (less swayed by load drift).
``--scheduler-rtt-ms N`` delays the scheduler's answer to each progress report by N ms in
the real runs, as a scheduler across a WAN or behind relays would (the fake run has none).
``--timings FILE`` runs each real trainer through ``_bridge_timings.py`` (time per bridge call,
train step and checkpoint); ``--profile DIR`` runs one real trainer under pyinstrument.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import median, report

BATCH = 16
SAMPLES_PER_SLICE = 64  # the data node's default


#: One point of a run: (time, round, batches done in the round, samples done in the whole run).
Point = tuple[float, int, int, int]


def _throughput(points: list[Point]) -> tuple[float, float]:
    """(samples/s from the first point to the last, median seconds per batch between two
    consecutive points of one round: the pace without the syncs).

    Points are progress reports, which the trainer spaces (``report_interval_s``), so both
    figures come from the samples and batches each report counts, not from how many there are.
    """
    (t0, _, _, s0), (t1, _, _, s1) = points[0], points[-1]
    paces = [
        (b[0] - a[0]) / (b[2] - a[2]) for a, b in itertools.pairwise(points) if a[1] == b[1] and b[2] > a[2]
    ]
    return (s1 - s0) / (t1 - t0), statistics.median(paces)


def _reports(network: Any, peer: str = "t0") -> list[Point]:
    """The trainer's progress reports as points (each report counts its round's figures so far)."""
    points: list[Point] = []
    finished: dict[int, int] = {}  # samples of each round, as last reported
    for (who, at, _), (_, round_, batches, samples, _, _) in zip(
        network.progress_times, network.progress, strict=True
    ):
        if who != peer:
            continue
        finished[round_] = samples
        points.append((at, round_, batches, sum(v for r, v in finished.items() if r < round_) + samples))
    return points


async def _run_fake(network: Any) -> tuple[float, float]:
    from hypha.worker.executors.diloco_trainer import DilocoTrainer
    from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions

    ps = ParameterServer(network.bridge("ps"), options=ServerOptions(poll_s=0.05, linger_s=0.0))
    trainer = DilocoTrainer(network.bridge("t0"))
    codes = await asyncio.gather(ps.run(), trainer.run())
    assert list(codes) == [0, 0], codes
    return _throughput(_reports(network))


#: ``--timings FILE``: each real run's trainer through ``_bridge_timings.py``, appending to FILE.
TIMINGS: Path | None = None


def _trainer_argv() -> list[str]:
    if TIMINGS is not None:
        return [str(Path(__file__).with_name("_bridge_timings.py")), str(TIMINGS)]
    return ["-m", "hypha.worker.executors.diloco_trainer"]


async def _run_real(network: Any, profile: Path | None = None) -> tuple[float, float]:
    from hypha.testing.real_bridge import executor_env, start_real_bridge
    from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions

    bridge, record, work_dir = await start_real_bridge(network, "t0")
    ps = ParameterServer(network.bridge("ps"), options=ServerOptions(poll_s=0.05, linger_s=0.0))
    server = asyncio.ensure_future(ps.run())
    try:
        # --profile: the trainer's process under pyinstrument (its text report into that dir).
        wrap = ["-m", "pyinstrument", "-o", str(profile / "trainer.txt")] if profile else []
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *wrap,
            *_trainer_argv(),
            cwd=work_dir,
            env=executor_env(bridge.socket_path, work_dir),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, stderr = await asyncio.wait_for(proc.communicate(), 600)
        assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]
        assert await asyncio.wait_for(server, 60) == 0
    finally:
        await bridge.stop()
    assert record.reported_state == "succeeded"
    return _throughput(_reports(network))


def _run_bare(model_dir: Path, slices: list[Path], batches: int, lr: float) -> tuple[float, float]:
    from hypha import models
    from hypha.datasets.format import load_slice_file
    from hypha.v1 import common_pb2
    from hypha.worker.executors import diloco_settings
    from hypha.worker.executors.batches import BatchStream

    model = models.build_model(common_pb2.ModelSpec(type=common_pb2.MODEL_TYPE_CAUSAL_LM), model_dir)
    optimizer = diloco_settings.make_inner_optimizer(
        model, diloco_settings.InnerSettings(lr=lr, beta1=0.9, beta2=0.99, eps=1e-8)
    )
    stream = BatchStream(BATCH, models.MODEL_INPUTS[models.ModelKind.CAUSAL_LM])
    data: list[dict[str, Any]] = []
    cursor = 0
    while len(data) < batches:
        if (batch := stream.next_batch()) is None:
            stream.add_slice(cursor, load_slice_file(slices[cursor % len(slices)]))
            cursor += 1
            continue
        data.append(batch)
    points: list[Point] = []
    for done, batch in enumerate(data, 1):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        points.append((time.perf_counter(), 0, done, done * BATCH))
    return _throughput(points)


def main(quick: bool, profile: Path | None = None, scheduler_rtt_ms: float = 0.0) -> None:
    import torch

    from hypha import models
    from hypha.datasets import synthetic
    from hypha.memtune import tune_malloc
    from hypha.testing.executors import FakeNetwork, diloco_spec, sync_every, write_slices

    tune_malloc()  # the bare loop gets what the trainer's process gets (its BridgeClient)

    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    rounds, per_round = (2, 15) if quick else (3, 80)
    repeats = 3
    lr = 1e-3
    base = Path(tempfile.mkdtemp(prefix="hypha-bench-trainer-"))
    model_dir = models.save_tiny_model(
        models.ModelKind.CAUSAL_LM, base / "model", n_embd=128, n_layer=4, n_head=4
    )
    params = sum(
        p.numel() for p in models.build_model(diloco_spec(rounds=1).diloco.model, model_dir).parameters()
    )
    slices = write_slices(
        synthetic.arithmetic(SAMPLES_PER_SLICE * 8, seed=1), base / "data", "arith", SAMPLES_PER_SLICE
    )

    def network(name: str, overlap: bool = False) -> Any:
        net = FakeNetwork(
            progress_delay_s=scheduler_rtt_ms / 1e3,
            spec=diloco_spec(rounds=rounds, inner_lr=lr),
            root=base / name,
            model_dir=model_dir,
            trainer_ids=("t0",),
            batch_size=BATCH,
            slices={"t0": slices},
            policy=sync_every({"t0": per_round}),
        )
        net.spec.diloco.overlap_sync = overlap
        return net

    if profile is not None:  # one real run with the trainer's process under pyinstrument
        profile.mkdir(parents=True, exist_ok=True)
        sps, step = asyncio.run(_run_real(network("profiled"), profile))
        print(f"profiled real run: {sps:.1f} samples/s, batch {step * 1e3:.1f} ms; {profile / 'trainer.txt'}")
        return
    real: list[tuple[float, float]] = []
    overlapped: list[tuple[float, float]] = []
    fake: list[tuple[float, float]] = []
    bare: list[tuple[float, float]] = []
    for i in range(repeats):
        bare.append(_run_bare(model_dir, slices, rounds * per_round, lr))
        fake.append(asyncio.run(_run_fake(network(f"fake-{i}"))))
        real.append(asyncio.run(_run_real(network(f"real-{i}"))))
        overlapped.append(asyncio.run(_run_real(network(f"overlap-{i}", overlap=True))))

    real_sps, bare_sps = median([r[0] for r in real]), median([b[0] for b in bare])
    fake_sps = median([f[0] for f in fake])
    overlap_sps = median([o[0] for o in overlapped])
    real_step, bare_step = median([r[1] for r in real]), median([b[1] for b in bare])
    report(
        "trainer_overhead",
        real_sps,
        "samples/s",
        bare_sps,
        real_sps / bare_sps,
        overhead_pct=round((1 - real_sps / bare_sps) * 100, 2),
        real_samples_per_s=[round(r[0], 1) for r in real],
        fake_samples_per_s=[round(f[0], 1) for f in fake],
        overlap_sync_samples_per_s=[round(o[0], 1) for o in overlapped],
        bare_samples_per_s=[round(b[0], 1) for b in bare],
        # Each repeat runs bare, fake and real back to back: the ratio within a repeat shares its load.
        paired_ratio=round(median([r[0] / b[0] for r, b in zip(real, bare, strict=True)]), 4),
        fake_ratio=round(fake_sps / bare_sps, 4),
        overlap_sync_ratio=round(overlap_sps / bare_sps, 4),
        steady_ratio=round(bare_step / real_step, 4),
        batch_ms_real=round(real_step * 1e3, 2),
        batch_ms_bare=round(bare_step * 1e3, 2),
        rounds=rounds,
        batches_per_round=per_round,
        batch_size=BATCH,
        parameters=params,
        threads=1,
        scheduler_rtt_ms=scheduler_rtt_ms,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser.add_argument(
        "--profile", type=Path, help="one real run under pyinstrument, its report into this dir"
    )
    parser.add_argument(
        "--timings", type=Path, help="append the trainer's per-call timings of each real run here"
    )
    parser.add_argument(
        "--scheduler-rtt-ms",
        type=float,
        default=0.0,
        help="delay each progress answer of the real runs by this much (a distant scheduler)",
    )
    args = parser.parse_args()
    TIMINGS = args.timings
    main(args.quick, args.profile, args.scheduler_rtt_ms)
