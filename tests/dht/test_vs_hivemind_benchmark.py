"""``benchmarks/dht_vs_hivemind.py`` without hivemind: it must skip with a reason, not fail.

hivemind is never a dependency of this project, so CI always takes this path;
the side-by-side run itself is a benchmark (README, "DHT"), not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dht_vs_hivemind.py"


def _hivemind_importable() -> bool:
    done = subprocess.run([sys.executable, "-c", "import hivemind"], capture_output=True, timeout=60)
    return done.returncode == 0


@pytest.mark.parametrize("interpreter", ["/nonexistent/python", sys.executable])
def test_without_hivemind_the_benchmark_skips_with_its_reason(interpreter: str) -> None:
    if interpreter == sys.executable and _hivemind_importable():
        pytest.skip("hivemind is importable here, so this interpreter would run the benchmark")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--hivemind-python", interpreter],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["name"] == "dht_vs_hivemind"
    assert interpreter in last["skipped"]
    assert "skipped:" in done.stderr
