"""How ``hypha`` prints: JSON for scripts, rich tables and a live view for people.

``--output json`` prints one JSON document (or one object per line for
streams); the text forms are for terminals and may change. On a terminal,
tables and the live job view are drawn by ``rich``; when stdout is not a
terminal (a pipe, a log file), the same figures are plain lines: one
aligned row per item, one line per watch event.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp
from rich.console import Console, Group, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from hypha.client.worker_names import shown
from hypha.jobfile.kinds import kind_of
from hypha.jobview import job_json as job_dict
from hypha.jobview import state_name
from hypha.timestamps import timestamp_iso8601, to_seconds
from hypha.v1 import scheduler_pb2


def json_out(args: argparse.Namespace) -> bool:
    return getattr(args, "output", None) == "json"


def print_json(value: Any) -> None:
    print(json.dumps(value, sort_keys=True), flush=True)


def message_dict(message: Any) -> dict[str, Any]:
    """Any protobuf message as JSON, with the proto's field names."""
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


def age(ts: Timestamp) -> str:
    seconds = max(0.0, time.time() - to_seconds(ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def in_rounds(job: scheduler_pb2.Job) -> bool:
    """Whether the job's progress is rounds of trainers (its kind says: ``JobKind.in_rounds``)."""
    kind = kind_of(job.spec)
    return kind is not None and kind.in_rounds


def progress_text(job: scheduler_pb2.Job) -> str:
    if in_rounds(job):
        text = f"{job.round}/{job.rounds}"
        return f"{text} loss {job.loss:.4f}" if job.loss else text
    if job.attempt:
        text = f"attempt {job.attempt}"
        return f"{text} exit {job.exit_code}" if state_name(job.state) in ("succeeded", "failed") else text
    return ""


def console() -> Console:
    """stdout as rich sees it (``is_terminal`` decides between tables and plain lines)."""
    return Console(highlight=False)


def plain_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns without decoration, for pipes and logs (``cut``/``awk`` friendly)."""
    every = [list(headers), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in every) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in every
    )


def rich_table(headers: Sequence[str], rows: Sequence[Sequence[str]], title: str | None = None) -> Table:
    table = Table(title=title, header_style="bold")
    for header in headers:
        numeric = header in NUMERIC_COLUMNS
        table.add_column(header, justify="right" if numeric else "left", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # names are data, never markup
    return table


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: Console | None = None) -> None:
    """A rich table on a terminal, plain aligned lines otherwise."""
    out = out or console()
    if out.is_terminal:
        out.print(rich_table(headers, rows))
    else:
        print(plain_table(headers, rows), flush=True)


def print_job(job: scheduler_pb2.Job, names: Mapping[str, str] | None = None) -> None:
    """``hypha status``; ``names`` (peer id -> name) shows the workers by name."""
    d = job_dict(job)
    print(f"job       {d['job_id']}  ({d['kind']}{' ' + repr(d['name']) if d['name'] else ''})")
    print(f"state     {d['state']}{': ' + d['reason'] if d['reason'] else ''}")
    progress = progress_text(job)
    if progress:
        print(f"progress  {progress}")
    if d["workers"]:
        print(f"workers   {', '.join(shown(names, w) for w in d['workers'])}")
    print(f"submitted {d['created_at']} by {d['submitted_by'] or '?'}; updated {d['updated_at']}")


JOB_HEADERS = ("JOB", "KIND", "STATE", "PROGRESS", "AGE", "NAME")
WORKER_HEADERS = (
    "WORKER",
    "PEER ID",
    "STATE",
    "JOB",
    "CPU",
    "MEM GB",
    "GPU",
    "GPU GB",
    "SAMPLES/S",
    "LEASES",
    "SEEN",
)
NUMERIC_COLUMNS = frozenset({"CPU", "MEM GB", "GPU", "GPU GB", "SAMPLES/S", "LEASES", "AGE", "SEEN"})


def job_rows(jobs: Sequence[scheduler_pb2.Job]) -> list[list[str]]:
    return [
        [
            job.job_id,
            job.spec.WhichOneof("kind") or "",
            state_name(job.state),
            progress_text(job),
            age(job.created_at),
            job.spec.name,
        ]
        for job in jobs
    ]


def figure(value: float) -> str:
    """A resource figure as people read it: one decimal at most (``23.5``, ``16``)."""
    return f"{round(value, 1):g}"


def worker_rows(views: Sequence[scheduler_pb2.WorkerView]) -> list[list[str]]:
    """One row per worker the scheduler knows, leased or idle; its certificate name first."""
    rows = []
    for v in views:
        c = v.capacity
        rows.append(
            [
                v.peer.name or v.peer.peer_id[:16],
                v.peer.peer_id[:16],
                "leased" if v.leases or v.job_id else "idle",
                v.job_id or "-",
                figure(c.cpu),
                figure(c.memory_gb),
                figure(c.gpu),
                figure(c.gpu_memory_gb),
                f"{v.samples_per_second:.1f}" if v.samples_per_second else "-",
                str(len(v.leases)),
                age(v.last_seen) if v.HasField("last_seen") else "-",
            ]
        )
    return rows


NO_WORKERS = (
    "no workers known yet: workers become known when they answer one of this scheduler's "
    "advertisements (submit a job)"
)


def workers_view(views: Sequence[scheduler_pb2.WorkerView]) -> RenderableType:
    """The workers table for a terminal (``hypha workers``, once or ``--watch``)."""
    if not views:
        return Text(NO_WORKERS)
    leased = sum(1 for v in views if v.leases or v.job_id)
    title = f"{len(views)} workers, {leased} leased  {time.strftime('%H:%M:%S')}"
    return rich_table(WORKER_HEADERS, worker_rows(views), title=title)


def log_text(line: scheduler_pb2.LogLine) -> str:
    """A job's log line as ``hypha logs`` prints it: which worker and executor wrote it, first."""
    who = " ".join(part for part in (line.worker_name or line.worker_id[:16], line.executor) if part)
    return f"[{who}] {line.line}" if who else line.line


def event_dict(event: scheduler_pb2.JobEvent) -> dict[str, Any]:
    return {
        "at": timestamp_iso8601(event.at),
        "message": event.message,
        "job": job_dict(event.job),
        "workers": [message_dict(w) for w in event.workers],
    }


def event_line(event: scheduler_pb2.JobEvent) -> str:
    """A watch event as one plain line (pipes, logs)."""
    job = event.job
    parts = [f"{timestamp_iso8601(event.at)} job {job.job_id} {state_name(job.state)}"]
    if in_rounds(job):
        parts.append(f"round {job.round}/{job.rounds}")
        if job.loss:
            parts.append(f"loss {job.loss:.4f}")
        if event.workers:
            rate = sum(w.samples_per_second for w in event.workers)
            parts.append(f"{len(event.workers)} workers {rate:.1f} samples/s")
    elif job.attempt:
        parts.append(f"attempt {job.attempt}")
    line = " ".join(parts)
    return f"{line}: {event.message}" if event.message else line


def event_view(event: scheduler_pb2.JobEvent, names: Mapping[str, str] | None = None) -> RenderableType:
    """A watch event for a terminal: the job's state, a round progress bar, a row per worker."""
    job = event.job
    kind = job.spec.WhichOneof("kind")
    name = f" {job.spec.name!r}" if job.spec.name else ""
    parts: list[RenderableType] = [
        Text.assemble(
            (f"job {job.job_id}", "bold"), f" ({kind}{name})  ", (state_name(job.state).upper(), "cyan")
        )
    ]
    if in_rounds(job):
        bar = Progress(
            TextColumn("rounds"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}")
        )
        bar.add_task(
            f"loss {job.loss:.4f}" if job.loss else "", total=max(job.rounds, 1), completed=job.round
        )
        parts.append(bar)
        if event.workers:
            table = Table(box=None, header_style="bold")
            for header in ("WORKER", "SAMPLES/S", "SAMPLES", "BATCH", "LOSS"):
                table.add_column(header, justify="left" if header == "WORKER" else "right")
            for w in event.workers:
                table.add_row(
                    shown(names, w.worker_id),
                    f"{w.samples_per_second:.1f}",
                    str(w.samples),
                    str(w.batch_size),
                    f"{w.loss:.4f}",
                )
            rate = sum(w.samples_per_second for w in event.workers)
            table.add_row("total", f"{rate:.1f}", "", "", "")
            parts.append(table)
    elif job.attempt:
        parts.append(Text(f"attempt {job.attempt}"))
    if event.message:
        parts.append(Text(event.message))
    return Group(*parts)
