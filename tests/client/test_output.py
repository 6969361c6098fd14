"""What people see: rich tables and the live job view on a terminal, plain lines in a pipe."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import sys
import time
from pathlib import Path

from rich.console import Console

from hypha.client.output import NO_WORKERS, event_line, event_view, worker_rows, workers_view
from hypha.jobfile import parse_job_toml
from hypha.scheduler.store import LogEntry
from hypha.timestamps import to_timestamp
from hypha.v1 import common_pb2, scheduler_pb2
from tests.client.test_cli import _env, hypha, served
from tests.conftest import Pki
from tests.scheduler.test_servicer import DILOCO_TOML, Served

__all__ = ["served"]


def idle_and_leased() -> list[scheduler_pb2.WorkerView]:
    idle = scheduler_pb2.WorkerView(
        peer=common_pb2.PeerInfo(peer_id="a" * 52, name="gpu-box-1"),
        capacity=common_pb2.Resources(cpu=16, memory_gb=23.5406, gpu=1, gpu_memory_gb=79.6472),
        healthy=True,
        last_seen=to_timestamp(time.time() - 125),
    )
    leased = scheduler_pb2.WorkerView(
        peer=common_pb2.PeerInfo(peer_id="b" * 52, name="cpu-box-2"),
        capacity=common_pb2.Resources(cpu=4, memory_gb=8),
        leases=[common_pb2.Lease(lease_id="l1")],
        job_id="job-9",
        samples_per_second=12.5,
    )
    return [idle, leased]


def render(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system=None, width=160).print(renderable)
    return out.getvalue()


def test_worker_rows_name_every_worker_leased_or_idle_with_rounded_figures() -> None:
    idle, leased = worker_rows(idle_and_leased())
    assert idle[:4] == ["gpu-box-1", "a" * 16, "idle", "-"]
    assert idle[4:8] == ["16", "23.5", "1", "79.6"]
    assert idle[-1] == "2m"
    assert leased[:4] == ["cpu-box-2", "b" * 16, "leased", "job-9"]
    assert leased[8:10] == ["12.5", "1"] and leased[-1] == "-"


def test_the_terminal_views_are_rich_tables_and_a_round_progress_bar() -> None:
    table = render(workers_view(idle_and_leased()))
    assert "2 workers, 1 leased" in table and "gpu-box-1" in table and "23.5" in table
    assert "23.54" not in table and "─" in table  # drawn by rich, figures rounded
    assert NO_WORKERS in render(workers_view([]))

    job = scheduler_pb2.Job(job_id="j1", round=2, rounds=4, loss=2.6, state=common_pb2.JOB_STATE_RUNNING)
    job.spec.diloco.dataset = "d"
    event = scheduler_pb2.JobEvent(
        job=job,
        message="round 1 complete",
        workers=[common_pb2.WorkerMetrics(worker_id="w1", samples_per_second=30.0, samples=300)],
    )
    view = render(event_view(event))
    assert "RUNNING" in view and "2/4" in view and "loss 2.6000" in view and "━" in view
    assert "w1" in view and "30.0" in view and "round 1 complete" in view
    assert event_line(event).endswith(
        "job j1 running round 2/4 loss 2.6000 1 workers 30.0 samples/s: round 1 complete"
    )


async def test_hypha_workers_draws_a_table_on_a_terminal_and_plain_rows_in_a_pipe(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    served.orchestrator.views = idle_and_leased()
    code, out, _ = await hypha(served, pki, tmp_path, "workers")
    header, *rows = out.splitlines()
    assert code == 0 and header.split()[:3] == ["WORKER", "PEER", "ID"]
    assert [row.split()[:3] for row in rows] == [
        ["gpu-box-1", "a" * 16, "idle"],
        ["cpu-box-2", "b" * 16, "leased"],
    ]
    assert "23.5 " in out and "23.54" not in out and "─" not in out

    # A pseudo-terminal as stdout: rich draws the table.
    primary, secondary = pty.openpty()
    flags = ["--scheduler", served.address, "--certs", str(pki.dir), "--name", "client"]
    env = {**_env(tmp_path), "TERM": "xterm", "COLUMNS": "160"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hypha.client.cli", *flags, "workers", stdout=secondary, env=env
    )
    os.close(secondary)
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    drawn = b""
    while True:
        try:
            chunk = os.read(primary, 65536)
        except OSError:  # the terminal closed: everything was read
            break
        if not chunk:
            break
        drawn += chunk
    os.close(primary)
    text = drawn.decode()
    assert "gpu-box-1" in text and "─" in text and "2 workers, 1 leased" in text


async def test_hypha_logs_says_which_worker_and_executor_wrote_each_line(
    served: Served, pki: Pki, tmp_path: Path
) -> None:
    job = await served.api.submit_spec(pki.tls("client").identity, parse_job_toml(DILOCO_TOML))
    await served.store.append_logs(
        job.job_id,
        [
            LogEntry(
                "round 1 loss 2.5", worker_id="w" * 52, worker_name="worker1", executor="diloco-trainer"
            ),
            LogEntry("aggregated", worker_id="p" * 52, worker_name="worker2", executor="parameter-server"),
            LogEntry("oops", stream="stderr", worker_id="q" * 52, executor="task"),
            LogEntry("scheduled"),
        ],
    )

    code, out, err = await hypha(served, pki, tmp_path, "logs", job.job_id)
    assert code == 0
    assert out.splitlines() == [
        "[worker1 diloco-trainer] round 1 loss 2.5",
        "[worker2 parameter-server] aggregated",
        "scheduled",
    ]
    assert err == f"[{'q' * 16} task] oops\n"
    code, out, _ = await hypha(served, pki, tmp_path, "logs", job.job_id, "--output", "json")
    first = json.loads(out.splitlines()[0])
    assert (first["worker_name"], first["executor"], first["line"]) == (
        "worker1",
        "diloco-trainer",
        "round 1 loss 2.5",
    )
