"""Idle time at sync points: whole-model DiLoCo rounds against streaming fragments, over a slow link.

    python benchmarks/streaming_sync.py [--quick] [--fragments F] [--mbps 2]

The real trainer and parameter-server executors run in one process over the
fake bridges of ``hypha.testing.executors`` (the tiny byte-level GPT-2, two
trainers, arithmetic data). Each trainer's link is simulated: a payload of n
bytes takes n / bandwidth seconds to go up (Δ) and to come down (update).
Both variants run the same inner steps per trainer and the same H (plain:
rounds of H steps; streaming: F times as many rounds of H/F steps, each
syncing one fragment). The figure is the trainers' total ``sync_idle_seconds``
(their own metric) with streaming, the baseline the same with whole-model
rounds; the wall time and the bytes sent are reported beside them. The two
variants alternate ``--repeats`` times and the medians are reported (the
machine may be shared; one torch thread per process).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, report

from hypha import models
from hypha.datasets import synthetic
from hypha.models import ModelKind
from hypha.testing.executors import FakeBridge, FakeNetwork, diloco_spec, sync_every, write_slices
from hypha.worker.executors.diloco_trainer import DilocoTrainer, TrainerOptions
from hypha.worker.executors.parameter_server import ParameterServer, ServerOptions

TRAINERS = ("t0", "t1")


class _SlowLink(FakeBridge):
    """A trainer's bridge whose uploads and update downloads take bytes / bandwidth seconds."""

    def __init__(self, network: FakeNetwork, peer: str, bytes_per_s: float) -> None:
        super().__init__(network, peer)
        self.bytes_per_s = bytes_per_s

    async def send_tensors(self, peer: str, kind: str, round: int, samples: int, path: Path) -> Any:
        size = (await asyncio.to_thread(path.stat)).st_size
        await asyncio.sleep(size / self.bytes_per_s)  # the upload itself
        return await super().send_tensors(peer, kind, round, samples, path)

    async def fetch_tensors(self, peer: str, kind: str, round: int, timeout_s: float) -> bytes | None:
        data = await super().fetch_tensors(peer, kind, round, timeout_s)
        if data is not None:
            await asyncio.sleep(len(data) / self.bytes_per_s)  # the download itself
        return data


async def _job(
    root: Path, model_dir: Path, fragments: int, rounds: int, batches: int, mbps: float
) -> dict[str, float]:
    slices = {
        peer: write_slices(synthetic.arithmetic(512, seed=seed), root / "data", f"arith-{peer}", 16)
        for seed, peer in enumerate(TRAINERS)
    }
    network = FakeNetwork(
        spec=diloco_spec(rounds=rounds),
        root=root / "jobs",
        model_dir=model_dir,
        trainer_ids=TRAINERS,
        slices=slices,
    )
    network.spec.diloco.streaming_fragments = fragments
    network.policy = sync_every(dict.fromkeys(TRAINERS, batches))
    ps = ParameterServer(network.bridge(network.ps_id), options=ServerOptions(poll_s=0.02, linger_s=0.0))
    options = TrainerOptions(fetch_timeout_s=30.0, update_patience_s=300.0)
    trainers = [DilocoTrainer(_SlowLink(network, p, mbps * 1e6), options=options) for p in TRAINERS]
    started = time.perf_counter()
    codes = await asyncio.gather(ps.run(), *(t.run() for t in trainers))
    wall = time.perf_counter() - started
    if list(codes) != [0, 0, 0]:
        raise SystemExit(f"job failed: exit codes {codes}")
    idle = sum(m[2]["sync_idle_seconds"] for m in network.metrics if m[0] in TRAINERS)
    sent = sum(len(s.data) for s in network.deltas())
    peak = max(len(s.data) for s in network.deltas())
    return {"idle_s": idle, "wall_s": wall, "bytes": float(sent), "peak_bytes": float(peak)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (CI-sized)")
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument(
        "--inner-steps", type=int, default=8, help="H: inner steps between a fragment's syncs"
    )
    parser.add_argument("--mbps", type=float, default=4.0, help="each trainer's link, MB/s each way")
    parser.add_argument("--repeats", type=int, default=0, help="runs of each variant (default 3, quick 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    outer_rounds = 3 if args.quick else 8
    h, f = args.inner_steps, args.fragments
    if h % f:
        raise SystemExit("--inner-steps must be a multiple of --fragments")
    root = Path(tempfile.mkdtemp(prefix="hypha-streaming-"))
    model_dir = models.save_tiny_model(ModelKind.CAUSAL_LM, root / "gpt2")
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "streaming": []}
    for i in range(args.repeats or (1 if args.quick else 3)):
        runs["plain"].append(asyncio.run(_job(root / f"plain-{i}", model_dir, 0, outer_rounds, h, args.mbps)))
        runs["streaming"].append(
            asyncio.run(_job(root / f"streaming-{i}", model_dir, f, outer_rounds * f, h // f, args.mbps))
        )
        print(f"run {i}: whole-model {runs['plain'][-1]}; F={f} {runs['streaming'][-1]}", file=sys.stderr)
    plain, streaming = (
        {k: median([r[k] for r in runs[v]]) for k in runs[v][0]} for v in ("plain", "streaming")
    )
    report(
        "streaming_sync",
        streaming["idle_s"],
        "s idle at syncs",
        plain["idle_s"],
        streaming["idle_s"] / plain["idle_s"],
        fragments=f,
        inner_steps=h,
        mbps=args.mbps,
        repeats=len(runs["plain"]),
        plain_wall_s=round(plain["wall_s"], 3),
        streaming_wall_s=round(streaming["wall_s"], 3),
        plain_bytes=plain["bytes"],
        streaming_bytes=streaming["bytes"],
        plain_peak_bytes=plain["peak_bytes"],
        streaming_peak_bytes=streaming["peak_bytes"],
    )


if __name__ == "__main__":
    main()
