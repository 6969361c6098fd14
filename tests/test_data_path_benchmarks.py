"""Every data-path benchmark of docs/performance.md runs its ``--quick`` mode to the end.

No figure is asserted (speed is the benchmarks' business, and this machine is
noisy): what is asserted is that each one still runs against the current code,
checks what it moved (each verifies its results before it reports: sha256 end
to end, identical tensors) and ends with its one JSON line. ``transfer`` once
broke unnoticed when the worker's push handler gained a membership check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["transfer", "slices", "relay", "aggregate", "trainer_overhead", "market"])
def test_the_benchmark_runs_and_reports_its_figure_beside_its_baseline(name: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["name"] == name
    assert last["figure"] > 0 and last["baseline"] > 0
    assert last["ratio"] == pytest.approx(last["figure"] / last["baseline"], rel=1e-3)
