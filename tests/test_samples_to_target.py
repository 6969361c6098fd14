"""``benchmarks/samples_to_target.py --quick`` runs its variants to their sample cap and reports
held-out accuracy at the samples it says, with the median rule its JSON states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "samples_to_target.py"


@pytest.mark.timeout(600)
def test_the_quick_run_scores_each_variant_at_its_rounds_and_counts_a_miss_as_the_cap(tmp_path: Path) -> None:
    args = ["--quick", "--variants", "ddp,int8,overlap", "--plot", str(tmp_path / "curve.png")]
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"] == "samples_to_target" and result["seeds"] == [0]
    for variant in ("ddp", "int8", "overlap"):
        row = result["variants"][variant]
        (curve,) = row["curves"]
        # Scored every 6,400 samples (a DiLoCo round of 2 x 50 x 64) up to the 12,800 cap.
        assert [samples for samples, _ in curve] == [6400, 12800], variant
        assert all(0.0 <= accuracy <= 1.0 for _, accuracy in curve)
        # 12,800 samples are far too few for 90 %: a miss, counted as the cap in the median.
        assert row["samples"] == [None] and row["median"] == 12800
    assert result["figure"] == 12800 and result["ratio"] == 1.0
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "variant",
    [
        "outer-",
        "outer-0.7",
        "outer-0-0.9",
        "outer-0.7-1.0",
        "outer-x-0.9",
        "h20",
        "overlap-0",
        "overlap-51",
        "overlap-x",
        "int8-overlap-0",
        "int8-overlap-x",
        "int8-outer-1.0-0.5",
        "int8-h10",
    ],
)
def test_an_unknown_or_out_of_range_variant_is_refused_with_the_forms_it_takes(variant: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--variants", f"diloco,{variant}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert (
        f"unknown {variant};" in done.stderr
        and "outer-LR-M (LR > 0, 0 <= M < 1), overlap-K or int8-overlap-K (1 <= K <= 50)" in done.stderr
    )


def test_int8_overlap_k_is_int8_both_ways_with_the_update_k_steps_late() -> None:
    sys.path.insert(0, str(BENCHMARK.parent))
    import samples_to_target

    assert (
        samples_to_target._known("int8-overlap-4")
        and samples_to_target.overlap_lag("int8-overlap-4", 50) == 4
    )
    assert (
        samples_to_target._known("int8-overlap") and samples_to_target.overlap_lag("int8-overlap", 50) == 50
    )
    assert samples_to_target.overlap_lag("int8", 50) is None
