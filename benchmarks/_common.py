"""Shared scaffolding for benchmarks (ARCHITECTURE §11): a throwaway PKI,
percentiles, the one-JSON-line result every benchmark prints last, and child
processes for benchmarks that run their nodes as deployed.

Benchmarks import harness code only from here and ``hypha.testing``, never from ``tests``."""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypha.testing.pki import Pki, make_pki

if TYPE_CHECKING:
    from hypha.worker.executors.diloco_settings import InnerSettings


def temp_pki() -> Pki:
    return make_pki(Path(tempfile.mkdtemp(prefix="hypha-bench-")) / "pki")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(name: str, figure: float, unit: str, baseline: float, ratio: float, **extra: Any) -> None:
    result = {
        "name": name,
        "figure": round(figure, 6),
        "unit": unit,
        "baseline": round(baseline, 6),
        "ratio": round(ratio, 4),
        **extra,
    }
    print(json.dumps(result), flush=True)


def demo_inner_settings() -> InnerSettings:
    """The demo job's inner optimizer settings (``hypha demo``'s ``[job.inner_optimizer]``), for
    benchmarks that train its model in process the way its trainers do."""
    from hypha.client import demo
    from hypha.worker.executors.diloco_settings import InnerSettings

    return InnerSettings(
        lr=demo.INNER_LR,
        beta1=demo.INNER_BETAS[0],
        beta2=demo.INNER_BETAS[1],
        max_grad_norm=demo.INNER_MAX_GRAD_NORM,
        weight_decay=demo.INNER_WEIGHT_DECAY,
        warmup_steps=demo.INNER_WARMUP_ROUNDS * demo.INNER_STEPS,
    )


def sizes_arg(text: str) -> list[int]:
    """``--sizes 10,100,1000`` -> [10, 100, 1000] (argparse ``type``)."""
    return [int(part) for part in text.split(",") if part.strip()]


def report_sweep(name: str, unit: str, size_name: str, points: list[dict[str, Any]], **extra: Any) -> None:
    """The last line of a ``--sweep`` run: the series, one point per size, each with its own
    ``figure`` / ``baseline`` / ``ratio`` measured at that size; the top-level figure is the
    largest size's, so the line still reads like any other result (and plots from
    ``scripts/plot_benchmarks.py``)."""
    last = points[-1]
    report(
        name,
        last["figure"],
        unit,
        last["baseline"],
        last["ratio"],
        sweep={"size": size_name, "points": points},
        **extra,
    )


class Child:
    """A child process this benchmark started; ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path | None = None) -> None:
        self.name = name
        self.proc = proc
        self.log = log

    def tail(self, lines: int = 40) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    async def ask(self, line: str, timeout_s: float = 120.0) -> str:
        """Write one command line to the child's stdin (``start_child(stdin=True)``), return the
        line it answers with on stdout."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        answer = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not answer:
            raise RuntimeError(f"{self.name} process ended (exit code {self.proc.returncode})")
        return answer.decode().strip()

    async def stop(self) -> None:
        if self.proc.returncode is not None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def start_child(
    name: str, *argv: str, timeout_s: float = 60.0, stdin: bool = False
) -> tuple[Child, bytes]:
    """Start ``argv`` with its stdout (and, with ``stdin``, its stdin) piped; the child and the
    first line it prints (it prints one once it serves). A child that prints nothing in time is
    stopped and reported."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.PIPE if stdin else None
    )
    child = Child(name, proc)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    except TimeoutError:
        line = b""
    if not line.strip():
        await child.stop()
        raise RuntimeError(f"{name} process did not start (exit code {proc.returncode})")
    return child, line
