"""``hypha``: the client CLI (jobs, workers, the local cluster).

::

    hypha submit JOB.toml [--watch]     hypha status [JOB] [--state S]
    hypha watch JOB                     hypha cancel JOB | --all
    hypha workers [--watch]             hypha logs JOB [--follow]
    hypha fetch JOB --out DIR           hypha version
    hypha scale JOB --workers N
    hypha up | down | demo              (the local cluster)
    hypha tiny-model DIR                (the demo's initial model, for a job by hand)

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

Where things are: ``session`` (which scheduler, which certificate), ``output``
(JSON, tables, the live view), ``download`` (verified result files),
``commands/`` (the subcommands by group), ``registry`` (the subcommand table).
More subcommands register through ``registry.register(name, Command(...))``
before ``main`` runs; this module registers the built-in ones below.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from hypha.client.commands import jobs, local, models, workers
from hypha.client.output import json_out, print_json
from hypha.client.registry import COMMANDS, EXIT_FAILED, EXIT_OK, EXIT_USAGE, Command, UsageError, register
from hypha.errors import HyphaError
from hypha.version import DISTRIBUTION, __version__

__all__ = ["COMMANDS", "Command", "UsageError", "build_parser", "main", "register"]

PROG = "hypha"
#: Status codes that mean "your request was malformed" (exit 2 like a usage error).
_USAGE_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT})


def _version(args: argparse.Namespace) -> int:
    if json_out(args):
        print_json({"version": __version__, "distribution": DISTRIBUTION})
    else:
        print(f"hypha-ml {__version__}")
    return EXIT_OK


register("submit", jobs.SUBMIT)
register("status", jobs.STATUS)
register("watch", jobs.WATCH)
register("cancel", jobs.CANCEL)
register("scale", jobs.SCALE)
register("workers", workers.WORKERS)
register("logs", jobs.LOGS)
register("fetch", jobs.FETCH)
register("version", Command("print the version", lambda p: None, _version))
register("up", local.UP)
register("down", local.DOWN)
register("demo", local.DEMO)
register("tiny-model", models.TINY_MODEL)


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
