"""``hypha-<role> init | run | probe``: the command shape every role shares.

A role describes itself with a ``RoleCli`` (its settings class, how to build
its node, extra subcommands); ``main`` does the rest, so every role's CLI
parses, reports errors and shuts down the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypha.cli.paths import absolute_path
from hypha.config.common import NodeSettings
from hypha.config.loader import load_settings, parse_overrides
from hypha.config.template import render_example
from hypha.errors import ConfigError, HyphaError
from hypha.fsutil import write_atomic
from hypha.logs import setup_logging
from hypha.memtune import tune_malloc
from hypha.net.probe import probe
from hypha.net.telemetry import setup_tracing
from hypha.net.tls import PathsTls, TlsMaterial
from hypha.node import Node
from hypha.pki.identity import Role

log = logging.getLogger(__name__)

#: Exit codes: 0 ok, 1 unhealthy/failed, 2 usage or configuration error.
EXIT_FAILED = 1
EXIT_USAGE = 2


@dataclass
class RoleCli:
    role: Role
    prog: str
    settings_cls: type[NodeSettings]
    #: "module:function" building the node from (settings, tls): imported by ``run`` only, so
    #: ``init`` and ``probe`` (a container's healthcheck, every few seconds) never load the role's
    #: modules (a worker's pull in torch: seconds of CPU per probe).
    build: str
    description: str = ""
    #: Values ``init`` writes beyond name/tls/net, from its parsed flags.
    init_values: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    #: Extra ``init`` flags.
    init_flags: Callable[[argparse.ArgumentParser], None] | None = None
    #: Extra subcommands: name -> (help, handler(argv) -> exit code).
    commands: dict[str, tuple[str, Callable[[list[str]], int]]] = field(default_factory=dict)
    default_listen: str = "127.0.0.1:0"
    #: Called by ``run`` before anything is loaded (e.g. to harden the process).
    prepare_run: Callable[[], None] | None = None
    #: What this machine offers the role, as JSON: ``probe --machine`` (or ``probe`` without an address).
    machine_probe: Callable[[], dict[str, Any]] | None = None


def _import_build(path: str) -> Callable[[Any, TlsMaterial], Node]:
    module, _, name = path.partition(":")
    built: Callable[[Any, TlsMaterial], Node] = getattr(importlib.import_module(module), name)
    return built


def _fail(prog: str, message: str, code: int = EXIT_USAGE) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def _parser(spec: RoleCli) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=spec.prog, description=spec.description)
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init", help="write a documented example config")
    init.add_argument("--name", required=True, help="node name (its certificate files are NAME-*.pem)")
    init.add_argument(
        "--certs", required=True, type=absolute_path, help="directory holding NAME-cert/key/trust.pem"
    )
    init.add_argument("--out", required=True, type=absolute_path, help="config file to write")
    init.add_argument("--listen", default=spec.default_listen, help="HOST:PORT to serve on (port 0: any)")
    init.add_argument("--gateway", action="append", default=[], help="gateway HOST:PORT (repeatable)")
    init.add_argument("--crl", type=absolute_path, help="CRL file to honour")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    if spec.init_flags:
        spec.init_flags(init)

    run = sub.add_parser("run", help="run the node")
    run.add_argument("--config", required=True, type=absolute_path)
    run.add_argument("--listen", help="override net.listen")
    run.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override log.level")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set net.keepalive_s=30",
    )
    run.add_argument("--ready-file", type=absolute_path, help="write a JSON line here once serving")

    machine = spec.machine_probe is not None
    machine_help = "; without ADDRESS (or with --machine), print what this machine offers as JSON"
    pr = sub.add_parser(
        "probe", help="health-check a node over mTLS (exit 0 = healthy)" + (machine_help if machine else "")
    )
    pr.add_argument("address", nargs="?" if machine else None, help="HOST:PORT")
    pr.add_argument("--certs", required=not machine, type=absolute_path, help="(with ADDRESS)")
    pr.add_argument("--name", required=not machine, help="use NAME-cert/key/trust.pem from --certs")
    if machine:
        pr.add_argument(
            "--machine",
            action="store_true",
            help="print what this machine offers as a JSON object and exit 0: the executor sandbox "
            "'auto' would pick (sandbox, or sandbox_error), landlock_abi (null: no landlockpy), "
            "bwrap ('works' or why not), and the detected cpu, memory_gb, gpus, gpu_memory_gb",
        )
    pr.add_argument("--timeout", type=float, default=5.0)
    pr.add_argument("--service", default="", help="health service name (default: overall)")
    pr.add_argument(
        "--server-name",
        metavar="NAME",
        help="name to expect in the server's certificate instead of ADDRESS's host (a container "
        "probing its own node on 127.0.0.1 names the node: certificates carry no loopback SAN "
        "unless issued with --loopback)",
    )

    for name, (help_text, _) in spec.commands.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main_for(spec: RoleCli, argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in spec.commands:
        return spec.commands[argv[0]][1](argv[1:])
    args = _parser(spec).parse_args(argv)
    try:
        if args.command == "init":
            return _init(spec, args)
        if args.command == "run":
            return _run(spec, args)
        return _probe(spec, args)
    except ConfigError as err:
        return _fail(spec.prog, err.message)


def _init(spec: RoleCli, args: argparse.Namespace) -> int:
    if args.out.exists() and not args.force:
        return _fail(spec.prog, f"{args.out} exists (use --force to overwrite)")
    certs: Path = args.certs.resolve()
    tls = PathsTls.from_certs_dir(certs, args.name, args.crl.resolve() if args.crl else None)
    values: dict[str, Any] = {
        "name": args.name,
        "tls": {"cert": str(tls.cert), "key": str(tls.key), "trust": str(tls.trust)},
        "net": {"listen": args.listen, "gateways": list(args.gateway)},
    }
    if tls.crl:
        values["tls"]["crl"] = str(tls.crl)
    if spec.init_values:
        for key, value in spec.init_values(args).items():
            if isinstance(value, dict) and isinstance(values.get(key), dict):
                values[key].update(value)
            else:
                values[key] = value
    header = f"{spec.prog} configuration. Generated by `{spec.prog} init`; every key is documented."
    data = render_example(spec.settings_cls, values, header=header).encode()
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Check what we write loads back (from a file beside the target, so relative paths
    # resolve alike), so `init` never hands out a broken file; then replace the target in one
    # atomic write: an error or a crash midway leaves a previous config (--force) as it was.
    check = out.with_name(f".{out.name}.init-check")
    try:
        write_atomic(check, data, mode=0o600)
        load_settings(spec.settings_cls, check)
    finally:
        check.unlink(missing_ok=True)
    write_atomic(out, data, mode=0o644)
    print(f"wrote {out}")
    return 0


def _run(spec: RoleCli, args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.set)
    if args.listen:
        overrides.setdefault("net", {})["listen"] = args.listen
    if args.log_level:
        overrides.setdefault("log", {})["level"] = args.log_level
    if spec.prepare_run is not None:
        spec.prepare_run()
    settings = load_settings(spec.settings_cls, args.config, overrides)
    setup_logging(settings.log.level, settings.log.format, node=settings.name)
    tune_malloc()  # every node moves large payloads (hypha.memtune)
    setup_tracing(
        settings.telemetry.service_name or f"{spec.prog}:{settings.name}",
        settings.telemetry.otlp_endpoint,
        settings.telemetry.sample_ratio,
    )
    tls = TlsMaterial.load(settings.tls)
    if tls.identity.role != spec.role:
        raise ConfigError(
            f"tls.cert: certificate role is {tls.identity.role.value}, "
            f"but {spec.prog} needs a {spec.role.value} certificate"
        )
    try:
        build = _import_build(spec.build)
        return asyncio.run(_serve(lambda: build(settings, tls), args.ready_file))
    except HyphaError as err:
        return _fail(spec.prog, err.message, EXIT_FAILED)
    except OSError as err:
        return _fail(spec.prog, str(err), EXIT_FAILED)


async def _serve(build: Callable[[], Node], ready_file: Path | None) -> int:
    node = build()  # inside the loop: grpc.aio objects bind to the running loop
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await node.start()
    line = json.dumps(node.ready_info())
    print(line, flush=True)
    if ready_file:
        write_atomic(ready_file, (line + "\n").encode(), mode=0o644)
    await stop.wait()
    log.info("shutting down")
    await node.stop()
    return 0


def _probe(spec: RoleCli, args: argparse.Namespace) -> int:
    if spec.machine_probe is not None and (args.machine or args.address is None):
        print(json.dumps(spec.machine_probe(), indent=2, sort_keys=True))
        return 0
    if args.certs is None or args.name is None:
        return _fail(spec.prog, "probe ADDRESS needs --certs and --name")
    tls = TlsMaterial.load(PathsTls.from_certs_dir(args.certs, args.name))
    healthy, reason = asyncio.run(
        probe(tls, args.address, timeout_s=args.timeout, service=args.service, server_name=args.server_name)
    )
    if healthy:
        print(f"{args.address}: {reason}")
        return 0
    print(f"{args.address}: unhealthy: {reason}", file=sys.stderr)
    return EXIT_FAILED
