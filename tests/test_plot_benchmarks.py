"""``scripts/plot_benchmarks.py``: a saved ``--sweep`` result becomes a matplotlib PNG of its series;
anything else is refused with the file named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "plot_benchmarks.py"


def _sweep_result(path: Path) -> Path:
    points = [
        {"subscribers": n, "figure": 0.05 * n, "baseline": 1.0, "ratio": 0.05 * n} for n in (10, 100, 1000)
    ]
    result = {
        "name": "pubsub",
        "figure": 50.0,
        "unit": "ms",
        "baseline": 1.0,
        "ratio": 50.0,
        "sweep": {"size": "subscribers", "points": points},
    }
    path.write_text("setting up...\n" + json.dumps(result) + "\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_sweep_result_is_drawn_as_a_png_named_after_the_benchmark(tmp_path: Path) -> None:
    saved = _sweep_result(tmp_path / "pubsub.json")
    done = _run(str(saved), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    png = tmp_path / "out" / "pubsub.png"
    assert done.stdout.strip() == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"Matplotlib" in data  # drawn by matplotlib, not an empty placeholder
    assert len(data) > 10_000  # axes, three series and labels, not a blank canvas


def test_a_result_without_a_sweep_is_refused_with_the_file_named(tmp_path: Path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(
        json.dumps({"name": "pubsub", "figure": 1.0, "unit": "ms", "baseline": 1.0, "ratio": 1.0})
    )
    done = _run(str(plain), "--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert "plain.json" in done.stderr and "--sweep" in done.stderr
    assert not (tmp_path / "out").exists()
