"""A whole local cluster as real processes, and a client for it (tests and the chaos benchmark).

``E2ECluster`` is ``hypha up`` without the foreground loop: the same
``Supervisor`` starts two federated gateways, a data node, a scheduler and N
workers, each a separate process with its own log, configured with market
timings short enough for tests (leases of a few seconds, so a killed worker
is noticed quickly). Before the nodes start it writes what the jobs need: the
synthetic arithmetic dataset into the data node's dir (announced at start)
and a tiny GPT-2 saved with ``save_pretrained`` (given to jobs as
``model.local_path``, so nothing touches the network).

The client side talks to the scheduler's client API over mTLS with the
cluster's ``client`` certificate, the way ``hypha`` does. Needs the client
distribution (``hypha.client.cluster``) and every role's installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from hypha.client.cluster import Cluster
from hypha.client.follow import TERMINAL
from hypha.client.supervisor import Supervisor
from hypha.net.channel import secure_channel
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

DATASET = "arithmetic"
#: Samples per slice of the e2e dataset: small, so a round spans several slices.
SAMPLES_PER_SLICE = 32

#: Overrides that make the market react in test time (ARCHITECTURE §5 defaults are 10 s leases).
FAST_MARKET: dict[str, list[str]] = {
    "scheduler": [
        "scheduler.lease_ttl_s=3.0",
        "scheduler.rpc_timeout_s=1.0",
        "scheduler.replace_retry_s=0.5",
    ],
    "worker": [
        "worker.lease_ttl_s=3.0",
        "worker.prune_interval_s=0.1",
    ],
}


def children_of(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def merge_overrides(*parts: dict[str, list[str]]) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for part in parts:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    return merged


def diloco_toml(
    model_dir: Path,
    *,
    rounds: int,
    samples_per_round: int = 128,
    name: str = "tiny",
    round_timeout_s: float = 8,
) -> str:
    """A small DiLoCo job on the cluster's dataset and tiny model: 2 trainers, batches of 8, quorum 0.5."""
    return f"""
[job]
name = "{name}"
dataset = "{DATASET}"
rounds = {rounds}
samples_per_round = {samples_per_round}
min_batch_size = 8
max_batch_size = 8
quorum = 0.5
round_timeout_s = {round_timeout_s:g}

[job.model]
local_path = {json.dumps(str(model_dir))}
type = "causal-lm"

[job.inner_optimizer]
learning_rate = 0.003

[job.outer_optimizer]
learning_rate = 0.7
momentum = 0.9

[job.resources]
num_workers = 2
"""


#: The scheduler's audit line for each slice a trainer finished (DEBUG level).
SLICE_AUDIT = re.compile(r"job (\S+): slice (\d+) used in epoch (\d+) by (\S+)")
#: The line each scheduler process logs before it handles any call: a log may hold several.
SCHEDULER_START = re.compile(r"hypha\.net\.server: listening on ")


def slice_uses(scheduler_log: str, job_id: str | None = None) -> dict[tuple[str, int], list[int]]:
    """(job, epoch) -> slice indices marked used, in order, from a scheduler's DEBUG log.

    NOTE: a process killed between marking a slice used and saving that lost the mark;
    the trainer reports the slice again to the restarted process, which logs it again.
    That repeat (same slice, epoch and trainer, in a later process) is the same use and
    counted once; a repeat within one process or by another trainer is a second use.
    """
    used: dict[tuple[str, int], list[int]] = {}
    seen: dict[tuple[str, int, int], tuple[int, str]] = {}
    process = 0
    for line in scheduler_log.splitlines():
        if SCHEDULER_START.search(line):
            process += 1
            continue
        match = SLICE_AUDIT.search(line)
        if match is None or (job_id is not None and match.group(1) != job_id):
            continue
        job, index, epoch, worker = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        before = seen.get((job, epoch, index))
        if before is not None and before[0] < process and before[1] == worker:
            continue
        seen[(job, epoch, index)] = (process, worker)
        used.setdefault((job, epoch), []).append(index)
    return used


def slices_exactly_once(scheduler_log: str, slice_count: int, job_id: str | None = None) -> bool:
    """No slice used twice in one epoch, and every slice used in each epoch a later one followed."""
    used = slice_uses(scheduler_log, job_id)
    for (job, epoch), indices in used.items():
        if len(indices) != len(set(indices)):
            return False
        if (job, epoch + 1) in used and sorted(indices) != list(range(slice_count)):
            return False
    return bool(used)


class E2ECluster:
    """A local cluster for one test module; ``start()`` blocks until every node is ready."""

    def __init__(self, base: Path, workers: int, overrides: dict[str, list[str]] | None = None) -> None:
        self.base = base
        self.cluster = Cluster(base / "state", workers, merge_overrides(FAST_MARKET, overrides or {}))
        self.supervisor = Supervisor(self.cluster)
        #: Under the cluster's models dir, which ``hypha up`` lets jobs name by local path.
        self.model_dir = self.cluster.models_dir / "tiny-gpt2"

    # ---- lifecycle ---------------------------------------------------------------

    def prepare(self, *, samples: int = 1024) -> None:
        """Dataset and model, written before the nodes start (the data node announces at start)."""
        from hypha.datasets.prepare import prepare_synthetic
        from hypha.models import save_tiny_model

        self.cluster.data_dir.mkdir(parents=True, exist_ok=True)
        if not (self.cluster.data_dir / DATASET).exists():
            prepare_synthetic(
                DATASET, self.cluster.data_dir, DATASET, samples=samples, samples_per_slice=SAMPLES_PER_SLICE
            )
        if not (self.model_dir / "config.json").exists():
            save_tiny_model("causal-lm", self.model_dir, seed=0)

    def start(self) -> E2ECluster:
        try:
            self.supervisor.start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.supervisor.stop_all()

    # ---- nodes ---------------------------------------------------------------------

    def node(self, name: str) -> dict[str, Any]:
        return self.supervisor.info[name]

    def peer_of(self, peer_id: str) -> str:
        """The node name of a peer id."""
        for name, info in self.supervisor.info.items():
            if info.get("peer_id") == peer_id:
                return name
        raise KeyError(peer_id)

    def kill(self, name: str) -> None:
        """SIGKILL a node as if its machine died: its process group and its executors.

        Executors lead process groups of their own (the worker stops a job by
        signalling its group), so they are found as the node's children first.
        """
        proc = self.supervisor.procs[name]
        if proc.poll() is not None:
            return
        executors = children_of(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        for pid in executors:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        proc.wait(10)

    def alive(self, name: str) -> bool:
        return self.supervisor.procs[name].poll() is None

    def log(self, name: str) -> str:
        return Path(self.node(name)["log"]).read_text(errors="replace")

    def logs(self, names: Iterable[str] | None = None, tail: int = 60) -> str:
        """The last lines of each node's log, for failure messages."""
        out = []
        for name in names or self.supervisor.info:
            lines = self.log(name).splitlines()[-tail:]
            out.append(f"--- {name} ---\n" + "\n".join(lines))
        return "\n".join(out)

    # ---- client API ----------------------------------------------------------------

    @property
    def pki_dir(self) -> Path:
        return self.cluster.pki_dir

    def client_tls(self) -> TlsMaterial:
        return TlsMaterial.load(PathsTls.from_certs_dir(self.cluster.pki_dir, "client"))

    def channel(self) -> grpc.aio.Channel:
        return secure_channel(self.client_tls(), self.node("scheduler")["address"])

    async def submit(self, toml: str, files_bundle: bytes = b"") -> str:
        async with self.channel() as channel:
            job = await scheduler_pb2_grpc.SchedulerStub(channel).SubmitJob(
                scheduler_pb2.SubmitJobRequest(toml=toml, files_bundle=files_bundle), timeout=10
            )
        return str(job.job_id)

    async def get(self, job_id: str) -> scheduler_pb2.Job:
        async with self.channel() as channel:
            return await scheduler_pb2_grpc.SchedulerStub(channel).GetJob(
                scheduler_pb2.GetJobRequest(job_id=job_id), timeout=10
            )

    async def wait(
        self, job_id: str, timeout_s: float, states: frozenset[int] = TERMINAL
    ) -> scheduler_pb2.Job:
        """Poll until the job is in one of ``states``; the failure names the state and the node logs."""
        deadline = time.monotonic() + timeout_s
        job = await self.get(job_id)
        while job.state not in states:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still {common_pb2.JobState.Name(job.state)} ({job.reason}) after "
                    f"{timeout_s:.0f}s\n{self.logs()}"
                )
            await asyncio.sleep(0.2)
            job = await self.get(job_id)
        return job

    async def wait_round(self, job_id: str, round_: int, timeout_s: float) -> scheduler_pb2.Job:
        """Poll until the running job completed ``round_`` rounds (fails if it ends or times out)."""
        deadline = time.monotonic() + timeout_s
        job = await self.get(job_id)
        while job.round < round_:
            if job.state in TERMINAL or time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} is {common_pb2.JobState.Name(job.state)} at round {job.round} "
                    f"({job.reason}), waiting for round {round_}\n{self.logs()}"
                )
            await asyncio.sleep(0.2)
            job = await self.get(job_id)
        return job

    async def log_lines(self, job_id: str) -> list[scheduler_pb2.LogLine]:
        async with self.channel() as channel:
            stream = scheduler_pb2_grpc.SchedulerStub(channel).GetLogs(
                scheduler_pb2.GetLogsRequest(job_id=job_id, follow=False), timeout=10
            )
            return [line async for line in stream]

    async def fetch_result(self, job_id: str, out_dir: Path) -> list[Path]:
        """``FetchResult`` into ``out_dir``; the files written."""
        files: dict[str, list[bytes]] = {}
        current = ""
        async with self.channel() as channel:
            stream = scheduler_pb2_grpc.SchedulerStub(channel).FetchResult(
                scheduler_pb2.FetchResultRequest(job_id=job_id), timeout=60
            )
            async for piece in stream:
                if piece.path:
                    current = piece.path
                    files[current] = []
                assert current, "a FetchResult chunk before any file name"
                files[current].append(piece.chunk.data)

        def write() -> list[Path]:
            written = []
            for name, parts in files.items():
                target = out_dir / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(b"".join(parts))
                written.append(target)
            return written

        return await asyncio.to_thread(write)

    def state_json(self) -> dict[str, Any]:
        return json.loads(self.cluster.state_file.read_text())
