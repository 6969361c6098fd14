"""Job commands: ``submit``, ``status``, ``watch``, ``cancel``, ``scale``, ``logs``, ``fetch``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tomllib
from dataclasses import asdict
from pathlib import Path

from rich.live import Live

from hypha.cli.paths import absolute_path
from hypha.client.follow import follow_job
from hypha.client.output import (
    JOB_HEADERS,
    console,
    event_dict,
    event_line,
    event_view,
    job_dict,
    job_rows,
    json_out,
    log_text,
    message_dict,
    print_job,
    print_json,
    print_table,
)
from hypha.client.registry import EXIT_FAILED, EXIT_OK, Command, UsageError
from hypha.client.session import Session, run_session
from hypha.client.worker_names import WorkerNames
from hypha.errors import HyphaError
from hypha.filestream import StreamLimits, receive_files
from hypha.v1 import common_pb2, scheduler_pb2

_STATES = ("pending", "allocating", "running", "succeeded", "failed", "cancelled")


def _add_submit(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="job file (TOML with a [job] table); - reads stdin")
    p.add_argument("--watch", action="store_true", help="then watch the job until it ends")


def _submit(args: argparse.Namespace) -> int:
    from hypha.bundles import pack
    from hypha.jobfile import parse_job_toml

    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"{args.file}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{args.file}: not a UTF-8 text file") from None
    # A task's files and a relative model local_path are relative to the job file (to the
    # working directory for stdin); the scheduler gets the local_path made absolute.
    base = Path.cwd() if args.file == "-" else absolute_path(args.file).parent
    text = resolve_local_paths(text, base)
    try:
        spec = parse_job_toml(text)  # the scheduler checks again; this names the file's key before any call
        files = pack(list(spec.task.files), base) if spec.task.files else b""
    except HyphaError as err:
        raise UsageError(f"{args.file}: {err.message}") from None

    async def body(s: Session) -> int:
        request = scheduler_pb2.SubmitJobRequest(toml=text, files_bundle=files)
        job = await s.stub.SubmitJob(request, timeout=s.timeout)
        if json_out(args):
            print_json(job_dict(job))
        else:
            kind = job.spec.WhichOneof("kind")
            print(f"submitted job {job.job_id} ({kind}{' ' + repr(job.spec.name) if job.spec.name else ''})")
        if args.watch:
            return await watch_stream(s, job.job_id, args)
        return EXIT_OK

    return run_session(args, body)


def resolve_local_paths(text: str, base: Path) -> str:
    """A job file's text with each relative ``[job.model]``/``[job.preprocessor]`` ``local_path``
    made absolute against ``base`` (the job file's directory), for ``hypha submit``.

    ``local_path`` is a path on the workers, and the scheduler refuses a relative one
    (nothing there knows where the file came from). The submitting machine does know: a
    walkthrough on one machine keeps ``models/`` beside ``job.toml``, and the workers'
    ``local_model_roots`` name the same directory. The text comes back unchanged when
    nothing is relative (so the scheduler sees the user's own file) or when it is not
    valid TOML (``parse_job_toml`` then names the error); otherwise it is rewritten as
    one inline table per top-level key, which parses to the same document.
    """
    from hypha.config.template import toml_value
    from hypha.jobfile import MAX_JOB_FILE_BYTES

    if len(text) > MAX_JOB_FILE_BYTES:
        return text
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return text
    scheduler = data.get("scheduler")
    jobs = [data.get("job"), scheduler.get("job") if isinstance(scheduler, dict) else None]
    changed = False
    for job in jobs:
        if not isinstance(job, dict):
            continue
        for section in ("model", "preprocessor"):
            table = job.get(section)
            if not isinstance(table, dict):
                continue
            local = table.get("local_path")
            if isinstance(local, str) and local and not local.startswith(("/", "~")):
                table["local_path"] = os.path.normpath(base / local)
                changed = True
    if not changed:
        return text
    return "".join(f"{toml_value(key)} = {toml_value(value)}\n" for key, value in data.items())


def _add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", help="job id (omit for all jobs)")
    p.add_argument("--state", action="append", choices=_STATES, help="only jobs in this state (repeatable)")


def _status(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        if args.job:
            job = await s.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=args.job), timeout=s.timeout)
            if json_out(args):
                print_json(job_dict(job))
            else:
                print_job(job, await WorkerNames(s.stub).learn(job.workers) if job.workers else None)
            return EXIT_OK
        states = [f"JOB_STATE_{st.upper()}" for st in args.state or []]
        response = await s.stub.ListJobs(scheduler_pb2.ListJobsRequest(states=states), timeout=s.timeout)
        if json_out(args):
            print_json([job_dict(job) for job in response.jobs])
        elif not response.jobs:
            print("no jobs")
        else:
            print_table(JOB_HEADERS, job_rows(list(response.jobs)))
        return EXIT_OK

    return run_session(args, body)


def _add_watch(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")


async def watch_stream(s: Session, job_id: str, args: argparse.Namespace) -> int:
    """Print a job's events until it ends; exit 0 only if it succeeded.

    A scheduler restart does not end the watch: it reconnects (``hypha.client.follow``).

    On a terminal a rich ``Live`` view redraws the job in place; otherwise one
    plain line per event (or one JSON object per event with ``--output json``).
    """
    out = console()
    live = Live(console=out, auto_refresh=False) if out.is_terminal and not json_out(args) else None
    last: scheduler_pb2.JobEvent | None = None
    names = WorkerNames(s.stub)
    with live or contextlib.nullcontext():
        async for event in follow_job(
            s.stub, job_id, on_lost=lambda why: print(why, file=sys.stderr, flush=True)
        ):
            last = event
            if json_out(args):
                print_json(event_dict(event))
            elif live is not None:
                workers = await names.learn([w.worker_id for w in event.workers])
                live.update(event_view(event, workers), refresh=True)
            else:
                print(event_line(event), flush=True)
    if last is None:
        return EXIT_FAILED
    return EXIT_OK if last.job.state == common_pb2.JOB_STATE_SUCCEEDED else EXIT_FAILED


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _watch(args: argparse.Namespace) -> int:
    return run_session(args, lambda s: watch_stream(s, args.job, args))


def _add_cancel(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", help="job id")
    p.add_argument("--all", action="store_true", help="cancel all your active jobs (every job, for an admin)")


def _cancel(args: argparse.Namespace) -> int:
    if bool(args.job) == bool(args.all):
        raise UsageError("cancel: give a job id or --all")

    async def body(s: Session) -> int:
        request = scheduler_pb2.CancelJobRequest(job_id=args.job or "", all=args.all)
        response = await s.stub.CancelJob(request, timeout=s.timeout)
        if json_out(args):
            print_json({"cancelled": list(response.cancelled)})
        elif response.cancelled:
            for job_id in response.cancelled:
                print(f"cancelled {job_id}")
        else:
            print("nothing to cancel")
        return EXIT_OK

    return run_session(args, body)


def _add_scale(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id (a running DiLoCo job)")
    p.add_argument("--workers", type=int, required=True, help="the new trainer count (>= 1)")


def _scale(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError("scale: --workers must be at least 1")

    async def body(s: Session) -> int:
        request = scheduler_pb2.ScaleJobRequest(job_id=args.job, workers=args.workers)
        job = await s.stub.ScaleJob(request, timeout=s.timeout)
        if json_out(args):
            print_json({**job_dict(job), "target_workers": args.workers})
        else:
            # Growth starts now; shrinking waits for the next round boundary.
            print(f"scaling {job.job_id} to {args.workers} trainers")
        return EXIT_OK

    return run_session(args, body)


def _add_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")


def _logs(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        request = scheduler_pb2.GetLogsRequest(job_id=args.job, follow=args.follow)
        async for line in s.stub.GetLogs(request):
            if json_out(args):
                print_json(message_dict(line))
            else:
                out = sys.stderr if line.stream == "stderr" else sys.stdout
                print(log_text(line), file=out, flush=True)
        return EXIT_OK

    return run_session(args, body)


def _add_fetch(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")
    p.add_argument(
        "--out", required=True, type=absolute_path, help="directory to write the result files into"
    )
    # The scheduler chooses the names and sizes: a client bounds what it lets onto its disk.
    p.add_argument("--max-files", type=int, default=1000, help="refuse a result of more files (default 1000)")
    p.add_argument(
        "--max-bytes", type=int, default=64 * 1024**3, help="refuse a result of more bytes (default 64 GiB)"
    )


def _fetch(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        args.out.mkdir(parents=True, exist_ok=True)
        stream = s.stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=args.job))
        limits = StreamLimits(max_files=args.max_files, max_bytes=args.max_bytes)
        files = await receive_files(((item.path, item.chunk) async for item in stream), args.out, limits)
        if json_out(args):
            print_json({"job_id": args.job, "out": str(args.out), "files": [asdict(f) for f in files]})
        else:
            for f in files:
                print(f"{args.out / f.path}  {f.bytes} bytes  sha256 {f.sha256[:16]}")
        return EXIT_OK

    return run_session(args, body)


SUBMIT = Command("submit a job file", _add_submit, _submit)
STATUS = Command("show one job, or list jobs", _add_status, _status)
WATCH = Command("follow a job live until it ends", _add_watch, _watch)
CANCEL = Command("cancel a job, or all your active jobs", _add_cancel, _cancel)
SCALE = Command("grow or shrink a running DiLoCo job's trainers", _add_scale, _scale)
LOGS = Command("print a job's logs", _add_logs, _logs)
FETCH = Command("download a finished job's result", _add_fetch, _fetch)
