"""``hypha workers``: every worker the scheduler knows, leased or idle, once or refreshed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from rich.live import Live

from hypha.client.output import (
    NO_WORKERS,
    WORKER_HEADERS,
    console,
    json_out,
    message_dict,
    plain_table,
    print_json,
    worker_rows,
    workers_view,
)
from hypha.client.registry import EXIT_OK, Command
from hypha.client.session import Session, run_session
from hypha.v1 import scheduler_pb2


def _add_workers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch")


def _workers(args: argparse.Namespace) -> int:
    async def body(s: Session) -> int:
        out = console()
        live = Live(console=out, auto_refresh=False) if out.is_terminal and not json_out(args) else None
        with live or contextlib.nullcontext():
            while True:
                response = await s.stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=s.timeout)
                views = list(response.workers)
                if json_out(args):
                    print_json([message_dict(v) for v in views])
                elif live is not None:
                    live.update(workers_view(views), refresh=True)
                elif views:
                    print(plain_table(WORKER_HEADERS, worker_rows(views)), flush=True)
                else:
                    print(NO_WORKERS, flush=True)
                if not args.watch:
                    return EXIT_OK
                await asyncio.sleep(max(0.2, args.interval))  # a refresh rate the user chose

    try:
        return run_session(args, body)
    except KeyboardInterrupt:
        return EXIT_OK


WORKERS = Command("list every worker the scheduler knows, leased or idle", _add_workers, _workers)
