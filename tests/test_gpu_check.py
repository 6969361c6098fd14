"""``scripts/gpu-check.sh --cpu``: the GPU check's whole run, without a GPU, before GPU time is spent on it.

GPU time comes in one short slot (docs/gpu.md), so the script must be known to
work end to end here: a real local cluster, the demo's DiLoCo job, the task job
whose output is captured, one JSON report, and nothing left running after it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu-check.sh"


def _processes_naming(fragment: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fragment in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.timeout(360)
def test_the_cpu_run_reports_the_demo_and_the_task_and_leaves_nothing_running(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(SCRIPT), "--cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=330,
        cwd=REPO,
        check=False,
    )
    report = json.loads((out / "gpu-check.json").read_text())
    assert proc.returncode == 0, (report.get("steps"), proc.stdout[-3000:], proc.stderr[-3000:])
    assert (out / "gpu-check.log").read_text()

    assert report["mode"] == "cpu"
    assert {"torch", "probe", "cluster", "demo", "task", "workers", "nvidia_smi", "steps"} <= report.keys()
    assert all(step["ok"] for step in report["steps"].values()), report["steps"]
    assert report["torch"]["cuda_available"] is False
    assert report["probe"]["sandbox"] in {"bwrap", "landlock"}

    demo = report["demo"]
    assert demo["state"].upper() == "SUCCEEDED"
    assert demo["rounds"] == report["rounds"]
    assert demo["final_loss"] < demo["initial_loss"]

    task = report["task"]
    assert task["state"].upper() == "SUCCEEDED"
    assert any("CUDA_VISIBLE_DEVICES=''" in line for line in task["output"]), task["output"]
    assert any("torch.cuda.device_count()=0" in line for line in task["output"]), task["output"]

    assert len(report["workers"]) == 3
    assert _processes_naming(report["state_dir"]) == []
