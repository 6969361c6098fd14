"""The README's quickstart, verbatim, from the root of a fresh copy of the tree.

A newcomer runs ``./scripts/demo.sh`` in a clone with every default: the state
dir is the relative ``.hypha``, and the executors that the workers start run in
their own work dirs, so any path left relative breaks the job. CI's other tests
use absolute temporary paths and could not see that; this one copies the tree
(what ``git clone`` would give, plus uncommitted work: ``git ls-files`` of
tracked and untracked-but-not-ignored files) into a temporary directory, points
its ``.venv`` at this checkout's (installed by ``scripts/setup.sh``, so the
script's install step has nothing to do), puts the copy's sources first on the
import path, and runs the README's command with the fewest rounds it allows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hypha.client.cluster import Cluster

pytestmark = pytest.mark.timeout(660)

REPO = Path(__file__).resolve().parents[2]
#: The command the README's quickstart gives, with the shortest run ``--rounds`` allows for a test.
QUICKSTART = ["./scripts/demo.sh", "--rounds", "2", "--output", "json"]


def fresh_copy(dest: Path) -> Path:
    """The tree as a clone of it would hold it (uncommitted work included), without build output."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if not source.is_file():  # deleted in the work tree, not yet committed
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return dest


def install_stamp(root: Path) -> str:
    """What ``scripts/setup.sh`` compares with ``.venv/.hypha-installed`` to skip installing:
    computed by setup.sh's own ``want=$(...)`` command, so the two cannot drift apart."""
    setup = (root / "scripts" / "setup.sh").read_text()
    match = re.search(r"^want=\$\((.*)\)$", setup, re.MULTILINE)
    assert match, "scripts/setup.sh no longer computes its install stamp as want=$(...)"
    return subprocess.run(
        match.group(1),
        shell=True,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.strip()


def test_the_readme_quickstart_demo_runs_verbatim_from_a_fresh_clone(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    assert "./scripts/demo.sh" in readme and "--rounds N" in readme, "the README no longer gives this command"
    root = fresh_copy(tmp_path / "hypha")
    venv = REPO / ".venv"
    stamp = venv / ".hypha-installed"
    if not stamp.is_file() or stamp.read_text().strip() != install_stamp(root):
        # Running setup.sh now would reinstall this checkout's .venv from the copy: never do that here.
        pytest.skip("the .venv is not installed from this tree's pyproject files: run scripts/setup.sh")
    (root / ".venv").symlink_to(venv)
    sources = [root / "libs", *sorted((root / "services").glob("*"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPHA_")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in sources)
    try:
        res = subprocess.run(QUICKSTART, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
        report = json.loads(res.stdout.strip().splitlines()[-1])
        for key in (
            "job_id",
            "initial_loss",
            "final_loss",
            "accuracy_before",
            "accuracy_after",
            "bytes_exchanged",
            "data_parallel_bytes",
            "rounds",
            "workers",
            "plot",
            "model",
            "accuracy_curve",
            "seconds",
        ):
            assert key in report, key
        assert set(report["accuracy_curve"]) == {"0", "1", "2"} and report["seconds"] > 0
        assert report["rounds"] == 2 and report["workers"] == 2
        assert report["final_loss"] < report["initial_loss"]
        assert report["bytes_exchanged"] < report["data_parallel_bytes"]
        # Everything landed in the default, relative state dir of the copy.
        state = root / ".hypha"
        assert Path(report["model"]).is_relative_to(state) and Path(report["plot"]).is_relative_to(state)
        png = Path(report["plot"]).read_bytes()
        assert png.startswith(b"\x89PNG") and b"Matplotlib" in png
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(report["model"])  # the fetched model loads
        # Measured, not the formula: per round each trainer pushed a delta and pulled an update,
        # in int8 by default (a byte per parameter and a scale per block; the wire also carried
        # headers and framing), so strictly more than a byte each and less than fp32's four.
        params = sum(p.numel() for p in model.parameters())
        assert 2 * 2 * 2 * params < report["bytes_exchanged"] < 2 * 2 * 2 * 4 * params
        assert Cluster(state).running() is None  # the demo stopped the cluster it started
        # A normal run logs nothing at ERROR (once: "Failed to detach context" tracebacks).
        logs = sorted((state / "logs").glob("*.log"))
        errors = [
            f"{log.name}: {line}"
            for log in logs
            for line in log.read_text().splitlines()
            if " ERROR " in line
        ]
        assert logs and errors == [], errors[:5]
    finally:
        # Whatever a failed run left behind (no-op after a clean one).
        subprocess.run(
            [str(venv / "bin" / "hypha"), "down"], cwd=root, env=env, capture_output=True, timeout=60
        )
