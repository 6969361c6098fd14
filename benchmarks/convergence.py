"""Convergence per byte: synchronous data parallel beside DiLoCo with fp32, bf16 and int8 deltas,
and streaming DiLoCo, on the same data, seed, sample count and worker count, in one run.

    python benchmarks/convergence.py [--quick] [--model mlp|gpt2]

Task: the synthetic arithmetic corpus (``hypha.datasets.synthetic``: 3-digit sums, answers
reversed, labels on the answer only). Every variant runs W workers in this process, each worker
on its own fixed stream of batches (the same stream in every variant), for T inner steps.
Loss is measured on held-out sums (operand pairs training never sees).

Model: ``gpt2`` (default) is the tiny byte-level GPT-2 of ``hypha.models`` (0.12M parameters,
28 tensors); ``mlp`` predicts the answer's tokens from the prompt's tokens (embedding, 3 hidden
layers, one head per answer position; 0.9M parameters) and shows a harder case for DiLoCo
(docs/compression.md). Default steps: 150 with ``--quick``, else 600 (mlp: 300 / 1000).

Variants:
(a) ``ddp``: per-step synchronous data parallel: each worker's gradient is averaged every step
    (an all-reduce, here in process) and one AdamW step is taken on the shared model;
(b) ``diloco_fp32``: DiLoCo, H inner AdamW steps per worker, then the deltas are averaged and
    the outer Nesterov step (lr 0.7, momentum 0.9: ``hypha.diloco.outer``) is applied;
(c) ``diloco_bf16``: (b) with bf16 deltas;
(d) ``diloco_int8``: (b) with block-wise int8 deltas and error feedback (``hypha.tensors.quant``);
(e) ``streaming``: (b) with the parameters in F fragments synced on staggered schedules
    (``hypha.diloco.streaming``), fp32 deltas, each fragment with its own outer optimizer.

Bytes are what workers send, as encoded by the real code (``hypha.tensors.deltas.DeltaEncoder``,
which the trainer executor uses; ``encode_state`` for DDP's fp32 gradients), summed over all
workers and syncs. The way back (θ_global, fp32, the same for every DiLoCo variant) is not
counted. ``*_peak_bytes``: the most bytes sent at one sync point (all workers together).

Last line: ``{"name": "convergence", "figure": diloco_int8_loss / diloco_fp32_loss,
"unit": "ratio", "baseline": ddp_loss, ...}``. Targets: diloco_fp32_loss within 5% of
ddp_loss; diloco_int8_loss within 2% of diloco_fp32_loss with int8_bytes <= 30% of fp32_bytes;
streaming_peak_bytes <= half of fp32_peak_bytes.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from _common import report

WORKERS = 4
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
SEED = 0


@dataclass(frozen=True)
class Setup:
    model: str
    steps: int  # inner steps per worker (T)
    inner_steps: int  # H
    fragments: int  # F
    batch: int
    inner_lr: float
    heldout: int
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM


def _args() -> Setup:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under ~3 min on 2 cores)")
    parser.add_argument("--model", choices=("gpt2", "mlp"), default="gpt2")
    parser.add_argument("--steps", type=int, help="inner steps per worker (T)")
    parser.add_argument("--inner-steps", type=int, default=25, help="H: inner steps between syncs")
    parser.add_argument("--fragments", type=int, default=4, help="F: streaming fragments")
    parser.add_argument(
        "--inner-lr", type=float, help="AdamW learning rate (DDP's too); default 3e-3 (gpt2), 1e-3 (mlp)"
    )
    parser.add_argument("--outer-lr", type=float, default=OUTER_LR)
    parser.add_argument("--outer-momentum", type=float, default=OUTER_MOMENTUM)
    args = parser.parse_args()
    steps = args.steps or (
        (150 if args.quick else 600) if args.model == "gpt2" else (300 if args.quick else 1000)
    )
    return Setup(
        model=args.model,
        steps=steps,
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        batch=32,
        inner_lr=args.inner_lr or (1e-3 if args.model == "mlp" else 3e-3),
        heldout=1024,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
    )


# ---- the task ------------------------------------------------------------------------------


def _model_factory(
    setup: Setup,
) -> tuple[Callable[[], object], Callable[[object, Mapping[str, object]], object]]:
    """(make a freshly seeded model, loss of a batch) for the chosen model."""
    import torch
    from torch import nn

    from hypha.datasets import synthetic
    from hypha.models import ModelKind, batch_loss, tiny_gpt2_config

    width = len(str(synthetic.DEFAULT_MAX_OPERAND))
    prompt_len = 2 * width + 2  # "012+035="
    answer_len = len(str(2 * synthetic.DEFAULT_MAX_OPERAND)) + 1  # reversed digits + "\n"

    class AnswerMlp(nn.Module):
        """Prompt tokens -> one distribution per answer position (a causal model for this task:
        the answer depends on the prompt only)."""

        def __init__(self, embed: int = 32, hidden: int = 384) -> None:
            super().__init__()
            self.embed = nn.Embedding(synthetic.VOCAB_SIZE, embed)
            self.body = nn.Sequential(
                nn.Linear(prompt_len * embed, hidden),
                nn.GELU(),
                nn.Linear(hidden, hidden),
                nn.GELU(),
                nn.Linear(hidden, hidden),
                nn.GELU(),
            )
            # One head per answer position: layer-sized tensors, so fragments can be balanced.
            self.heads = nn.ModuleList(nn.Linear(hidden, synthetic.VOCAB_SIZE) for _ in range(answer_len))

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            x = self.body(self.embed(input_ids[:, :prompt_len]).flatten(1))
            return torch.stack([head(x) for head in self.heads], dim=1)

    def make() -> nn.Module:
        torch.manual_seed(SEED)
        if setup.model == "mlp":
            return AnswerMlp()
        from transformers import GPT2LMHeadModel

        return GPT2LMHeadModel(tiny_gpt2_config(n_positions=16))

    def loss(model: object, batch: Mapping[str, object]) -> object:
        assert isinstance(model, nn.Module)
        if setup.model == "mlp":
            logits = model(batch["input_ids"])
            labels = batch["labels"][:, prompt_len : prompt_len + answer_len]  # type: ignore[index]
            return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return batch_loss(model, ModelKind.CAUSAL_LM, batch)  # type: ignore[arg-type]

    return make, loss


def _data(setup: Setup) -> tuple[list[list[dict[str, object]]], dict[str, object]]:
    """Each worker's batches (the same in every variant) and the held-out batch."""
    import numpy as np
    import torch

    from hypha.datasets import synthetic

    streams = []
    for w in range(WORKERS):
        rows = synthetic.arithmetic(setup.steps * setup.batch, seed=1000 + w).tensors
        streams.append(
            [
                {k: v[i * setup.batch : (i + 1) * setup.batch] for k, v in rows.items()}
                for i in range(setup.steps)
            ]
        )
    pairs = synthetic.heldout_pairs(setup.heldout, seed=SEED)
    seq_len = synthetic.arithmetic_line_length(synthetic.DEFAULT_MAX_OPERAND)
    heldout = {
        k: torch.from_numpy(np.ascontiguousarray(v))
        for k, v in synthetic.arithmetic_rows(pairs, seq_len).items()
    }
    return streams, heldout  # type: ignore[return-value]


# ---- the variants --------------------------------------------------------------------------


@dataclass
class Outcome:
    loss: float
    bytes: int
    peak_bytes: int
    seconds: float


def _evaluate(model: object, loss: Callable[..., object], heldout: Mapping[str, object]) -> float:
    import torch

    with torch.no_grad():
        return float(loss(model, heldout))  # type: ignore[arg-type]


def run_ddp(
    setup: Setup, make: Callable[[], object], loss: Callable[..., object], streams: list, heldout: dict
) -> Outcome:
    """Per-step data parallel: average the W gradients, one AdamW step on the shared model."""
    import torch

    from hypha.tensors.payload import encode_state

    started = time.perf_counter()
    model = make()
    assert isinstance(model, torch.nn.Module)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.inner_lr)
    params = dict(model.named_parameters())
    sent = peak = 0
    for step in range(setup.steps):
        grads: list[dict[str, torch.Tensor]] = []
        for w in range(WORKERS):
            model.zero_grad(set_to_none=True)
            loss(model, streams[w][step]).backward()  # type: ignore[attr-defined]
            grads.append({n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None})
        step_bytes = sum(len(encode_state(g, "fp32")) for g in grads)
        sent += step_bytes
        peak = max(peak, step_bytes)
        for n, p in params.items():
            p.grad = torch.stack([g[n] for g in grads]).mean(0)
        opt.step()
    return Outcome(_evaluate(model, loss, heldout), sent, peak, time.perf_counter() - started)


def run_diloco(
    setup: Setup,
    make: Callable[[], object],
    loss: Callable[..., object],
    streams: list,
    heldout: dict,
    *,
    dtype: str = "fp32",
    fragments: int = 1,
) -> Outcome:
    """DiLoCo over W in-process workers; ``fragments`` > 1 is streaming DiLoCo."""
    import torch

    from hypha.diloco.streaming import FragmentedOuter, StreamingSchedule, merge_fragment, partition
    from hypha.tensors.deltas import DeltaEncoder
    from hypha.tensors.payload import decode_state

    started = time.perf_counter()
    models = [make() for _ in range(WORKERS)]
    assert all(isinstance(m, torch.nn.Module) for m in models)
    params = [dict(m.named_parameters()) for m in models]  # type: ignore[attr-defined]
    opts = [torch.optim.AdamW(p.values(), lr=setup.inner_lr) for p in params]
    groups = partition({n: p.numel() for n, p in params[0].items()}, fragments)
    outer = FragmentedOuter(
        {n: p.detach() for n, p in params[0].items()}, groups, setup.outer_lr, setup.outer_momentum
    )
    encoders = [DeltaEncoder(dtype) for _ in range(WORKERS)]
    schedule = StreamingSchedule(setup.inner_steps, fragments)
    last_sync = [0] * fragments
    sent = peak = 0

    def sync(f: int, step: int) -> int:
        names = groups[f]
        theta = outer.outers[f].parameters()
        template = {n: tuple(theta[n].shape) for n in names}
        received = []
        nbytes = 0
        for w in range(WORKERS):
            with torch.no_grad():
                delta = {n: params[w][n].detach() - theta[n] for n in names}
            blob = encoders[w].encode(delta, {"round": str(step)})
            nbytes += len(blob)
            received.append((decode_state(blob, expected=template), setup.batch * (step - last_sync[f])))
        new = outer.step(f, received)
        for w in range(WORKERS):
            merge_fragment({n: params[w][n] for n in names}, new, 0.0)
        last_sync[f] = step
        return nbytes

    for step in range(1, setup.steps + 1):
        for w in range(WORKERS):
            opts[w].zero_grad(set_to_none=True)
            loss(models[w], streams[w][step - 1]).backward()  # type: ignore[attr-defined]
            opts[w].step()
        for f in schedule.syncing(step):
            nbytes = sync(f, step)
            sent += nbytes
            peak = max(peak, nbytes)
    # Fragments with steps since their last sync send them, one fragment per sync point.
    for f in range(fragments):
        if last_sync[f] < setup.steps:
            nbytes = sync(f, setup.steps)
            sent += nbytes
            peak = max(peak, nbytes)
    final = make()
    assert isinstance(final, torch.nn.Module)
    with torch.no_grad():
        for n, p in final.named_parameters():
            p.copy_(outer.parameters()[n])
    return Outcome(_evaluate(final, loss, heldout), sent, peak, time.perf_counter() - started)


def main() -> None:
    setup = _args()
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("HYPHA_TORCH_THREADS", "1"))))
    make, loss = _model_factory(setup)
    streams, heldout = _data(setup)
    runs: dict[str, Outcome] = {"ddp": run_ddp(setup, make, loss, streams, heldout)}
    for name, dtype, fragments in (
        ("diloco_fp32", "fp32", 1),
        ("diloco_bf16", "bf16", 1),
        ("diloco_int8", "int8", 1),
        ("streaming", "fp32", setup.fragments),
    ):
        runs[name] = run_diloco(setup, make, loss, streams, heldout, dtype=dtype, fragments=fragments)
    for name, run in runs.items():
        print(
            f"{name:12s} held-out loss {run.loss:.4f}  sent {run.bytes / 1e6:9.2f} MB  "
            f"peak/sync {run.peak_bytes / 1e6:7.3f} MB  {run.seconds:5.1f} s",
            flush=True,
        )
    fp32, int8 = runs["diloco_fp32"], runs["diloco_int8"]
    print(
        f"W={WORKERS} T={setup.steps} H={setup.inner_steps} F={setup.fragments} batch={setup.batch} "
        f"model={setup.model} inner_lr={setup.inner_lr} outer={setup.outer_lr}/{setup.outer_momentum}; "
        f"fp32 vs ddp {fp32.loss / runs['ddp'].loss:.4f}, "
        f"int8 bytes {int8.bytes / fp32.bytes:.3f} of fp32, "
        f"streaming peak {runs['streaming'].peak_bytes / fp32.peak_bytes:.3f} of fp32",
        flush=True,
    )
    figure = int8.loss / fp32.loss
    report(
        "convergence",
        figure,
        "ratio",
        runs["ddp"].loss,
        figure,
        ddp_loss=round(runs["ddp"].loss, 6),
        diloco_fp32_loss=round(fp32.loss, 6),
        diloco_bf16_loss=round(runs["diloco_bf16"].loss, 6),
        diloco_int8_loss=round(int8.loss, 6),
        streaming_loss=round(runs["streaming"].loss, 6),
        ddp_bytes=runs["ddp"].bytes,
        fp32_bytes=fp32.bytes,
        int8_bytes=int8.bytes,
        fp32_peak_bytes=fp32.peak_bytes,
        streaming_peak_bytes=runs["streaming"].peak_bytes,
    )


if __name__ == "__main__":
    main()
