"""The local cluster: ``up``, ``down`` and ``demo`` (their modules are imported only when used)."""

from __future__ import annotations

import argparse

from hypha.cli.paths import absolute_path
from hypha.client.registry import Command


def _add_state_dir(p: argparse.ArgumentParser, workers: bool) -> None:
    p.add_argument(
        "--state-dir", type=absolute_path, default=None, help="cluster state dir (default: .hypha)"
    )
    if workers:
        p.add_argument("--workers", type=int, default=3, help="number of workers")


def _up(args: argparse.Namespace) -> int:
    from hypha.client.cluster import DEFAULT_STATE_DIR
    from hypha.client.supervisor import up

    return up(args.state_dir or DEFAULT_STATE_DIR, args.workers)


def _down(args: argparse.Namespace) -> int:
    from hypha.client.cluster import DEFAULT_STATE_DIR
    from hypha.client.supervisor import down

    return down(args.state_dir or DEFAULT_STATE_DIR)


def _demo(args: argparse.Namespace) -> int:
    import os

    rounds = {} if args.rounds is None else {"rounds": args.rounds}
    if getattr(args, "scheduler", None) or os.environ.get("HYPHA_SCHEDULER"):
        # A cluster started elsewhere (`docker compose up`, a deployment): nothing started here.
        from hypha.client.demo import demo_remote
        from hypha.client.session import target_of

        target = target_of(args)
        return demo_remote(
            target.address,
            target.tls,
            args.output or "text",
            args.model_path,
            args.out,
            server_name=target.server_name,
            inner_steps=args.inner_steps,
            **rounds,
        )
    from hypha.client.cluster import DEFAULT_STATE_DIR
    from hypha.client.demo import demo

    return demo(args.state_dir or DEFAULT_STATE_DIR, args.workers, args.output or "text", **rounds)


def _add_demo(p: argparse.ArgumentParser) -> None:
    # NOTE: the demo module (torch, plotting) is imported only when the demo runs, never to build
    # the parser: every other command would pay for it, and break with it.
    _add_state_dir(p, True)
    p.add_argument("--rounds", type=int, default=None, help="outer DiLoCo rounds (default: the demo's own)")
    p.add_argument(
        "--inner-steps",
        type=int,
        default=50,
        help="with --scheduler: inner AdamW steps per trainer per round (default 50; fewer: quicker)",
    )
    p.add_argument(
        "--model-path",
        default="/models/arithmetic-gpt2",
        help="with --scheduler: the initial model's path on the workers (compose's demo-model writes it)",
    )
    p.add_argument(
        "--out",
        type=absolute_path,
        default=absolute_path("hypha-demo"),
        help="with --scheduler: where the trained model, plot and initial model go (default: ./hypha-demo)",
    )


UP = Command("start a local cluster (foreground; Ctrl-C stops it)", lambda p: _add_state_dir(p, True), _up)
DOWN = Command("stop the local cluster", lambda p: _add_state_dir(p, False), _down)
DEMO = Command("train a tiny model with DiLoCo on the local cluster and report", _add_demo, _demo)
