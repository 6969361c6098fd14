"""``hypha``: the client CLI (jobs, workers, the local cluster).

::

    hypha submit JOB.toml [--watch]     hypha status [JOB] [--state S]
    hypha watch JOB                     hypha cancel JOB | --all
    hypha workers [--watch]             hypha logs JOB [--follow]
    hypha fetch JOB --out DIR           hypha version
    hypha up | down | demo              (the local cluster)

Global flags (before or after the command): ``--scheduler HOST:PORT``,
``--certs DIR --name N`` (the client certificate N-cert.pem, N-key.pem,
N-trust.pem in DIR), ``--output text|json``, ``--timeout S``. Defaults come
from ``HYPHA_SCHEDULER``, ``HYPHA_CERTS`` and ``HYPHA_CLIENT_NAME``; without
them, a local cluster started by ``hypha up`` (its ``cluster.json`` in
``HYPHA_STATE_DIR`` or ``.hypha``) is used.

Exit codes: 0 ok; 1 the operation failed (not found, refused, the job
failed or was cancelled for ``watch``, the scheduler unreachable); 2 usage
(bad flags, missing settings, a malformed job file). Errors are one line on
stderr: ``hypha: error: ...``. ``--output json`` prints JSON (one document,
or one object per line for streams) for scripts.

More subcommands register through ``register(name, Command(...))`` before
``main`` runs; ``up``, ``down`` and ``demo`` are registered that way below.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

import grpc
from google.protobuf import json_format

from hypha import __version__
from hypha.errors import ConfigError, HyphaError
from hypha.net.channel import secure_channel
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

PROG = "hypha"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: Status codes that mean "your request was malformed" (exit 2 like a usage error).
_USAGE_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})
_STATES = ("pending", "allocating", "running", "succeeded", "failed", "cancelled")


class UsageError(Exception):
    """Missing or inconsistent CLI settings: exit 2."""


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def register(name: str, command: Command) -> None:
    """Add a subcommand (another module may call this before ``main``)."""
    COMMANDS[name] = command


# ---- connection settings ----------------------------------------------------------------------


def _local_cluster() -> dict[str, Any] | None:
    """The state file of a local cluster started by ``hypha up``, if there is one."""
    state = Path(os.environ.get("HYPHA_STATE_DIR", ".hypha")) / "cluster.json"
    try:
        data = json.loads(state.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Target:
    address: str
    tls: TlsMaterial
    server_name: str | None
    timeout_s: float


def target_of(args: argparse.Namespace) -> Target:
    address = getattr(args, "scheduler", None) or os.environ.get("HYPHA_SCHEDULER")
    certs = getattr(args, "certs", None) or os.environ.get("HYPHA_CERTS")
    name = getattr(args, "name", None) or os.environ.get("HYPHA_CLIENT_NAME")
    if not address or not certs:
        cluster = _local_cluster()
        if cluster is not None:
            node = cluster.get("nodes", {}).get("scheduler", {})
            address = address or node.get("address")
            certs = certs or cluster.get("pki")
    if not address:
        raise UsageError("no scheduler: give --scheduler HOST:PORT (or set HYPHA_SCHEDULER)")
    if not certs:
        raise UsageError("no client certificate: give --certs DIR --name N (or set HYPHA_CERTS)")
    try:
        tls = TlsMaterial.load(PathsTls.from_certs_dir(Path(certs), name or "client"))
    except ConfigError as err:
        raise UsageError(f"client certificate: {err.message}") from None
    return Target(address, tls, getattr(args, "server_name", None), getattr(args, "timeout", None) or 10.0)


class Session:
    """One channel to the scheduler for the duration of a command."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.channel = secure_channel(target.tls, target.address, server_name=target.server_name)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.timeout = target.timeout_s

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()


# ---- output -----------------------------------------------------------------------------------


def _json_out(args: argparse.Namespace) -> bool:
    return getattr(args, "output", None) == "json"


def _print_json(value: Any) -> None:
    print(json.dumps(value, sort_keys=True), flush=True)


def _ts(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return ""
    return dt.datetime.fromtimestamp(ts.seconds + ts.nanos / 1e9, dt.UTC).isoformat().replace("+00:00", "Z")


def state_name(value: int) -> str:
    return common_pb2.JobState.Name(value).removeprefix("JOB_STATE_").lower()


def job_dict(job: scheduler_pb2.Job) -> dict[str, Any]:
    """A job as JSON, with the same keys and values as the REST API's."""
    return {
        "job_id": job.job_id,
        "name": job.spec.name,
        "kind": job.spec.WhichOneof("kind") or "",
        "state": state_name(job.state),
        "reason": job.reason,
        "created_at": _ts(job.created_at),
        "updated_at": _ts(job.updated_at),
        "round": job.round,
        "rounds": job.rounds,
        "loss": job.loss,
        "workers": list(job.workers),
        "attempt": job.attempt,
        "exit_code": job.exit_code,
        "submitted_by": job.submitted_by,
        "spec": json_format.MessageToDict(job.spec, preserving_proto_field_name=True),
    }


def _age(ts: Any) -> str:
    seconds = max(0.0, time.time() - (ts.seconds + ts.nanos / 1e9))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _progress_text(job: scheduler_pb2.Job) -> str:
    if job.spec.WhichOneof("kind") == "diloco":
        text = f"{job.round}/{job.rounds}"
        return f"{text} loss {job.loss:.4f}" if job.loss else text
    if job.attempt:
        text = f"attempt {job.attempt}"
        return f"{text} exit {job.exit_code}" if state_name(job.state) in ("succeeded", "failed") else text
    return ""


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _print_job(job: scheduler_pb2.Job) -> None:
    d = job_dict(job)
    print(f"job       {d['job_id']}  ({d['kind']}{' ' + repr(d['name']) if d['name'] else ''})")
    print(f"state     {d['state']}{': ' + d['reason'] if d['reason'] else ''}")
    progress = _progress_text(job)
    if progress:
        print(f"progress  {progress}")
    if d["workers"]:
        print(f"workers   {', '.join(d['workers'])}")
    print(f"submitted {d['created_at']} by {d['submitted_by'] or '?'}; updated {d['updated_at']}")


# ---- commands ---------------------------------------------------------------------------------


def _run(args: argparse.Namespace, body: Callable[[Session], Any]) -> int:
    target = target_of(args)

    async def go() -> int:
        async with Session(target) as session:
            result: int = await body(session)
            return result

    return asyncio.run(go())


def _add_submit(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="job file (TOML with a [job] table); - reads stdin")
    p.add_argument("--watch", action="store_true", help="then watch the job until it ends")


def _submit(args: argparse.Namespace) -> int:
    from hypha.scheduler.jobfile import parse_job_toml

    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"{args.file}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{args.file}: not a UTF-8 text file") from None
    try:
        parse_job_toml(text)  # the scheduler checks again; this names the file's key before any call
    except HyphaError as err:
        raise UsageError(f"{args.file}: {err.message}") from None

    async def body(s: Session) -> int:
        job = await s.stub.SubmitJob(scheduler_pb2.SubmitJobRequest(toml=text), timeout=s.timeout)
        if _json_out(args):
            _print_json(job_dict(job))
        else:
            kind = job.spec.WhichOneof("kind")
            print(f"submitted job {job.job_id} ({kind}{' ' + repr(job.spec.name) if job.spec.name else ''})")
        if args.watch:
            return await _watch_stream(s, job.job_id, args)
        return EXIT_OK

    return _run(args, body)


def _add_status(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", help="job id (omit for all jobs)")
    p.add_argument("--state", action="append", choices=_STATES, help="only jobs in this state (repeatable)")


def _status(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        if args.job:
            job = await s.stub.GetJob(scheduler_pb2.GetJobRequest(job_id=args.job), timeout=s.timeout)
            if _json_out(args):
                _print_json(job_dict(job))
            else:
                _print_job(job)
            return EXIT_OK
        states = [f"JOB_STATE_{st.upper()}" for st in args.state or []]
        response = await s.stub.ListJobs(scheduler_pb2.ListJobsRequest(states=states), timeout=s.timeout)
        if _json_out(args):
            _print_json([job_dict(job) for job in response.jobs])
            return EXIT_OK
        if not response.jobs:
            print("no jobs")
            return EXIT_OK
        rows = [["JOB", "KIND", "STATE", "PROGRESS", "AGE", "NAME"]]
        for job in response.jobs:
            rows.append(
                [
                    job.job_id,
                    job.spec.WhichOneof("kind") or "",
                    state_name(job.state),
                    _progress_text(job),
                    _age(job.created_at),
                    job.spec.name,
                ]
            )
        print(_table(rows))
        return EXIT_OK

    return _run(args, body)


def _add_watch(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")


class _LiveView:
    """Redraws a block of lines in place on a terminal; plain lines otherwise."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.height = 0

    def show(self, lines: list[str]) -> None:
        if self.tty:
            if self.height:
                self.stream.write(f"\x1b[{self.height}F\x1b[J")
            self.stream.write("\n".join(lines) + "\n")
            self.height = len(lines)
        else:
            self.stream.write(lines[0] + "\n")
        self.stream.flush()


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = 0 if total <= 0 else min(width, round(width * done / total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _event_lines(event: scheduler_pb2.JobEvent, tty: bool) -> list[str]:
    job = event.job
    state = state_name(job.state)
    kind = job.spec.WhichOneof("kind")
    rate = sum(w.samples_per_second for w in event.workers)
    if not tty:
        parts = [f"{_ts(event.at)} job {job.job_id} {state}"]
        if kind == "diloco":
            parts.append(f"round {job.round}/{job.rounds}")
            if job.loss:
                parts.append(f"loss {job.loss:.4f}")
            if event.workers:
                parts.append(f"{len(event.workers)} workers {rate:.1f} samples/s")
        elif job.attempt:
            parts.append(f"attempt {job.attempt}")
        line = " ".join(parts)
        return [f"{line}: {event.message}" if event.message else line]
    head = f"job {job.job_id} ({kind}{' ' + repr(job.spec.name) if job.spec.name else ''})  {state.upper()}"
    lines = [head]
    if kind == "diloco":
        loss = f"  loss {job.loss:.4f}" if job.loss else ""
        lines.append(f"rounds {_bar(job.round, job.rounds)} {job.round}/{job.rounds}{loss}")
        for w in event.workers:
            lines.append(
                f"  {w.worker_id[:12]:12}  {w.samples_per_second:8.1f} samples/s  {w.samples:8d} samples"
                f"  batch {w.batch_size:3d}  loss {w.loss:.4f}"
            )
        if event.workers:
            lines.append(f"  total {rate:.1f} samples/s")
    elif job.attempt:
        lines.append(f"attempt {job.attempt}")
    if event.message:
        lines.append(event.message)
    return lines


async def _watch_stream(s: Session, job_id: str, args: argparse.Namespace) -> int:
    view = _LiveView(sys.stdout)
    last: scheduler_pb2.JobEvent | None = None
    async for event in s.stub.WatchJob(scheduler_pb2.WatchJobRequest(job_id=job_id)):
        last = event
        if _json_out(args):
            _print_json(
                {
                    "at": _ts(event.at),
                    "message": event.message,
                    "job": job_dict(event.job),
                    "workers": [
                        json_format.MessageToDict(w, preserving_proto_field_name=True) for w in event.workers
                    ],
                }
            )
        else:
            view.show(_event_lines(event, view.tty))
    if last is None:
        return EXIT_FAILED
    return EXIT_OK if last.job.state == common_pb2.JOB_STATE_SUCCEEDED else EXIT_FAILED


def _watch(args: argparse.Namespace) -> int:
    return _run(args, lambda s: _watch_stream(s, args.job, args))


def _add_cancel(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", nargs="?", help="job id")
    p.add_argument("--all", action="store_true", help="cancel all your active jobs (every job, for an admin)")


def _cancel(args: argparse.Namespace) -> int:
    if bool(args.job) == bool(args.all):
        raise UsageError("cancel: give a job id or --all")

    async def body(s: Session) -> int:
        request = scheduler_pb2.CancelJobRequest(job_id=args.job or "", all=args.all)
        response = await s.stub.CancelJob(request, timeout=s.timeout)
        if _json_out(args):
            _print_json({"cancelled": list(response.cancelled)})
        elif response.cancelled:
            for job_id in response.cancelled:
                print(f"cancelled {job_id}")
        else:
            print("nothing to cancel")
        return EXIT_OK

    return _run(args, body)


def _add_workers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")


def _worker_rows(views: list[scheduler_pb2.WorkerView]) -> list[str]:
    if not views:
        return ["no workers leased"]
    rows = [["WORKER", "JOB", "CPU", "MEM GB", "GPU", "GPU GB", "SAMPLES/S", "LEASES", "HEALTHY"]]
    for v in views:
        c = v.capacity
        rows.append(
            [
                v.peer.peer_id[:16],
                v.job_id or "-",
                f"{c.cpu:g}",
                f"{c.memory_gb:g}",
                f"{c.gpu:g}",
                f"{c.gpu_memory_gb:g}",
                f"{v.samples_per_second:.1f}" if v.samples_per_second else "-",
                str(len(v.leases)),
                "yes" if v.healthy else "no",
            ]
        )
    return _table(rows).splitlines()


def _workers(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        view = _LiveView(sys.stdout)
        while True:
            response = await s.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=s.timeout)
            views = list(response.workers)
            if _json_out(args):
                _print_json([json_format.MessageToDict(v, preserving_proto_field_name=True) for v in views])
            elif view.tty and args.watch:
                view.show([time.strftime("%H:%M:%S"), *_worker_rows(views)])
            else:
                print("\n".join(_worker_rows(views)), flush=True)
            if not args.watch:
                return EXIT_OK
            await asyncio.sleep(max(0.2, args.interval))  # a refresh rate the user chose

    try:
        return _run(args, body)
    except KeyboardInterrupt:
        return EXIT_OK


def _add_logs(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")


def _logs(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        request = scheduler_pb2.GetLogsRequest(job_id=args.job, follow=args.follow)
        async for line in s.stub.GetLogs(request):
            if _json_out(args):
                _print_json(json_format.MessageToDict(line, preserving_proto_field_name=True))
            else:
                out = sys.stderr if line.stream == "stderr" else sys.stdout
                print(line.line, file=out, flush=True)
        return EXIT_OK

    return _run(args, body)


def _add_fetch(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job id")
    p.add_argument("--out", required=True, type=Path, help="directory to write the result files into")


class FileSink:
    """Writes streamed result files under a directory, each checked against its sha256.

    A file is written to ``NAME.part`` and renamed only once its checksum
    matched, so a broken transfer never leaves a plausible-looking file.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.files: list[dict[str, Any]] = []
        self._handle: IO[bytes] | None = None
        self._path: Path | None = None
        self._name = ""
        self._digest = hashlib.sha256()
        self._written = 0
        self._total = 0

    def feed(self, item: scheduler_pb2.FileChunk) -> None:
        chunk = item.chunk
        if item.path:
            if self._handle is not None:
                raise HyphaError(f"{self._name}: stream moved on before the file's last chunk")
            self._open(item.path, chunk.total_size)
        if self._handle is None:
            raise HyphaError("result stream: chunk before any file name")
        if chunk.offset != self._written:
            raise HyphaError(f"{self._name}: chunk at offset {chunk.offset}, expected {self._written}")
        self._handle.write(chunk.data)
        self._digest.update(chunk.data)
        self._written += len(chunk.data)
        if chunk.last:
            self._finish(chunk.sha256)

    def _open(self, name: str, total: int) -> None:
        pure = PurePosixPath(name)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:
            raise HyphaError(f"result stream: refusing file name {name!r}")
        self._name = name
        self._path = self.out.joinpath(*pure.parts)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(self._path.with_name(self._path.name + ".part"), "wb")
        self._digest = hashlib.sha256()
        self._written, self._total = 0, total

    def _finish(self, sha256: str) -> None:
        assert self._handle is not None and self._path is not None
        self._handle.close()
        self._handle = None
        part = self._path.with_name(self._path.name + ".part")
        if self._written != self._total or self._digest.hexdigest() != sha256.lower():
            part.unlink(missing_ok=True)
            raise HyphaError(f"{self._name}: checksum or size mismatch; file discarded")
        part.replace(self._path)
        self.files.append({"path": self._name, "bytes": self._written, "sha256": sha256})

    def abort(self) -> bool:
        """Drop a file left half-written; True if there was one."""
        if self._handle is None:
            return False
        self._handle.close()
        self._handle = None
        assert self._path is not None
        self._path.with_name(self._path.name + ".part").unlink(missing_ok=True)
        return True

    def close(self) -> None:
        if self.abort():
            raise HyphaError(f"{self._name}: stream ended before the file's last chunk")


def _fetch(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        args.out.mkdir(parents=True, exist_ok=True)
        sink = FileSink(args.out)
        try:
            async for item in s.stub.FetchResult(scheduler_pb2.FetchResultRequest(job_id=args.job)):
                sink.feed(item)
        except BaseException:
            sink.abort()
            raise
        sink.close()
        if _json_out(args):
            _print_json({"job_id": args.job, "out": str(args.out), "files": sink.files})
        else:
            for f in sink.files:
                print(f"{args.out / f['path']}  {f['bytes']} bytes  sha256 {f['sha256'][:16]}")
        return EXIT_OK

    return _run(args, body)


def _version(args: argparse.Namespace) -> int:
    if _json_out(args):
        _print_json({"version": __version__, "distribution": "hypha-ml"})
    else:
        print(f"hypha-ml {__version__}")
    return EXIT_OK


# ---- the local cluster (hypha.client.cluster / demo, imported only when used) -------------------


def _add_state_dir(p: argparse.ArgumentParser, workers: bool) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="cluster state dir (default: .hypha)")
    if workers:
        p.add_argument("--workers", type=int, default=3, help="number of workers")


def _up(args: argparse.Namespace) -> int:
    from hypha.client.cluster import DEFAULT_STATE_DIR, up

    return up(args.state_dir or DEFAULT_STATE_DIR, args.workers)


def _down(args: argparse.Namespace) -> int:
    from hypha.client.cluster import DEFAULT_STATE_DIR, down

    return down(args.state_dir or DEFAULT_STATE_DIR)


def _demo(args: argparse.Namespace) -> int:
    from hypha.client.cluster import DEFAULT_STATE_DIR
    from hypha.client.demo import demo

    return demo(args.state_dir or DEFAULT_STATE_DIR, args.workers, args.output or "text", args.rounds)


def _add_demo(p: argparse.ArgumentParser) -> None:
    from hypha.client.demo import ROUNDS

    _add_state_dir(p, True)
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"outer DiLoCo rounds (default {ROUNDS})")


register("submit", Command("submit a job file", _add_submit, _submit))
register("status", Command("show one job, or list jobs", _add_status, _status))
register("watch", Command("follow a job live until it ends", _add_watch, _watch))
register("cancel", Command("cancel a job, or all your active jobs", _add_cancel, _cancel))
register("workers", Command("list the workers the scheduler leases", _add_workers, _workers))
register("logs", Command("print a job's logs", _add_logs, _logs))
register("fetch", Command("download a finished job's result", _add_fetch, _fetch))
register("version", Command("print the version", lambda p: None, _version))
register(
    "up",
    Command("start a local cluster (foreground; Ctrl-C stops it)", lambda p: _add_state_dir(p, True), _up),
)
register("down", Command("stop the local cluster", lambda p: _add_state_dir(p, False), _down))
register("demo", Command("train a tiny model with DiLoCo on the local cluster and report", _add_demo, _demo))


# ---- main ---------------------------------------------------------------------------------------


def _global_flags(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """Flags every command takes; on subcommands their defaults are suppressed so a value
    given before the command is not reset by the subcommand's parser."""
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--scheduler", metavar="HOST:PORT", default=default, help="scheduler address")
    parser.add_argument("--certs", metavar="DIR", default=default, help="directory of the client certificate")
    parser.add_argument("--name", metavar="N", default=default, help="certificate name (N-cert.pem ...)")
    parser.add_argument(
        "--server-name", metavar="NAME", default=default, help="name to expect in the server cert"
    )
    parser.add_argument("--output", choices=["text", "json"], default=default, help="output format")
    parser.add_argument("--timeout", type=float, metavar="S", default=default, help="deadline of unary calls")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Hypha client: jobs, workers, local cluster.")
    _global_flags(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        _global_flags(p, suppress=True)
        command.add_arguments(p)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = COMMANDS[args.command]
    try:
        return command.handler(args)
    except UsageError as err:
        return _fail(str(err), EXIT_USAGE)
    except grpc.aio.AioRpcError as err:
        code = err.code()
        details = err.details() or code.name
        if code == grpc.StatusCode.UNAVAILABLE:
            return _fail(f"cannot reach the scheduler: {details}", EXIT_FAILED)
        return _fail(f"{code.name}: {details}", EXIT_USAGE if code in _USAGE_CODES else EXIT_FAILED)
    except HyphaError as err:
        return _fail(err.message, EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # Output piped into something that stopped reading (e.g. `| head`).
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
