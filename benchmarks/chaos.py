"""Chaos run: jobs on a local cluster of real processes while a seeded injector breaks things.

A cluster as ``hypha up`` starts it (two gateways, a data node, a scheduler,
``--workers`` workers; each its own process) runs a series of DiLoCo and task
jobs, two at a time. Meanwhile a fault injector, seeded, at random intervals:

- SIGKILLs a worker that holds a lease (a trainer, a parameter server or a
  task's host, whichever it hits) and restarts it a few seconds later with the
  same identity, as a machine that reboots;
- SIGKILLs a gateway or the data node and restarts it;
- SIGSTOPs a worker for a few seconds, then SIGCONTs it (a stall);
- with ``--roles`` naming ``scheduler``: SIGKILLs the scheduler and restarts it.

The figure is the fraction of jobs that SUCCEEDED. Also counted: kills per
role, stalls, rounds lost (a job's reported round going backwards), and
whether every dataset slice was used exactly once per epoch, checked against
the scheduler's audit lines (``slice N used in epoch E``: no slice twice in
an epoch, every slice in each finished epoch). The seed is in the JSON, so a
failing run is reproducible with ``--seed``.

    python benchmarks/chaos.py --quick          # >= 5 jobs, a few minutes on 2 cores
    python benchmarks/chaos.py --jobs 20        # the full run
    python benchmarks/chaos.py --compose --quick    # the container cluster: 6 jobs, 9 faults
    python benchmarks/chaos.py --compose            # 21 jobs, 24 faults

``--compose`` runs the same idea on the real ``docker-compose.yml`` cluster
(images from ``scripts/images.sh``): docker kills, pauses and network
partitions of trainers, parameter servers, task hosts, gateways, the data
node and the scheduler (``hypha.testing.compose_chaos`` says how faults are aimed and
timed). Its figure is the fraction of jobs that SUCCEEDED; its JSON adds
faults by kind and role, the time from each fault to the struck job's next
round (p50/p95 over node losses; per kind) and from each partition's heal
(p95 over brief partitions: a long one is a node loss),
rounds lost, each fetched result checked, and the slice audit. Everything it
sees goes to a log file whose path it prints first.

Baseline: the same jobs with no faults would all succeed, so ``baseline`` is
1.0 and ``ratio`` equals the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from _common import report

from hypha.testing.cluster import DATASET, TERMINAL, E2ECluster, diloco_toml, slices_exactly_once
from hypha.v1 import common_pb2

GATEWAYS = ("gw0", "gw1")
RECOVERABLE = ("worker", "gateway", "data", "stall")


def task_toml(name: str) -> str:
    script = "import time; [print('step', i, flush=True) or time.sleep(0.5) for i in range(6)]"
    return (
        f'[job]\nname = "{name}"\ncommand = {json.dumps(sys.executable)}\n'
        f"args = {json.dumps(['-c', script])}\ntimeout_s = 60\n"
        "[job.retry]\nmax_attempts = 4\nbackoff_base_s = 0.5\nbackoff_cap_s = 2\n"
    )


@dataclass
class Tally:
    kills: Counter[str] = field(default_factory=Counter)
    stalls: int = 0
    lost_rounds: int = 0
    states: dict[str, str] = field(default_factory=dict)


class Injector:
    """Breaks a random node every few seconds; restarts what it killed. Seeded."""

    def __init__(self, cluster: E2ECluster, rng: random.Random, roles: set[str], tally: Tally) -> None:
        self.cluster = cluster
        self.rng = rng
        self.roles = roles
        self.tally = tally
        self.workers = [name for name, role in cluster.cluster.node_names() if role == "worker"]
        #: Jobs being followed now (the injector aims at their workers).
        self.active: set[str] = set()

    async def _leased_workers(self) -> list[str]:
        """Workers that hold a part of a running job (trainer, parameter server, task), else any."""
        busy: set[str] = set()
        for job_id in list(self.active):
            with contextlib.suppress(Exception):  # the scheduler may be down on purpose
                job = await self.cluster.get(job_id)
                for peer in job.workers:
                    with contextlib.suppress(KeyError):
                        busy.add(self.cluster.peer_of(peer))
        return sorted(busy) or self.workers

    async def _restart_later(self, name: str, after_s: float) -> None:
        await asyncio.sleep(after_s)  # a machine that reboots: down for a while, then back
        await asyncio.to_thread(self.cluster.supervisor.restart_node, name)

    async def run(self, stop: asyncio.Event, interval: tuple[float, float]) -> None:
        restarts: list[asyncio.Task[None]] = []
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.rng.uniform(*interval))
                if stop.is_set():
                    break
                action = self.rng.choice(sorted(self.roles))
                if action == "stall":
                    name = self.rng.choice(self.workers)
                    pid = self.cluster.supervisor.procs[name].pid
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGSTOP)
                        await asyncio.sleep(self.rng.uniform(1.0, 4.0))
                        os.killpg(pid, signal.SIGCONT)
                    self.tally.stalls += 1
                    continue
                if action == "worker":
                    name = self.rng.choice(await self._leased_workers())
                elif action == "gateway":
                    name = self.rng.choice(GATEWAYS)
                elif action == "data":
                    name = "data0"
                else:
                    name = "scheduler"
                if not self.cluster.alive(name):
                    continue
                self.cluster.kill(name)
                self.tally.kills[action] += 1
                restarts.append(asyncio.create_task(self._restart_later(name, self.rng.uniform(1.0, 5.0))))
        finally:
            await asyncio.gather(*restarts, return_exceptions=True)


async def follow(cluster: E2ECluster, job_id: str, tally: Tally, deadline_s: float) -> None:
    """Wait for the job's end; count rounds it reported and later lost."""
    best = 0
    end = time.monotonic() + deadline_s
    state = common_pb2.JOB_STATE_UNSPECIFIED
    while time.monotonic() < end:
        try:
            job = await cluster.get(job_id)
        except Exception:  # the scheduler is down (killed on purpose): ask again
            await asyncio.sleep(1.0)
            continue
        if job.round < best:
            tally.lost_rounds += best - job.round
        best = max(best, job.round)
        state = job.state
        if state in TERMINAL:
            break
        await asyncio.sleep(0.5)
    tally.states[job_id] = common_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower()


async def main(args: argparse.Namespace) -> None:
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    roles = set(args.roles.split(","))
    base = Path(tempfile.mkdtemp(prefix="hypha-chaos-"))
    cluster = E2ECluster(base, workers=args.workers, overrides={"scheduler": ["log.level=debug"]})
    cluster.prepare(samples=512)
    slice_count = len(list((cluster.cluster.data_dir / DATASET).glob("slice-*.safetensors")))
    tally = Tally()
    started = time.monotonic()
    cluster.start()
    try:
        stop = asyncio.Event()
        chaos = Injector(cluster, rng, roles, tally)
        injector = asyncio.create_task(chaos.run(stop, (args.interval, 2 * args.interval)))
        kinds = ["diloco" if i % 2 == 0 else "task" for i in range(args.jobs)]
        for batch_start in range(0, len(kinds), 2):
            batch = []
            for i, kind in enumerate(kinds[batch_start : batch_start + 2], start=batch_start):
                toml = (
                    diloco_toml(cluster.model_dir, rounds=args.rounds, name=f"chaos-{i}", round_timeout_s=15)
                    if kind == "diloco"
                    else task_toml(f"chaos-{i}")
                )
                for _ in range(30):  # the scheduler may be mid-restart
                    try:
                        batch.append(await cluster.submit(toml))
                        break
                    except Exception:
                        await asyncio.sleep(1.0)
            chaos.active = set(batch)
            await asyncio.gather(*(follow(cluster, job_id, tally, args.job_deadline) for job_id in batch))
            print(
                f"after {batch_start + len(batch)} jobs: {dict(Counter(tally.states.values()))}", flush=True
            )
        stop.set()
        await injector
        audit = cluster.log("scheduler")
    finally:
        cluster.stop()
    jobs = args.jobs
    succeeded = sum(1 for state in tally.states.values() if state == "succeeded")
    figure = succeeded / jobs
    report(
        "chaos",
        figure,
        "fraction",
        1.0,
        figure,
        jobs=jobs,
        succeeded=succeeded,
        states=tally.states,
        kills=dict(tally.kills),
        stalls=tally.stalls,
        slices_exactly_once=slices_exactly_once(audit, slice_count),
        lost_rounds=tally.lost_rounds,
        seconds=round(time.monotonic() - started, 1),
        seed=seed,
        roles=sorted(roles),
    )


def compose_main(args: argparse.Namespace) -> None:
    """The chaos run on the container cluster (``--compose``)."""
    from hypha.testing.compose import Cluster
    from hypha.testing.compose_chaos import ChaosRun, plan_faults, plan_jobs

    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="hypha-chaos-compose-"))
    log_path = Path(args.log) if args.log else workdir / f"chaos-{seed}.log"
    log_file = log_path.open("a")
    started = time.monotonic()
    print(f"log: {log_path}", flush=True)

    def log(line: str) -> None:
        stamped = f"{time.monotonic() - started:8.2f} {line}"
        log_file.write(stamped + "\n")
        log_file.flush()
        if args.verbose:
            print(stamped, flush=True)

    jobs = plan_jobs(args.jobs, args.rounds, seed, args.samples)
    faults = plan_faults(args.faults, rng)
    log(f"seed {seed}: {len(jobs)} jobs, faults planned: {faults}")
    with Cluster.up(
        workdir, workers=args.workers, profiles=[], project="hyphachaos", subnets=SUBNETS
    ) as nodes:
        run = ChaosRun(nodes, jobs, faults, rng, log)
        try:
            asyncio.run(run.run())
        finally:
            audit = subprocess.run(
                ["docker", "logs", nodes.containers("scheduler", all_states=True)[0]],
                capture_output=True,
                text=True,
                timeout=120,
            )
            scheduler_log = audit.stdout + audit.stderr
            # Whole, beside the run's log: the last 300 lines below rarely reach back to a fault.
            log_path.with_suffix(".scheduler.log").write_text(scheduler_log)
            log(f"the scheduler's whole log: {log_path.with_suffix('.scheduler.log')}")
            tail = nodes.run("logs", "--no-color", "--tail", "300", check=False, timeout=120).stdout
            log("---- compose logs (last 300 lines per service) ----\n" + tail)
    figures = run.figures(scheduler_log)
    log(json.dumps(figures))
    log_file.close()
    figure = figures["succeeded"] / max(1, figures["jobs"])
    report(
        "chaos_compose",
        figure,
        "fraction",
        1.0,
        figure,
        **figures,
        seconds=round(time.monotonic() - started, 1),
        seed=seed,
        log=str(log_path),
    )


#: Own subnets, so a chaos run may share the machine with a user's cluster and the container tests.
SUBNETS = ("10.243.0", "10.244.0")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 jobs, 3 workers (a few minutes on 2 cores)")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4, help="outer rounds per DiLoCo job")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--interval", type=float, default=25.0, help="seconds between faults (uniform in [x, 2x])"
    )
    parser.add_argument("--job-deadline", type=float, default=300.0)
    parser.add_argument(
        "--roles",
        default=",".join(RECOVERABLE),
        help="what the injector breaks, comma-separated: worker,gateway,data,stall,scheduler",
    )
    parser.add_argument("--compose", action="store_true", help="chaos on the docker-compose.yml cluster")
    parser.add_argument("--faults", type=int, default=None, help="--compose: faults (default 24; quick 9)")
    parser.add_argument(
        "--samples", type=int, default=2048, help="--compose: samples per DiLoCo round (~4 s a round)"
    )
    parser.add_argument("--log", default=None, help="--compose: the log file (default: in a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="--compose: print the log as it goes")
    parsed = parser.parse_args()
    if parsed.compose:
        jobs_given = parsed.jobs != parser.get_default("jobs")
        if parsed.quick:
            parsed.jobs = parsed.jobs if jobs_given else 6
            parsed.faults = parsed.faults or 9
            parsed.rounds = parsed.rounds if parsed.rounds != parser.get_default("rounds") else 10
        else:
            parsed.jobs = parsed.jobs if jobs_given else 21
            parsed.faults = parsed.faults or 24
            parsed.rounds = parsed.rounds if parsed.rounds != parser.get_default("rounds") else 10
        # Two jobs at a time of three parts each, and two spares: a lost part's replacement
        # starts at once rather than waiting for the killed container to come back.
        parsed.workers = parsed.workers if parsed.workers != parser.get_default("workers") else 8
        compose_main(parsed)
    else:
        if parsed.quick:
            parsed.jobs, parsed.rounds = min(parsed.jobs, 6), min(parsed.rounds, 3)
        asyncio.run(main(parsed))
