"""The run behind ``scripts/gpu-check.sh``: one bounded pass over what a GPU machine offers us.

GPU time comes in one short, prepared slot, so every step is bounded by its
own timeout, a failed step is recorded and the run goes on to the next, and
everything measured lands in ``OUT/gpu-check.json`` (with ``OUT/gpu-check.log``)
even when steps fail: a half-failed run still tells the next session what to
fix. ``--cpu`` is the same run on a machine without a GPU (the suite runs it,
so the script is known to work before GPU time is spent). See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = ("transfer", "slices", "relay", "trainer_overhead")
#: Why the demo's trainers are expected on CPU even on a GPU machine (docs/gpu.md).
DEMO_DEVICE_NOTE = (
    "the demo's job asks for no GPU, so its executors get CUDA_VISIBLE_DEVICES='' and the trainer, "
    "which picks cuda only when torch.cuda.is_available(), trains on CPU"
)
#: What the task job runs: the GPU slots it was given and what torch sees through them.
TASK_PROGRAM = (
    "import os\n"
    "print('CUDA_VISIBLE_DEVICES=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')), flush=True)\n"
    "try:\n"
    "    import torch\n"
    "    print('torch.cuda.device_count()=' + str(torch.cuda.device_count()), flush=True)\n"
    "except Exception as err:\n"
    "    print('torch.cuda.device_count()=unavailable: ' + repr(err), flush=True)\n"
)


class Run:
    """The report being built and the log beside it; ``step`` records each step's outcome."""

    def __init__(self, out: Path, cpu: bool) -> None:
        self.out = out
        self.report: dict[str, Any] = {"mode": "cpu" if cpu else "gpu", "steps": {}}
        self.log = open(out / "gpu-check.log", "a", buffering=1)  # closed at the end of main

    def say(self, line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        self.log.write(stamped + "\n")

    def step(self, name: str, body: Callable[[], Any]) -> Any:
        """Run one step; its result goes under ``name``, its failure into ``steps`` (the run goes on)."""
        self.say(f"step {name} ...")
        started = time.monotonic()
        outcome: dict[str, Any] = {}
        result = None
        try:
            result = body()
            outcome["ok"] = True
        except Exception as err:
            outcome.update(ok=False, error=f"{type(err).__name__}: {err}")
        outcome["seconds"] = round(time.monotonic() - started, 1)
        self.report["steps"][name] = outcome
        if result is not None:
            self.report[name] = result
        self.say(
            f"step {name}: {'ok' if outcome['ok'] else 'FAILED ' + outcome['error']} ({outcome['seconds']} s)"
        )
        self.save()
        return result

    def command(self, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
        """Run ``argv`` to completion within ``timeout_s``; stdout back, both streams into the log."""
        self.say("$ " + " ".join(argv))
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=REPO, check=False
        )
        self.log.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"exit {proc.returncode}: {' | '.join(tail)}")
        return proc.stdout

    def save(self) -> None:
        path = self.out / "gpu-check.json"
        path.write_text(json.dumps(self.report, indent=2, sort_keys=True) + "\n")


def hypha_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def last_json(text: str) -> Any:
    """The last line of ``text`` that parses as a JSON object or list (what a tool prints last)."""
    for line in reversed(text.strip().splitlines()):
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict | list):
                return value
    # One pretty-printed document (hypha demo --output json).
    return json.loads(text)


def torch_facts(run: Run) -> dict[str, Any]:
    probe = (
        "import json, torch\n"
        "ok = torch.cuda.is_available()\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda_available': ok, 'cuda': torch.version.cuda,\n"
        "  'device_count': torch.cuda.device_count() if ok else 0,\n"
        "  'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]\n"
        "     if ok else [],\n"
        "  'bf16_supported': bool(ok and torch.cuda.is_bf16_supported())}))\n"
    )
    facts: dict[str, Any] = last_json(run.command([sys.executable, "-c", probe], 120))
    facts.update(python=sys.version.split()[0], cpu_count=os.cpu_count())
    return facts


class GpuSampler:
    """``nvidia-smi`` polled while the jobs run, when it exists: utilization and memory over time."""

    def __init__(self) -> None:
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.binary = shutil.which("nvidia-smi")

    def start(self) -> None:
        if self.binary:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        assert self.binary is not None
        query = [
            self.binary,
            "--query-gpu=index,utilization.gpu,memory.used",
            "--format=csv,noheader,nounits",
        ]
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
                for line in out.strip().splitlines():
                    index, util, memory = (field.strip() for field in line.split(","))
                    self.samples.append(
                        {
                            "t": round(time.time(), 1),
                            "gpu": int(index),
                            "util": float(util),
                            "mib": float(memory),
                        }
                    )
            self._stop.wait(1.0)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)
        if not self.binary:
            return {"present": False}
        utils = [s["util"] for s in self.samples]
        return {
            "present": True,
            "samples": len(self.samples),
            "util_max": max(utils, default=None),
            "util_mean": round(sum(utils) / len(utils), 1) if utils else None,
            "memory_mib_max": max((s["mib"] for s in self.samples), default=None),
            "series": self.samples[-600:],
        }


class LocalCluster:
    """``hypha up`` in the background for the run, ``hypha down`` after it, whatever happened between."""

    def __init__(self, run: Run, state_dir: Path, env: dict[str, str]) -> None:
        self.run = run
        self.state_dir = state_dir
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def up(self, timeout_s: float) -> dict[str, Any]:
        from hypha.client.cluster import Cluster

        log = open(self.state_dir.parent / "up.log", "ab")  # the child holds it
        argv = hypha_cmd("hypha.client.cli", "up", "--state-dir", str(self.state_dir), "--workers", "3")
        self.run.say("$ " + " ".join(argv))
        self.proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, start_new_session=True
        )
        cluster = Cluster(self.state_dir)
        deadline = time.monotonic() + timeout_s
        while (state := cluster.running()) is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hypha up exited with {self.proc.returncode} (see up.log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster was not up within {timeout_s:.0f} s (see up.log)")
            time.sleep(0.5)  # another process's file: nothing to wait on but polling
        return {"nodes": sorted(state["nodes"])}

    def down(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            self.run.command(hypha_cmd("hypha.client.cli", "down", "--state-dir", str(self.state_dir)), 60)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(10)


def job_state(run: Run, job_id: str, env: dict[str, str]) -> str:
    status = last_json(
        run.command(hypha_cmd("hypha.client.cli", "status", job_id, "--output", "json"), 30, env)
    )
    return str(status.get("state", status))


def demo(run: Run, rounds: int, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    argv = hypha_cmd("hypha.client.cli", "demo", "--rounds", str(rounds), "--output", "json")
    report: dict[str, Any] = last_json(run.command(argv, timeout_s, env))
    report["state"] = job_state(run, str(report["job_id"]), env)
    report["device_note"] = DEMO_DEVICE_NOTE
    return report


def task_job(run: Run, gpus: int, env: dict[str, str], work: Path, timeout_s: float) -> dict[str, Any]:
    job_file = work / "task.toml"
    args = json.dumps(["-c", TASK_PROGRAM])
    job_file.write_text(
        f'[job]\nname = "gpu-check-task"\ncommand = {json.dumps(sys.executable)}\nargs = {args}\n'
        f"gpus = {gpus}\ntimeout_s = {int(timeout_s)}\n"
    )
    cli = "hypha.client.cli"
    submitted = last_json(run.command(hypha_cmd(cli, "submit", str(job_file), "--output", "json"), 60, env))
    job_id = str(submitted["job_id"])
    with contextlib.suppress(RuntimeError):  # watch exits 1 for a failed job: the state says so below
        run.command(hypha_cmd(cli, "watch", job_id), timeout_s, env)
    logs = run.command(hypha_cmd(cli, "logs", job_id), 60, env)
    lines = [
        line for line in logs.splitlines() if "CUDA_VISIBLE_DEVICES=" in line or "device_count()=" in line
    ]
    return {"job_id": job_id, "gpus": gpus, "state": job_state(run, job_id, env), "output": lines}


def benchmark(run: Run, name: str, timeout_s: float) -> dict[str, Any]:
    path = REPO / "benchmarks" / f"{name}.py"
    if not path.exists():
        return {"skipped": f"{path} does not exist"}
    out = run.command([sys.executable, str(path), "--quick"], timeout_s)
    try:
        figures: dict[str, Any] = last_json(out)
    except ValueError:
        figures = {"stdout_tail": out.strip().splitlines()[-20:]}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="where gpu-check.json and the log go")
    parser.add_argument("--cpu", action="store_true", help="no GPU: the task asks for none, no benchmarks")
    parser.add_argument("--rounds", type=int, default=None, help="demo rounds (default 6; --cpu 2)")
    parser.add_argument("--benchmarks", default=None, help="comma-separated (default all; --cpu none)")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="the benchmarks are skipped once this is spent"
    )
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (2 if args.cpu else 6)
    chosen = args.benchmarks if args.benchmarks is not None else ("" if args.cpu else ",".join(BENCHMARKS))
    run = Run(out, args.cpu)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    state_dir = work / "state"
    env = {**os.environ, "HYPHA_STATE_DIR": str(state_dir)}
    env.pop("HYPHA_SCHEDULER", None)
    deadline = time.monotonic() + args.budget_s
    run.report.update(
        rounds=rounds, state_dir=str(state_dir), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    )
    run.step("torch", lambda: torch_facts(run))
    run.step(
        "probe", lambda: last_json(run.command(hypha_cmd("hypha.worker.cli", "probe", "--machine"), 120))
    )
    sampler = GpuSampler()
    sampler.start()
    cluster = LocalCluster(run, state_dir, env)
    try:
        if run.step("cluster", lambda: cluster.up(180)) is not None:
            run.step("demo", lambda: demo(run, rounds, env, 300 if args.cpu else 200))
            gpus = 0 if args.cpu else 1
            run.step("task", lambda: task_job(run, gpus, env, work, 90))
            workers = hypha_cmd("hypha.client.cli", "workers", "--output", "json")
            run.step("workers", lambda: last_json(run.command(workers, 30, env)))
    finally:
        cluster.down()
        run.report["nvidia_smi"] = sampler.stop()
    for name in filter(None, chosen.split(",")):
        left = deadline - time.monotonic()
        if left < 30:
            run.report["steps"][f"bench_{name}"] = {
                "ok": False,
                "error": f"skipped: {left:.0f} s of the budget left",
            }
            continue
        run.step(f"bench_{name}", functools.partial(benchmark, run, name, min(150.0, left - 10)))
    run.report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.report["ok"] = all(step["ok"] for step in run.report["steps"].values())
    run.save()
    run.log.close()
    shutil.rmtree(work, ignore_errors=True)
    return 0 if run.report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
