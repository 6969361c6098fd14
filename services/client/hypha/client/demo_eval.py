"""What ``hypha demo`` shows: the live view while the job runs, and the figures after it.

- ``LiveView``: rich's progress bar and a line per round on a terminal; plain
  lines when stdout is not one; nothing but the final JSON with ``--output json``.
- ``score``: the answer-token loss and the greedy exact match of a model on
  held-out sums (pairs the dataset never contains).
- ``figures`` / ``report``: per-round loss and throughput from the job's
  metrics, the measured tensor bytes, and the accuracy curve over the
  θ_global files the demo collected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hypha.v1 import scheduler_pb2

if TYPE_CHECKING:
    from torch import nn

    from hypha.client.demo import JobRun

#: Held-out sums scored per model (±1.6 points of accuracy at 50 %).
HELDOUT = 1000


class LiveView:
    """Progress of the demo for a person, or silence for ``--output json``."""

    def __init__(self, quiet: bool, console: Console | None = None) -> None:
        self.quiet = quiet
        self.console = console or Console(highlight=False)
        self.names: dict[str, str] = {}
        self._progress: Progress | None = None
        self._task: Any = None
        self._round = -1
        self._rounds = 0

    def say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, markup=False)

    def submitted(self, job_id: str, rounds: int) -> None:
        self._rounds = rounds
        self.say(f"submitted DiLoCo job {job_id}: 2 trainers + 1 parameter server, {rounds} rounds")
        if self.quiet or not self.console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("rounds"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
        )
        self._task = self._progress.add_task("rounds", total=rounds, info="")
        self._progress.start()

    def event(self, round_number: int, loss: float, speeds: Sequence[tuple[str, float]]) -> None:
        """A job event: the round the job is in, its latest loss, each trainer's samples/s."""
        workers = "  ".join(f"{self.names.get(w, w[:8])} {s:,.0f} samples/s" for w, s in speeds)
        info = f"loss {loss:.3f}  {workers}" if loss > 0 else workers
        if self._progress is not None:
            self._progress.update(self._task, completed=round_number, info=info)
        if round_number != self._round and loss > 0:
            self._round = round_number
            line = f"  round {round_number}/{self._rounds}  {info}"
            if self._progress is not None:
                self._progress.console.print(line, markup=False)
            else:
                self.say(line)

    def note(self, text: str) -> None:
        """A line between the rounds (the scheduler went away and is being reconnected)."""
        if self._progress is not None:
            self._progress.console.print(f"  {text}", markup=False)
        else:
            self.say(f"  {text}")

    def done(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def final(self, report: Mapping[str, Any]) -> None:
        if self.quiet:
            print(json.dumps(report), flush=True)
            return
        table = Table(title="hypha demo", show_header=False)
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_row("job", str(report["job_id"]))
        table.add_row("training time (submit to SUCCEEDED)", f"{report['seconds']:.0f} s")
        table.add_row("loss on answer tokens", f"{report['initial_loss']:.3f} -> {report['final_loss']:.3f}")
        table.add_row(
            "held-out exact match (greedy)",
            f"{report['accuracy_before']:.1%} -> {report['accuracy_after']:.1%}",
        )
        curve = ", ".join(f"{r}: {a:.0%}" for r, a in report["accuracy_curve"].items())
        table.add_row("held-out exact match by round", curve)
        exchanged, parallel = report["bytes_exchanged"], report["data_parallel_bytes"]
        table.add_row("tensor bytes exchanged (measured)", f"{exchanged / 1e6:,.1f} MB")
        table.add_row(
            "per-step data parallel (computed)",
            f"{parallel / 1e6:,.1f} MB ({parallel / max(exchanged, 1):,.0f}x more)",
        )
        table.add_row("plot", str(report["plot"]))
        table.add_row("trained model (from_pretrained)", str(report["model"]))
        self.console.print(table)


# ---- scoring ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeldOut:
    """Held-out sums as rows (answer-only labels) and as (prompt ids, expected answer)."""

    batch: dict[str, Any]
    prompt_len: int
    answers: list[str]


def heldout(n: int = HELDOUT) -> HeldOut:
    import torch

    from hypha.datasets import synthetic

    pairs = synthetic.heldout_pairs(n, seed=0)
    rows = synthetic.arithmetic_rows(pairs, synthetic.arithmetic_line_length(synthetic.DEFAULT_MAX_OPERAND))
    prompt_len = len(synthetic.arithmetic_prompt(0, 0))
    return HeldOut(
        {k: torch.from_numpy(v) for k, v in rows.items()},
        prompt_len,
        [synthetic.arithmetic_answer(a + b) for a, b in pairs],
    )


def score(model: nn.Module, data: HeldOut) -> tuple[float, float]:
    """(loss on answer tokens, greedy exact-match accuracy) on the held-out sums."""
    from hypha.inference import completion_text, greedy_generate, is_exact_match
    from hypha.models import ModelKind, evaluate_loss

    loss = evaluate_loss(model, ModelKind.CAUSAL_LM, [data.batch])
    longest = data.batch["input_ids"].shape[1] - data.prompt_len
    prompts = data.batch["input_ids"][:, : data.prompt_len].tolist()
    # The same greedy decoding and exact match an inference job scores with (hypha.inference).
    completions = greedy_generate(model, prompts, longest, batch_size=len(prompts))
    hits = sum(
        is_exact_match(completion_text(ids), answer)
        for ids, answer in zip(completions, data.answers, strict=True)
    )
    return loss, hits / len(data.answers)


def load_model(model_dir: Path, theta: Path | None = None) -> nn.Module:
    """A saved model, optionally with θ_global from a parameter server's published file."""
    import torch
    from transformers import AutoModelForCausalLM

    from hypha.tensors.payload import decode_state

    model: nn.Module = AutoModelForCausalLM.from_pretrained(model_dir)
    if theta is not None:
        params = decode_state(theta.read_bytes(), torch.float32)
        unexpected = model.load_state_dict(params, strict=False).unexpected_keys
        if unexpected:
            raise RuntimeError(f"{theta} does not fit the model: {', '.join(unexpected[:3])}")
    return model


# ---- figures from the job's metrics ---------------------------------------------------------------


@dataclass
class Figures:
    #: Rounds completed -> the trainers' mean training loss (answer tokens) in the last one.
    losses: dict[int, float] = field(default_factory=dict)
    #: Worker name -> rounds completed -> samples per second in the last one.
    throughput: dict[str, dict[int, float]] = field(default_factory=dict)
    #: Tensor bytes on the wire for the job, measured by the workers.
    bytes_exchanged: int = 0


def figures(points: Sequence[scheduler_pb2.MetricPoint], names: Mapping[str, str]) -> Figures:
    out = Figures()
    losses: dict[int, list[float]] = {}
    cumulative: dict[tuple[str, str], float] = {}
    for p in points:
        # A trainer reports round r's figures at its end: r + 1 rounds completed.
        if p.name == "loss" and p.value > 0:
            losses.setdefault(p.round + 1, []).append(p.value)
        elif p.name == "samples_per_second" and p.value > 0:
            out.throughput.setdefault(names.get(p.worker_id, p.worker_id[:8]), {})[p.round + 1] = p.value
        elif p.name in ("tensor_bytes_pushed", "tensor_bytes_pulled"):
            key = (p.worker_id, p.name)
            cumulative[key] = max(cumulative.get(key, 0.0), p.value)
    out.losses = {r: sum(v) / len(v) for r, v in sorted(losses.items())}
    out.bytes_exchanged = int(sum(cumulative.values()))
    return out


def curve_rounds(available: Sequence[int], rounds: int, points: int) -> list[int]:
    """About ``points`` evenly spaced rounds among those collected (0 and ``rounds`` always)."""
    step = max(1, rounds // max(1, points))
    return sorted({0, rounds} | {r for r in available if r % step == 0 and 0 < r < rounds})


def report(
    run: JobRun, model_dir: Path, results: Path, *, rounds: int, trainers: int, inner_steps: int, points: int
) -> dict[str, Any]:
    """The demo's figures (the JSON report less what only the caller knows)."""
    data = heldout()
    curve: dict[str, float] = {}
    before = after = (0.0, 0.0)
    params = 0
    for r in curve_rounds(list(run.thetas), rounds, points):
        if r == 0:
            model = load_model(model_dir)
        elif r == rounds:
            model = load_model(results / "demo")
        else:
            model = load_model(model_dir, run.thetas[r])
        figure = score(model, data)
        curve[str(r)] = round(figure[1], 4)
        if r == 0:
            before = figure
        if r == rounds:
            after = figure
        params = sum(p.numel() for p in model.parameters())
    measured = figures(run.metrics, run.names).bytes_exchanged
    # Per-step data parallel: each trainer sends its gradient and receives the model every step.
    data_parallel = 2 * 4 * params * trainers * inner_steps * rounds
    return {
        "initial_loss": round(before[0], 4),
        "final_loss": round(after[0], 4),
        "accuracy_before": round(before[1], 4),
        "accuracy_after": round(after[1], 4),
        "accuracy_curve": curve,
        "bytes_exchanged": measured,
        "data_parallel_bytes": data_parallel,
        "data_parallel_bytes_is": "computed: 2 x 4 bytes x parameters x trainers x inner steps",
    }
