"""The demo's figures: the matplotlib plot, the job metrics it reads, held-out scoring, the plain view."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import torch
from rich.console import Console

from hypha.client import demo_eval
from hypha.client.plot import DPI, SIZE_IN, training_plot
from hypha.datasets import synthetic
from hypha.v1 import scheduler_pb2


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_is_a_matplotlib_png_of_the_declared_size(tmp_path: Path) -> None:
    # Execute
    path = training_plot(
        {r: 2.0 / (r + 1) for r in range(10)},
        {0: 0.0, 5: 0.4, 10: 0.9},
        {"worker1": {r: 900.0 for r in range(10)}, "worker2": {r: 850.0 for r in range(10)}},
        tmp_path / "out" / "demo.png",
        title="demo",
    )

    # Assert
    data = path.read_bytes()
    assert _png_size(data) == (round(SIZE_IN[0] * DPI), round(SIZE_IN[1] * DPI))
    assert b"Matplotlib" in data  # matplotlib's Software text chunk, not a hand-made writer


def _point(round_: int, worker: str, name: str, value: float) -> scheduler_pb2.MetricPoint:
    return scheduler_pb2.MetricPoint(round=round_, worker_id=worker, name=name, value=value)


def test_figures_average_trainer_losses_and_sum_each_workers_latest_byte_counters() -> None:
    points = [
        _point(0, "t1", "loss", 2.0),
        _point(0, "t2", "loss", 1.0),
        _point(0, "t1", "samples_per_second", 100.0),
        _point(0, "t1", "tensor_bytes_pushed", 10.0),
        _point(0, "t1", "tensor_bytes_pulled", 20.0),
        _point(1, "t1", "tensor_bytes_pushed", 30.0),  # cumulative: the latest counts
        _point(1, "t1", "tensor_bytes_pulled", 60.0),
        _point(1, "t2", "tensor_bytes_pushed", 5.0),
        _point(0, "ps", "samples", 128.0),  # the parameter server's figures are not losses
        _point(0, "ps", "tensor_bytes_pushed", 0.0),
    ]

    figures = demo_eval.figures(points, {"t1": "worker1"})

    assert figures.losses == {1: 1.5}  # by rounds completed
    assert figures.throughput == {"worker1": {1: 100.0}}
    assert figures.bytes_exchanged == 30 + 60 + 5


def test_curve_rounds_spread_over_the_job_and_always_hold_both_ends() -> None:
    assert demo_eval.curve_rounds(list(range(1, 50)), 50, 10) == [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50]
    assert demo_eval.curve_rounds([], 2, 10) == [0, 2]


class _Adder(torch.nn.Module):
    """A "model" that writes the right reversed answer for every prompt but the first."""

    def forward(self, input_ids: torch.Tensor, **_: object) -> object:
        rows = []
        for row in input_ids.tolist():
            text = synthetic.decode_bytes(row)
            a, b = (int(x) for x in text[:7].split("+"))
            written = text[8:]
            full = synthetic.arithmetic_answer(a + b) + "\n"
            nxt = full[len(written)] if len(written) < len(full) else "\n"
            if (a, b) == self.wrong:
                nxt = "7"
            logits = torch.full((len(row), synthetic.VOCAB_SIZE), -10.0)
            logits[-1, ord(nxt)] = 10.0
            rows.append(logits)
        return type("Out", (), {"logits": torch.stack(rows), "loss": torch.tensor(0.5)})()

    def __init__(self, wrong: tuple[int, int]) -> None:
        super().__init__()
        self.wrong = wrong


def test_score_generates_greedily_and_counts_exact_answers() -> None:
    data = demo_eval.heldout(20)
    first = synthetic.heldout_pairs(1, seed=0)[0]

    loss, accuracy = demo_eval.score(_Adder(wrong=first), data)

    assert loss == 0.5
    assert accuracy == 19 / 20


def test_the_plain_view_writes_lines_without_terminal_codes() -> None:
    out = io.StringIO()
    view = demo_eval.LiveView(quiet=False, console=Console(file=out, force_terminal=False, width=200))
    view.names = {"peer-1": "worker1"}

    view.submitted("job1", 3)
    view.event(1, 1.25, [("peer-1", 812.0)])
    view.event(1, 1.20, [("peer-1", 815.0)])  # same round: no new line
    view.done()

    text = out.getvalue()
    assert "\x1b[" not in text
    assert text.splitlines()[1:] == ["  round 1/3  loss 1.250  worker1 812 samples/s"]


def test_thetas_are_collected_from_the_jobs_published_dir_except_a_file_still_being_written(
    tmp_path: Path,
) -> None:
    # Arrange: the server's published θ files (the newest cut short), and another job's
    from safetensors.torch import save_file

    from hypha.client.demo import collect_thetas

    published = tmp_path / "nodes" / "worker2" / "work" / "abc123-ps" / "published"
    published.mkdir(parents=True)
    for n in (1, 2, 3):
        save_file({"w": torch.full((64,), float(n))}, str(published / f"theta-{n}.safetensors"))
    newest = published / "theta-3.safetensors"
    newest.write_bytes(newest.read_bytes()[:-16])
    other = tmp_path / "nodes" / "worker1" / "work" / "zzz999-ps" / "published"
    other.mkdir(parents=True)
    save_file({"w": torch.zeros(4)}, str(other / "theta-7.safetensors"))
    have: dict[int, Path] = {}
    into = tmp_path / "into"

    # Execute
    collect_thetas(tmp_path, "abc123", into, have)

    # Assert: the incomplete one is neither kept nor left behind; it is taken once whole
    assert sorted(have) == [1, 2] and have[2].parent == into
    assert sorted(p.name for p in into.iterdir()) == ["theta-1.safetensors", "theta-2.safetensors"]
    save_file({"w": torch.full((64,), 3.0)}, str(newest))
    collect_thetas(tmp_path, "abc123", into, have)
    assert sorted(have) == [1, 2, 3]
